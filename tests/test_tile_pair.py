"""tile_matmul2 == tile_matmul + tile_matmul, bit for bit, on every kernel that pairs tiles.

The driver hands a kernel two weight tiles over the same activations (gate and up; adjacent down
tiles) through tile_matmul2 when the kernel has one.  The outputs must not depend on that: each
tile's sums in the same order as its own tile_matmul, so a forward gives the same bits whichever
way the driver groups its tiles.  Comparing MoE outputs cannot show it once the driver pairs
everywhere, so this calls one job pair directly (ktfp8._native._testing.tile_pair) on every
pairing variant this machine runs, native or emulated, at every token count where the kernels
change path, in every weight format.  The weights need no packing for this: any bytes are a tile
(codes without the NaN codes, bf16 values without NaN), so the outputs are finite, differ between
the two tiles, and overwrite the NaN they start as."""
import os

import numpy as np
import pytest

from ktfp8 import backends
from ktfp8.moe import _FORMAT_CODES
from kernel_tester import KERNELS, PAIRING, activation_bytes, token_counts

_testing = pytest.importorskip("ktfp8._native._testing",
                               reason="the test module is not built (KTFP8_ENABLE_EMULATED=OFF)")

# variants whose kernel has a tile_matmul2, native where this CPU runs them, emulated otherwise
PAIRED = [v for v in backends.usable_variants() if v.removesuffix("_emulated") in PAIRING]
NB = 16
ROW_TILE = 16  # activation rows the tile kernels read at a time (amx: layout.row_pad)
# 192: six 32-K AMX slabs, 96 pairs; 32: one slab (the smallest padded K: a ring of slabs must not
# outgrow the scratch of a whole tile)
KS = (192, 32)

# name: (weight format, block_k).  34 = 2 mod 4: K blocks start in the middle of a 64-byte code
# group; 64: whole AMX slabs (the tile path takes it); 48: splits the slabs (avx512_bf16 takes it)
FORMATS = {"per_channel": ("fp8_per_channel", 0), "block34": ("fp8_block", 34), "block64": ("fp8_block", 64),
           "block48": ("fp8_block", 48), "bf16": ("bf16", 0)}
BF16 = _FORMAT_CODES["bf16"]


def pair_token_counts(variant):
    """Every m at which the variant's kernel (with amx, avx512_bf16's too) changes path or fills a
    register block, and every decode m (each its own register blocking)."""
    unit = variant.removesuffix("_emulated")
    if unit == "avx2":
        d = KERNELS["avx2"].defines
        return sorted(set(token_counts("avx2")) | set(range(1, d["DECODE_M"] + 1)))
    d = KERNELS["avx512_bf16"].defines
    return sorted(set(token_counts("avx512_bf16")) | set(token_counts("amx")) | set(range(1, d["DECODE_M"] + 1)))


def random_activations(rng, variant, n):
    """n standard normal activations as raw bytes of the variant kernel's (activation_bytes)."""
    return activation_bytes(variant, rng.standard_normal(n).astype(np.float32))


