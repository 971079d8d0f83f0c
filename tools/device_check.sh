#!/usr/bin/env bash
# The prepared run for a lent machine (the device tool's `run`), whose host CPU may have the AVX-512
# and AMX paths no development machine here has: what the CPU is, an in-place build, then
# `python -m ktfp8.bench --quick` (the issue's table and goal lines), the kernel tests on every
# native path that CPU runs, and each backend's speed against the tokens per expert.  Everything
# lands in $OUT, at most 8 files (the tool brings back 8):
#   machine.txt  build.log  bench.log  bench-results.{txt,json,png}  tests.log  tokens.log
# From the repository root:  bash tools/device_check.sh      (device: the tool sets OUT)
# Budget: one call of the tool runs at most 10 minutes, so each step has its own limit and the
# bench, the figures the closing note needs, runs before the tests.  PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ktfp8-device-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

# step NAME SECONDS COMMAND...: runs COMMAND into $OUT/NAME.log under a time limit; prints its end
step() {
    local name=$1 limit=$2 rc
    shift 2
    echo "== $name (limit ${limit}s, started $(date -u +%T))"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: exit $rc$([ $rc = 124 ] && echo ' (time limit)')"
    return $rc
}

{
    date -u
    lscpu
    grep -m1 '^flags' /proc/cpuinfo
    free -g
    echo "python: $("$PY" -c 'import sys, numpy; print(sys.version.split()[0], "numpy", numpy.__version__)')"
    gcc --version | head -1
} > "$OUT/machine.txt" 2>&1
head -n 20 "$OUT/machine.txt"

step build 300 "$PY" setup.py -q build_ext --inplace || exit 1
"$PY" -m ktfp8.cpu | tee -a "$OUT/machine.txt"
step bench 330 "$PY" -m ktfp8.bench --quick --out "$OUT"
# every native kernel this CPU runs against the float64 oracle and `reference`, the AMX paths
# (skipped where the CPU lacks them), then paired tiles bit for bit and each emulated twin against
# its native variant, amx's included (the SDM's TDPBF16PS against an AMX core)
step tests 150 env KTFP8_COMPARE_AMX_TWIN=1 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_kernels.py \
    tests/test_moe_amx.py tests/test_moe.py tests/test_tile_pair.py
# each backend's speed against the tokens per expert, one thread per core (the default count): where
# the kernels' thresholds (DECODE_M, KEEP_M, MR, AMX_MIN_M) and the default backend stand on this CPU
step tokens 120 "$PY" -m ktfp8.bench.tokens_per_expert \
    --threads "$("$PY" -c 'from ktfp8 import backends; print(backends.usable_cores())')" --rounds 2 \
    --tokens 1,2,4,6,8,12,16,24,32
