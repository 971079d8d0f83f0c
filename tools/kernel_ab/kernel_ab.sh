#!/usr/bin/env bash
# Two versions of a micro-kernel (a moe_<level>.c) timed side by side in one process, without the MoE
# driver: the A/B figures of docs/tuning-notes.md.
#
#   bash tools/kernel_ab/kernel_ab.sh [--isa LEVEL] OLD.c NEW.c [--block-k N] [--timing-only] hot|dram K m [m ...]
#   e.g.  git show HEAD~1:ktfp8/_native/moe_avx512bf16.c > /tmp/old.c
#         bash tools/kernel_ab/kernel_ab.sh /tmp/old.c ktfp8/_native/moe_avx512bf16.c dram 2048 1 4 8 16
#   Block-wise scales, one per K block of N (DeepSeek's 128), instead of per-channel ones:
#         bash tools/kernel_ab/kernel_ab.sh /tmp/old.c ktfp8/_native/moe_avx512bf16.c --block-k 128 dram 2048 1
#   AMX tiles against the register kernel below the threshold (AMX_MIN_M in moe_amx.c):
#         sed 's/^#define AMX_MIN_M .*/#define AMX_MIN_M 1/' ktfp8/_native/moe_amx.c > /tmp/amx_all.c
#         bash tools/kernel_ab/kernel_ab.sh ktfp8/_native/moe_avx512bf16.c /tmp/amx_all.c dram 2048 1 2 4 8
#   The avx2 kernel (FP32 activations), on any CPU with AVX2 and FMA (likewise --isa avx512):
#         bash tools/kernel_ab/kernel_ab.sh --isa avx2 /tmp/old_avx2.c ktfp8/_native/moe_avx2.c hot 2048 1 5 8
#   What a piece of a kernel costs: a copy with it taken out (wrong sums), the check left out:
#         bash tools/kernel_ab/kernel_ab.sh ktfp8/_native/moe_amx.c /tmp/no_a_loads.c --timing-only dram 2048 64
#
# Before timing each m the two builds run once on the same tile pair and must agree (within 1e-4 of
# the largest output; exit status 1 if not; --timing-only leaves the check out).  The activations are
# what the kernels' own tables say they read (act_dtype, and FP32 ones times 2^layout.act_exp as the
# driver hands them over).
#
# Both copies compile against this tree's include/ with the flags setup.py gives the level LEVEL
# (its BASE_CFLAGS, and the ISA flags of include/ktfp8/variants.def; default amx: AVX-512 BF16 +
# VBMI, and AMX, which an avx512_bf16 unit does not use), one object each, linked into one binary:
# two separate binaries put the same loop at different addresses, which on the Zen 5 VM moved a call
# by up to 30 % (m = 4 from L2: 1.8 against 2.4 us per tile pair), and on the Zen 3 VM the same avx2
# source ran 1.2x faster in one binary than in another with the loops at the same offsets in their
# lines.  With --isa amx a third object, this tree's moe_avx512bf16.c, is the small-m kernel an amx
# copy hands its few-token calls to.  Needs a CPU that runs LEVEL (and Linux's permission to use AMX
# tiles, to time an amx copy).
set -euo pipefail
isa=amx
if [ "${1:-}" = --isa ]; then
    isa="${2:-}"
    shift 2 || true
fi
if [ $# -lt 5 ]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
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
level_flags="$(isa_flags "$isa")" || exit 2
base_flags="$(package_cflags)" || exit 2
# shellcheck disable=SC2206  # the flags split into words
flags=($base_flags $level_flags -I"$root/include")
# the objects compile side by side; all are waited for before a failure ends the script
builds=()
for side in old new; do
    pairing=() # a unit with no tile_matmul2 is timed as the driver runs it, its two tiles in turn
    grep -q tile_matmul2 "${!side}" || pairing=(-DKERNEL_AB_TILE_BY_TILE)
    gcc "${flags[@]}" "${pairing[@]}" -DKTFP8_VARIANT=ab_$side -DKERNEL_AB_NAME=kernel_$side \
        -DKERNEL_AB_TABLE=kernel_${side}_table -DUNIT="\"${!side}\"" -c "$here/one_build.c" -o "$out/$side.o" &
    builds+=($!)
done
small_m=()
if [ "$isa" = amx ]; then
    gcc "${flags[@]}" -DKTFP8_VARIANT=avx512bf16 -c "$root/ktfp8/_native/moe_avx512bf16.c" -o "$out/small_m.o" &
    builds+=($!)
    small_m=("$out/small_m.o")
fi
gcc "${flags[@]}" -c "$root/ktfp8/_native/cpu_features.c" -o "$out/cpu_features.o" & # ktfp8_amx_permission
builds+=($!)
failed=0
for b in "${builds[@]}"; do wait "$b" || failed=1; done
[ "$failed" = 0 ] || exit 1
gcc "${flags[@]}" "$here/main.c" "$out/old.o" "$out/new.o" "${small_m[@]}" "$out/cpu_features.o" -lm -o "$out/kernel_ab"
"$out/kernel_ab" "$@"
