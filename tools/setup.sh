#!/usr/bin/env bash
# Sets up a fresh machine for ktfp8 development: system packages, a virtualenv in .venv, the package
# (editable, C kernels built) and the test-only dependencies.  Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# qemu-user proves the fallbacks on emulated older CPUs; libsimde-dev lets the AVX-512/AMX sources
# be compiled a second time as the *_emulated test variants on CPUs without them.
need=()
command -v qemu-x86_64 >/dev/null || need+=(qemu-user)
[ -f /usr/include/simde/x86/avx512.h ] || need+=(libsimde-dev)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "setup: please install ${need[*]} (apt-get install ${need[*]}); continuing without them" >&2
    fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU PyTorch wheel (tests: transformers' reference MoE blocks; benchmark: the PyTorch peers);
# the package itself needs no torch.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# KTransformers' own kernels, a benchmark peer (python -m ktfp8.bench) whose adapter the tests check:
# --no-deps because its metadata pins torch 2.9.1, while its CPU extension runs beside the wheel above.
.venv/bin/python -m pip install -q --no-deps "kt-kernel==0.7.2" ||
    echo "setup: kt-kernel 0.7.2 not installed; the benchmark will skip it and say so" >&2
.venv/bin/python -m ktfp8.cpu