def random_tile(rng, fmt, K):
    if fmt == BF16:
        bits = (rng.standard_normal(K * NB).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8)
    codes = rng.integers(0, 256, K * NB, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # NaN codes -> 1.0
    return codes


def job_pair(fmt, K, formats=FORMATS):
    """Two weight tiles of K in format `fmt` (a key of `formats`) and their scales, and the random
    stream that made them (seeded by the format), for the activations."""
    name, block_k = formats[fmt]
    code = _FORMAT_CODES[name]
    n_kblocks = -(-K // block_k) if block_k else 1
    rng = np.random.default_rng(code * 100 + block_k)
    w = [random_tile(rng, code, K) for _ in range(2)]
    s = [rng.uniform(0.5, 2.0, NB * n_kblocks).astype(np.float32) for _ in range(2)]
    return rng, (code, K, block_k, n_kblocks, w[0], w[1], s[0], s[1])


def run_pair(variant, paired, jobs, rows, a_stride, m):
    """The two jobs' outputs (float32, m x 16 each, NaN before the call) after one tile_pair call of
    `variant` (a name) on activation rows `rows`."""
    c = [np.full(m * NB, np.nan, np.float32) for _ in range(2)]
    _testing.tile_pair(backends.variant(variant), paired, *jobs, rows, a_stride, m, c[0], c[1])
    return c


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("variant", PAIRED)
def test_paired_tiles_give_the_bits_of_single_tiles(variant, fmt, K):
    rng, jobs = job_pair(fmt, K)
    a_stride = K + 32  # rows not back to back, as the driver's gathered rows
    for m in pair_token_counts(variant):
        # the rows up to a whole 16-row tile, which the amx kernel reads (layout.row_pad), hold other
        # values in a third call: they must not reach the m rows written out
        padded = -(-m // ROW_TILE) * ROW_TILE
        a = random_activations(rng, variant, padded * a_stride)
        other_pad = a.copy()
        other_pad[m * (len(a) // padded):] = random_activations(rng, variant, (padded - m) * a_stride)
        out = {}
        for case, paired, rows in (("paired", True, a), ("single", False, a), ("other pad rows", True, other_pad)):
            c = run_pair(variant, paired, jobs, rows, a_stride, m)
            assert all(np.isfinite(ci).all() for ci in c), (m, case)
            out[case] = [ci.view(np.uint32) for ci in c]
        assert not np.array_equal(out["paired"][0], out["paired"][1]), m
        for t in range(2):
            np.testing.assert_array_equal(out["paired"][t], out["single"][t], err_msg=f"{variant} {fmt} m={m} tile {t}")
            np.testing.assert_array_equal(out["other pad rows"][t], out["paired"][t],
                                          err_msg=f"{variant} {fmt} m={m} tile {t}: the rows past m changed it")


# amx's parked pass (49..256 tokens of FP8 weights) runs K in blocks of up to 8 slabs: 22 slabs make
# blocks of 8, 8, 6; a scale block of 10 slabs (320) makes blocks of 5, its last one of 2 slabs
PARKED_K = 704
PARKED_FORMATS = {"per_channel": ("fp8_per_channel", 0), "block64": ("fp8_block", 64),
                  "block320": ("fp8_block", 320)}


@pytest.mark.parametrize("fmt", list(PARKED_FORMATS))
@pytest.mark.parametrize("variant", [v for v in PAIRED if v.removesuffix("_emulated") == "amx"])
def test_amx_parked_pass_gives_the_bits_of_single_tiles(variant, fmt):
    rng, jobs = job_pair(fmt, PARKED_K, PARKED_FORMATS)
    a_stride = PARKED_K + 32
    for m in (49, 50, 63, 64, 65, 80, 81, 250, 256):
        a = random_activations(rng, variant, -(-m // ROW_TILE) * ROW_TILE * a_stride)
        paired, single = (run_pair(variant, p, jobs, a, a_stride, m) for p in (True, False))
        for t in range(2):
            assert np.isfinite(paired[t]).all(), (m, t)
            np.testing.assert_array_equal(paired[t].view(np.uint32), single[t].view(np.uint32),
                                          err_msg=f"{variant} {fmt} m={m} tile {t}")


def test_tile_pair_refuses_jobs_its_buffers_do_not_fit():
    K = KS[0]
    w = np.zeros(K * NB, np.uint8)
    s = np.ones(NB, np.float32)
    a = np.zeros(2 * K, np.uint8)
    c = np.zeros(NB, np.float32)
    per_channel = _FORMAT_CODES["fp8_per_channel"]
    for variant in PAIRED:
        with pytest.raises(ValueError, match="do not fit"):  # m = 2 rows of output, c holds one
            _testing.tile_pair(backends.variant(variant), True, per_channel, K, 0, 1, w, w, s, s, a, K, 2, c, c)


# emulated twins whose native variant this CPU runs: the same source, compiled for SIMDe, must give
# the native instructions' bits (vdpbf16ps: odd products first, DAZ, FTZ; checked on the Zen 4 VM).
# amx_emulated only with KTFP8_COMPARE_AMX_TWIN=1 (tools/device_check.sh sets it): its tiles follow
# the SDM's TDPBF16PS, which no AMX core has been compared with yet, so a mismatch would say nothing
# about the product in CI.
TWIN_NAMES = ("avx512_emulated", "avx512_bf16_emulated") + (
    ("amx_emulated",) if os.environ.get("KTFP8_COMPARE_AMX_TWIN") == "1" else ())
TWINS = [v for v in TWIN_NAMES
         if v in backends.usable_variants() and v.removesuffix("_emulated") in backends.usable_variants()]


@pytest.mark.skipif(not TWINS, reason="this CPU runs no native variant that has an emulated twin")
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("twin", TWINS)
def test_emulated_twin_gives_the_native_bits(twin, fmt):
    K = KS[0]
    rng, jobs = job_pair(fmt, K)
    for m in pair_token_counts(twin):
        padded = -(-m // ROW_TILE) * ROW_TILE
        a = random_activations(rng, twin, padded * K)
        out = {v: [ci.view(np.uint32) for ci in run_pair(v, True, jobs, a, K, m)]
               for v in (twin, twin.removesuffix("_emulated"))}
        for t in range(2):
            np.testing.assert_array_equal(out[twin][t], out[twin.removesuffix("_emulated")][t],
                                          err_msg=f"{twin} {fmt} m={m} tile {t}")
