#!/usr/bin/env bash
# Two versions of the avx512_bf16 micro-kernel (moe_avx512bf16.c) timed side by side in one process,
# without the MoE driver: the A/B figures of docs/tuning-notes.md's Zen 5 section.
#
#   bash tools/kernel_ab/kernel_ab.sh OLD.c NEW.c hot|dram K m [m ...]
#   e.g.  git show HEAD~1:ktfp8/_native/moe_avx512bf16.c > /tmp/old.c
#         bash tools/kernel_ab/kernel_ab.sh /tmp/old.c ktfp8/_native/moe_avx512bf16.c dram 2048 1 4 8 16
#
# Both copies compile against this tree's include/ with the flags setup.py gives the avx512_bf16 unit
# (include/ktfp8/variants.def), one object each, linked into one binary: two separate binaries put the
# same loop at different addresses, which on the Zen 5 VM moved a call by up to 30 % (m = 4 from L2:
# 1.8 against 2.4 us per tile pair).  Needs a CPU with AVX-512 BF16 and VBMI.
set -euo pipefail
if [ $# -lt 5 ]; then
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
old="$(realpath "$1")" new="$(realpath "$2")"
shift 2
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
flags=(-O3 -std=gnu11 -fno-strict-aliasing -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq
       -mavx512bf16 -mavx512vbmi -I"$root/include")
gcc "${flags[@]}" -DKTFP8_VARIANT=ab_old -DKERNEL_AB_NAME=kernel_old -DUNIT="\"$old\"" -c "$here/one_build.c" -o "$out/old.o"
gcc "${flags[@]}" -DKTFP8_VARIANT=ab_new -DKERNEL_AB_NAME=kernel_new -DUNIT="\"$new\"" -c "$here/one_build.c" -o "$out/new.o"
gcc "${flags[@]}" "$here/main.c" "$out/old.o" "$out/new.o" -o "$out/kernel_ab"
"$out/kernel_ab" "$@"
