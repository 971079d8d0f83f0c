"""Which kernels read a subnormal float while they compute on FP8 weights: none should.

E4M3's subnormal codes (exponent field 0) are real values that every checkpoint holds, more of them in
a row whose per-channel scale is set by an outlier.  Intel cores take a microcode assist, about a
hundred cycles, for every subnormal input of a floating-point multiply or FMA while DAZ is clear,
and it must be clear (fpenv.h: DAZ would drop those weights).  On an Intel Xeon VM the `avx2`
kernel, which places the codes' bits as subnormal floats, took 30x the time with uniform codes
(README, Benchmarks); `avx512`, whose fp16 route leaves every value a normal float, took the same
time.  The witness is architectural, so every CPU can check it: MXCSR's DE flag ("denormal
operand", bit 1) is set by an SSE/AVX instruction that reads a subnormal input while DAZ is clear,
on AMD as on Intel.  One tile pair of each native kernel runs directly (the tile hook leaves MXCSR
alone), over tiles that hold every non-NaN code in every row, with the flags cleared before and read
after.  `avx2` is expected to fail, strictly: it is also the check's witness (an XPASS fails)."""
import numpy as np
import pytest

from ktfp8 import backends
from ktfp8._native import _ext
from ktfp8.moe import _FORMAT_CODES
from kernel_tester import PAIRING, activation_bytes, token_counts

_testing = pytest.importorskip("ktfp8._native._testing",
                               reason="the test module is not built (KTFP8_ENABLE_EMULATED=OFF)")

DE = 0x0002                         # MXCSR: a denormal operand was read
STATUS_FLAGS = 0x003F               # MXCSR's six sticky exception flags
DAZ_FTZ = 0x0040 | 0x8000
NB = 16
K = 256                             # eight 32-K AMX slabs; 16 x 256 codes: each non-NaN code 16 times
NATIVE = [v for v in backends.usable_variants() if not v.endswith("_emulated") and v != "reference"]
AVX2_PLACES_SUBNORMALS = pytest.mark.xfail(
    strict=True, reason="avx2 places a subnormal code's bits as a subnormal float (moe_avx2.c, pair_row); "
                        "the fixes measured so far cost AMD CPUs more than they save Intel's "
                        "(docs/tuning-notes.md, Zen 4)")


def every_code_tile(rng):
    """K x 16 codes: the 254 non-NaN codes in every row of the tile (each row's K codes are that
    row's weights), shuffled, the rest of each row drawn from them."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    rows = [rng.permutation(np.concatenate([codes, rng.choice(codes, K - len(codes))])) for _ in range(NB)]
    return np.stack(rows, axis=1).ravel()  # [k][16]: the kernels' tile order, any bytes being a tile


def activations(rng, variant, n):
    """Activations of magnitude 0.5 to 2, either sign, as the kernel reads them (activation_bytes),
    so that only the weights can be subnormal."""
    a = rng.uniform(0.5, 2.0, n).astype(np.float32) * rng.choice([-1.0, 1.0], n).astype(np.float32)
    return activation_bytes(variant, a)


def flags_of_one_pair(variant, paired, m, rng):
    """MXCSR's status flags after one tile pair of `variant` over m tokens, run in IEEE mode, through
    tile_matmul2 when `paired`, else as two tile_matmul calls."""
    w = [every_code_tile(rng) for _ in range(2)]
    s = [rng.uniform(0.5, 2.0, NB).astype(np.float32) for _ in range(2)]
    rows = -(-m // 16) * 16  # the amx kernel reads whole 16-row tiles (layout.row_pad)
    a = activations(rng, variant, rows * K)
    c = [np.full(m * NB, np.nan, np.float32) for _ in range(2)]
    before = _ext.mxcsr()
    try:
        _ext.set_mxcsr(before & ~(DAZ_FTZ | STATUS_FLAGS))
        _testing.tile_pair(backends.variant(variant), paired, _FORMAT_CODES["fp8_per_channel"],
                           K, 0, 1, w[0], w[1], s[0], s[1], a, K, m, c[0], c[1])
        flags = _ext.mxcsr() & STATUS_FLAGS
    finally:
        _ext.set_mxcsr(before)
    assert all(np.isfinite(ci).all() for ci in c)
    return flags


@pytest.mark.parametrize("variant", [pytest.param(v, marks=AVX2_PLACES_SUBNORMALS) if v == "avx2" else v
                                     for v in NATIVE])
def test_no_kernel_reads_a_subnormal_on_subnormal_codes(variant):
    rng = np.random.default_rng(7)
    for paired in (False, True) if variant in PAIRING else (False,):
        for m in token_counts(variant):  # every path: decode, the first prefill block, later passes
            assert not flags_of_one_pair(variant, paired, m, rng) & DE, \
                f"{variant} m={m} ({'tile_matmul2' if paired else 'tile_matmul'}) read a subnormal operand"

