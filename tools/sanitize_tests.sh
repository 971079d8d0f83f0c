#!/usr/bin/env bash
# Builds a copy of ktfp8 with AddressSanitizer + UndefinedBehaviorSanitizer (KTFP8_SANITIZE) in a
# temporary folder -- the normal in-place build and .venv are not touched -- and runs the kernel, codec
# and driver tests against it.  Fails on any sanitizer report.
#   tools/sanitize_tests.sh [pytest args...]      (default: the codec / MoE / routing / property tests,
#                                                   on every core)
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
# KTFP8_SANITIZE_DIR=DIR builds in DIR and keeps it (to debug a finding); default: a temp folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=$root/.venv/bin/python; else PYTHON=python3; fi
fi
tests=("$@")
# (-k "not family": test_routing's checks against each model family's transformers block, 222 of its 280
# tests, call route()'s C code as its oracle tests do; Zen 3 VM: 725 tests in 185 s, 947 in 208 s with them)
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_fp8_codec.py tests/test_moe.py tests/test_moe_errors.py
                                 tests/test_properties.py tests/test_concurrency.py tests/test_routing.py
                                 tests/test_kernels.py -k "not family")

if [ -n "${KTFP8_SANITIZE_DIR:-}" ]; then
    mkdir -p "$KTFP8_SANITIZE_DIR" && work=$(cd "$KTFP8_SANITIZE_DIR" && pwd)
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/ktfp8-sanitize.XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi
# tracked and untracked-but-not-ignored files: what a clean clone plus local edits would hold
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"
done | xargs -0 cp --parents -t "$work"
cd "$work"
echo "sanitize: building in $work"
# Native AVX-512 / AMX units that this CPU cannot run would only cost build time: their sources are
# checked here through the *_emulated copies (SIMDe + tile emulation), which are built either way.
if ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    export KTFP8_ENABLE_AVX512=OFF KTFP8_ENABLE_AVX512_BF16=OFF KTFP8_ENABLE_AMX=OFF
fi
KTFP8_SANITIZE=address,undefined "$PYTHON" setup.py -q build_ext --inplace >build.log 2>&1 || {
    tail -40 build.log; echo "sanitize: build failed" >&2; exit 1; }
grep "ISA units compiled" build.log || true
# the package's module and the test module (the *_emulated variants the tests run)
for ext in ktfp8/_native/_ext*.so ktfp8/_native/_testing*.so; do
    [ -e "$ext" ] || { echo "sanitize: $ext was not built" >&2; exit 1; }
    libs=$(ldd "$ext")  # (not piped into grep -q: under pipefail its early exit would fail the pipe)
    case "$libs" in *libasan*) ;; *) echo "sanitize: $ext is not linked with ASan" >&2; exit 1;; esac
    case "$libs" in *libubsan*) ;; *) echo "sanitize: $ext is not linked with UBSan" >&2; exit 1;; esac
done

# The extension links libasan; it must be the first library loaded into python, hence LD_PRELOAD.
# detect_leaks=0: CPython does not free everything at exit by design.
asan=$(gcc -print-file-name=libasan.so)
export LD_PRELOAD=$asan
# Reports go to files, one per process: pytest-xdist's workers (and the tests' own subprocesses) do not
# hand their stderr to the terminal, so a report printed there would be lost with only "worker crashed" left.
mkdir -p "$work/sanitizer-reports"
report="$work/sanitizer-reports/report"
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:strict_string_checks=1:log_path=$report
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$report
export PYTHONDONTWRITEBYTECODE=1
# the sanitized copy, not an installed/editable ktfp8, must be the one imported
where=$("$PYTHON" -c "import ktfp8._native._ext as e; print(e.__file__)")
case "$where" in "$work"/*) ;; *) echo "sanitize: imported $where, not the sanitized build" >&2; exit 1;; esac

# The default set on every core (pytest-xdist, where installed: the test extra has it); pytest
# arguments of your own run as given (add -n yourself; --pdb, for one, refuses it).
jobs=()
if [ $# -eq 0 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then jobs=(-n auto); fi
status=0
"$PYTHON" -m pytest -q -p no:cacheprovider "${jobs[@]}" "${tests[@]}" 2>&1 | tee pytest.log || status=$?
findings=0
for f in "$work"/sanitizer-reports/report.*; do
    [ -e "$f" ] || continue
    cat "$f"
    findings=$((findings + $(grep -cE "ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer" "$f" || true)))
done
echo "sanitize: $findings sanitizer report(s); pytest exit status $status"
[ "$findings" -eq 0 ] && [ "$status" -eq 0 ]
