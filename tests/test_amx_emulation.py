"""The AMX tile emulation (include/ktfp8/amx_emulation.h) against the Intel SDM's TDPBF16PS.

The oracle is a plain loop over exact rationals (tests/sdm_bf16.py) that follows the SDM's Operation section: per
destination row, the even and the odd BF16 products are accumulated into two separate FP32 sums
(each step one FMA rounding, round-to-nearest-even), those two are added, and the result is added
to the destination; BF16 denormal inputs and FP32 denormal destination values read as zero; every
result that is below 2^-126 after rounding to 24 bits (x86 tininess after rounding) becomes zero.
"""
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from sdm_bf16 import bf16_value, f32_value, random_bf16, round_f32_ftz

_testing = pytest.importorskip("ktfp8._native._testing", reason="the test module is not built (KTFP8_ENABLE_EMULATED=OFF)")


def tilecfg(shapes):
    """64-byte LDTILECFG operand, palette 1; shapes = {tile: (rows, colsb)}."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb = np.zeros(16, np.uint16)
    rows = np.zeros(16, np.uint8)
    for t, (r, c) in shapes.items():
        rows[t], colsb[t] = r, c
    cfg[16:48] = colsb.view(np.uint8)
    cfg[48:64] = rows
    return cfg


def sdm_dpbf16ps(c, a, b, rows, pairs, cols):
    """The oracle: c fp32 [rows][cols], a bf16 bits [rows][2 * pairs], b bf16 bits [pairs][2 * cols]."""
    out = np.zeros((rows, cols), np.float32)
    for m in range(rows):
        temp = [Fraction(0)] * (2 * cols)
        for k in range(pairs):
            a0, a1 = bf16_value(a[m, 2 * k]), bf16_value(a[m, 2 * k + 1])
            for n in range(cols):
                temp[2 * n] = round_f32_ftz(temp[2 * n] + a0 * bf16_value(b[k, 2 * n]))
                temp[2 * n + 1] = round_f32_ftz(temp[2 * n + 1] + a1 * bf16_value(b[k, 2 * n + 1]))
        for n in range(cols):
            pair_sum = round_f32_ftz(temp[2 * n] + temp[2 * n + 1])
            out[m, n] = float(round_f32_ftz(f32_value(c[m, n]) + pair_sum))
    return out


def run_emulated(c, a, b, rows, pairs, cols, tiles=(1, 4, 6), strides=None):
    """One emulated TDPBF16PS with the given shapes; c/out use c's row stride, a/b their own.
    Returns the whole output buffer (bytes the store did not touch keep the sentinel 0xAB)."""
    d, ta, tb = tiles
    cfg = tilecfg({d: (rows, 4 * cols), ta: (rows, 4 * pairs), tb: (pairs, 4 * cols)})
    out = np.full(c.shape, np.float32(0), np.float32)
    out.view(np.uint8)[...] = 0xAB
    ok = _testing.amx_emulated_dpbf16ps(cfg, d, ta, tb, c.view(np.uint8).reshape(-1), c.strides[0],
                                    a.view(np.uint8).reshape(-1), a.strides[0],
                                    b.view(np.uint8).reshape(-1), b.strides[0], out.view(np.uint8).reshape(-1))
    assert ok
    return out


def test_full_tile_is_bit_exact_with_the_sdm_loop():
    rng = np.random.default_rng(1)
    a = random_bf16(rng, (16, 32))
    b = random_bf16(rng, (16, 32))
    c = rng.standard_normal((16, 16)).astype(np.float32) * 1e3
    out = run_emulated(c, a, b, rows=16, pairs=16, cols=16)
    np.testing.assert_array_equal(out, sdm_dpbf16ps(c, a, b, 16, 16, 16))


def test_partial_tiles_use_the_configured_rows_and_columns_only():
    """rows 5, 6 K pairs, 9 columns, strides wider than the rows: the store writes exactly
    5 rows x 36 bytes, and the padding around the tiles in memory is never read."""
    rng = np.random.default_rng(2)
    rows, pairs, cols = 5, 6, 9
    a = random_bf16(rng, (7, 20))          # only [:5, :12] is the A tile
    b = random_bf16(rng, (8, 24))          # only [:6, :18] is the B tile
    c = rng.standard_normal((6, 12)).astype(np.float32)
    a[rows:, :] = a[:, 2 * pairs:] = 0x7FC0  # NaN outside the tiles: must not leak in
    b[pairs:, :] = b[:, 2 * cols:] = 0x7FC0
    c[rows:, :] = c[:, cols:] = np.nan
    out = run_emulated(c, a, b, rows, pairs, cols)
    np.testing.assert_array_equal(out[:rows, :cols],
                                  sdm_dpbf16ps(c, a[:rows, :2 * pairs], b[:pairs, :2 * cols], rows, pairs, cols))
    untouched = out.view(np.uint32).copy()
    untouched[:rows, :cols] = 0xABABABAB
    assert np.all(untouched == 0xABABABAB)


def test_denormal_bf16_inputs_read_as_zero():
    # 2^-133 (bf16 denormal 0x0001 .. 0x007F) times 2^100 would be a visible 2^-33 without DAZ
    a = np.zeros((1, 2), np.uint16)
    b = np.zeros((1, 2), np.uint16)
    a[0] = [0x0001, 0x3F80]                # denormal, 1.0
    b[0] = [0x7180, 0x807F]                # 2^100, -denormal
    c = np.array([[0.5]], np.float32)
    out = run_emulated(c, a, b, rows=1, pairs=1, cols=1)
    assert out[0, 0] == 0.5                # both products are exactly zero
    np.testing.assert_array_equal(out, sdm_dpbf16ps(c, a, b, 1, 1, 1))


def test_denormal_destination_reads_as_zero():
    a = np.array([[0x3F80, 0]], np.uint16)              # 1.0
    b = np.array([[0x0080, 0]], np.uint16)              # 2^-126, the smallest normal
    c = np.array([[2.0**-127]], np.float32)             # an FP32 denormal in the accumulator
    out = run_emulated(c, a, b, rows=1, pairs=1, cols=1)
    assert out[0, 0] == np.float32(2.0**-126)           # not 1.5 * 2^-126


def test_tiny_results_flush_to_zero_after_rounding():
    a = np.zeros((2, 4), np.uint16)
    b = np.zeros((2, 4), np.uint16)
    # row 0, even lane: 2^-70 * 2^-70 = 2^-140 is an FP32 denormal -> 0
    a[0, 0], b[0, 0] = 0x1C80, 0x1C80
    # row 1, even lane: 2^-63 * 2^-63 = 2^-126, then + (-(129 * 255) * 2^-166): the exact sum
    # 2^-126 - 1.004 * 2^-151 rounds to 2^-126 at denormal precision but to 2^-126 - 2^-150 with
    # 24 bits and an unbounded exponent, which is tiny: x86 FTZ gives 0
    a[1, 0], b[0, 0 + 2] = 0x2000, 0x2000                # k = 0: a[1][0] * b[0][2] (column 1)
    a[1, 2], b[1, 2] = 0x1981, 0x99FF                    # k = 1: 1.0078125 * 2^-76, -1.9921875 * 2^-76
    c = np.zeros((2, 2), np.float32)
    out = run_emulated(c, a, b, rows=2, pairs=2, cols=2)
    np.testing.assert_array_equal(out, sdm_dpbf16ps(c, a, b, 2, 2, 2))
    assert out[0, 0] == 0 and out[1, 1] == 0


def test_even_and_odd_products_are_summed_separately_before_the_destination():
    """SDM order: even sum (1 - 1 = 0) and odd sum (2^-30) first, then added: 2^-30.  Adding each
    product to the destination in turn (1, + 2^-30 -> 1, - 1 -> 0) would give 0."""
    a = np.array([[0x3F80, 0x3800, 0x3F80, 0x0000]], np.uint16)  # 1, 2^-15 | 1, 0
    b = np.array([[0x3F80, 0x3800], [0xBF80, 0x0000]], np.uint16)  # k0: 1, 2^-15; k1: -1, 0
    c = np.zeros((1, 1), np.float32)
    out = run_emulated(c, a, b, rows=1, pairs=2, cols=1)
    assert out[0, 0] == np.float32(2.0**-30)


def test_short_buffer_is_refused():
    c = np.zeros((16, 16), np.float32)
    a = np.zeros((16, 32), np.uint16)
    b = np.zeros((15, 32), np.uint16)  # one row short of the 16 x 64-byte B tile
    cfg = tilecfg({0: (16, 64), 1: (16, 64), 2: (16, 64)})
    out = np.zeros_like(c)
    assert not _testing.amx_emulated_dpbf16ps(cfg, 0, 1, 2, c.view(np.uint8).reshape(-1), 64,
                                          a.view(np.uint8).reshape(-1), 64, b.view(np.uint8).reshape(-1), 64,
                                          out.view(np.uint8).reshape(-1))


@pytest.mark.parametrize("shapes, tiles, message", [
    ({0: (16, 64), 1: (16, 64), 2: (15, 64)}, (0, 1, 2), "tsrc1.colsb != 4 * tsrc2.rows"),
    ({0: (16, 64), 1: (8, 64), 2: (16, 64)}, (0, 1, 2), "tsrcdest.rows != tsrc1.rows"),
    ({0: (16, 64), 1: (16, 64)}, (0, 1, 1), "must differ"),
])
def test_shapes_the_hardware_faults_on_abort(shapes, tiles, message):
    """Where TDPBF16PS raises #UD the emulation aborts with a message (it is a kernel bug)."""
    code = f"""
import numpy as np
from ktfp8._native import _testing
cfg = np.frombuffer({bytes(tilecfg(shapes))!r}, np.uint8).copy()
buf = np.zeros(1024, np.uint8)
_testing.amx_emulated_dpbf16ps(cfg, *{tiles!r}, buf, 64, buf, 64, buf, 64, buf.copy())
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "tdpbf16ps" in run.stderr and message in run.stderr
