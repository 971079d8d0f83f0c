#!/usr/bin/env bash
# Sets up a fresh machine for ktfp8 development: system packages, a virtualenv in .venv, the package
# (editable, C kernels built) and the test-only dependencies.  Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# qemu-user proves the fallbacks on emulated older CPUs; libsimde-dev lets the AVX-512/AMX sources
# be compiled a second time as the *_emulated test variants on CPUs without them.
# The build itself needs a C compiler, Python's headers and its venv module (python3-dev, python3-venv:
# not on a minimal Debian/Ubuntu).
PY=${PYTHON:-python3}
need=()
command -v qemu-x86_64 >/dev/null || need+=(qemu-user)
[ -f /usr/include/simde/x86/avx512.h ] || need+=(libsimde-dev)
command -v "${CC:-gcc}" >/dev/null || need+=(gcc)
"$PY" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
    need+=(python3-dev)
"$PY" -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    # apt failing (no network, another apt running) is not fatal here: the build says what it lacks
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null &&
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; then
        :
    else
        echo "setup: please install ${need[*]} (apt-get install ${need[*]}); continuing without them" >&2
    fi
fi

# A venv that an earlier run left half made (python3-venv missing: no pip in it) is made again.
.venv/bin/python -m pip --version >/dev/null 2>&1 || "$PY" -m venv --clear .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of PyTorch (tests: transformers' reference MoE blocks; benchmark: the PyTorch peers);
# the package itself needs no torch.  PyPI's torch for Linux x86-64 is the CUDA build (several GB), so
# where pip finds no wheel of it on this machine (its find-links), the CPU build is asked for by its
# local version, +cpu, which only PyTorch's index holds: unreachable, the install fails and says so.
TORCH=2.13.0
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
    if .venv/bin/python -m pip install -q --dry-run --no-deps --no-index "torch==$TORCH" >/dev/null 2>&1; then
        .venv/bin/python -m pip install -q "torch==$TORCH"
    else
        .venv/bin/python -m pip install -q "torch==$TORCH+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
fi
.venv/bin/python -m pip install -q -e ".[test]"
# KTransformers' own kernels, a benchmark peer (python -m ktfp8.bench) whose adapter the tests check:
# --no-deps because its metadata pins torch 2.9.1, while its CPU extension runs beside the wheel above.
.venv/bin/python -m pip install -q --no-deps "kt-kernel==0.7.2" ||
    echo "setup: kt-kernel 0.7.2 not installed; the benchmark will skip it and say so" >&2
.venv/bin/python -m ktfp8.cpu
