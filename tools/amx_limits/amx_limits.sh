#!/usr/bin/env bash
# The amx kernel's tile pair taken apart on this CPU (amx_limits.c says what each line times):
#
#   bash tools/amx_limits/amx_limits.sh [vector instructions per slab beside the tiles, default 128]
#                                       [their mix: mix (default) | permute | shift | add]
#
# Builds against this tree's include/ with the flags setup.py gives the amx unit (AVX-512 BW/VBMI,
# AMX-TILE, AMX-BF16) and links cpu_features.c for Linux's AMX permission.  Needs a CPU with AMX.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# shellcheck source=../isa_flags.sh
source "$root/tools/isa_flags.sh"
amx_flags="$(isa_flags amx)"
# shellcheck disable=SC2206  # the flags split into words
flags=(-O2 -std=gnu11 -fno-strict-aliasing $amx_flags -I"$root/include")
gcc "${flags[@]}" "$here/amx_limits.c" "$root/ktfp8/_native/cpu_features.c" -o "$out/amx_limits"
"$out/amx_limits" "$@"
