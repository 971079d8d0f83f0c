#!/usr/bin/env bash
# Two versions of a BF16-activation micro-kernel (moe_avx512bf16.c or moe_amx.c) timed side by side in
# one process, without the MoE driver: the A/B figures of docs/tuning-notes.md's Zen 5 and AMX sections.
#
#   bash tools/kernel_ab/kernel_ab.sh OLD.c NEW.c hot|dram K m [m ...]
#   e.g.  git show HEAD~1:ktfp8/_native/moe_avx512bf16.c > /tmp/old.c
#         bash tools/kernel_ab/kernel_ab.sh /tmp/old.c ktfp8/_native/moe_avx512bf16.c dram 2048 1 4 8 16
#   AMX tiles against the register kernel below the threshold (AMX_MIN_M in moe_amx.c):
#         sed 's/^#define AMX_MIN_M .*/#define AMX_MIN_M 1/' ktfp8/_native/moe_amx.c > /tmp/amx_all.c
#         bash tools/kernel_ab/kernel_ab.sh ktfp8/_native/moe_avx512bf16.c /tmp/amx_all.c dram 2048 1 2 4 8
#
# Before timing each m the two builds run once on the same tile pair and must agree (within 1e-4 of
# the largest output; exit status 1 if not).
#
# Both copies compile against this tree's include/ with the flags setup.py gives the amx unit
# (include/ktfp8/variants.def: AVX-512 BF16 + VBMI, and AMX, which an avx512_bf16 unit does not use),
# one object each, linked into one binary: two separate binaries put the same loop at different
# addresses, which on the Zen 5 VM moved a call by up to 30 % (m = 4 from L2: 1.8 against 2.4 us per
# tile pair).  A third object, this tree's moe_avx512bf16.c, is the small-m kernel an amx copy hands
# its few-token calls to.  Needs a CPU with AVX-512 BF16 and VBMI (and AMX, with Linux's permission to
# use it, to time an amx copy).
set -euo pipefail
if [ $# -lt 5 ]; then
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
old="$(realpath "$1")" new="$(realpath "$2")"
shift 2
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# shellcheck source=../isa_flags.sh
source "$root/tools/isa_flags.sh"
amx_flags="$(isa_flags amx)"
# shellcheck disable=SC2206  # the flags split into words
flags=(-O3 -std=gnu11 -fno-strict-aliasing $amx_flags -I"$root/include")
# the objects compile side by side; all are waited for before a failure ends the script
gcc "${flags[@]}" -DKTFP8_VARIANT=ab_old -DKERNEL_AB_NAME=kernel_old -DUNIT="\"$old\"" -c "$here/one_build.c" -o "$out/old.o" &
builds=($!)
gcc "${flags[@]}" -DKTFP8_VARIANT=ab_new -DKERNEL_AB_NAME=kernel_new -DUNIT="\"$new\"" -c "$here/one_build.c" -o "$out/new.o" &
builds+=($!)
gcc "${flags[@]}" -DKTFP8_VARIANT=avx512bf16 -c "$root/ktfp8/_native/moe_avx512bf16.c" -o "$out/small_m.o" &
builds+=($!)
gcc "${flags[@]}" -c "$root/ktfp8/_native/cpu_features.c" -o "$out/cpu_features.o" & # ktfp8_amx_permission
builds+=($!)
failed=0
for b in "${builds[@]}"; do wait "$b" || failed=1; done
[ "$failed" = 0 ] || exit 1
gcc "${flags[@]}" "$here/main.c" "$out/old.o" "$out/new.o" "$out/small_m.o" "$out/cpu_features.o" -o "$out/kernel_ab"
"$out/kernel_ab" "$@"
