"""The VDPBF16PS the *_emulated kernels run (include/ktfp8/bf16_dot_emulation.h) against the Intel SDM.

The oracle (tests/sdm_bf16.py) follows the SDM's Operation section: per FP32 lane i, the odd BF16
product (elements 2i + 1) is accumulated first, then the even one, each an FMA rounded once to
nearest-even, with denormal inputs (the accumulator too) read as zero and tiny results flushed.
The emulated twin of the avx512_bf16 kernel gives the native kernel's bits where this CPU runs it
(tests/test_tile_pair.py); this file pins the instruction itself on every machine."""
import numpy as np
import pytest

from sdm_bf16 import bf16_value, f32_value, random_bf16, round_f32_ftz

_testing = pytest.importorskip("ktfp8._native._testing", reason="the test module is not built (KTFP8_ENABLE_EMULATED=OFF)")

ONE = 0x3F80  # bf16 1.0


def sdm_vdpbf16ps(acc, src1, src2):
    """The oracle: acc fp32 [16], src1 and src2 bf16 bits [32]."""
    out = np.zeros(16, np.float32)
    for i in range(16):
        lane = f32_value(acc[i])
        for e in (2 * i + 1, 2 * i):  # odd product first
            lane = round_f32_ftz(lane + bf16_value(src1[e]) * bf16_value(src2[e]))
        out[i] = float(lane)
    return out


def emulated(acc, src1, src2):
    out = np.array(acc, np.float32)
    _testing.emulated_vdpbf16ps(out, np.asarray(src1, np.uint16), np.asarray(src2, np.uint16))
    return out


def bf16(x):
    """bf16 bits of x, which must be exact in bf16."""
    bits = np.array([x], np.float32).view(np.uint32)[0]
    assert bits & 0xFFFF == 0, x
    return int(bits >> 16)


def one_lane(acc, even, odd):
    """Lane 0 of acc + odd product + even product, each product (a, b) given as bf16-exact floats."""
    src1, src2 = np.zeros(32, np.uint16), np.zeros(32, np.uint16)
    (src1[0], src2[0]), (src1[1], src2[1]) = [(bf16(a), bf16(b)) for a, b in (even, odd)]
    accv = np.zeros(16, np.float32)
    accv[0] = acc
    out = emulated(accv, src1, src2)
    np.testing.assert_array_equal(out, sdm_vdpbf16ps(accv, src1, src2))
    return out[0]


def test_random_vectors_are_bit_exact_with_the_sdm_loop():
    rng = np.random.default_rng(3)
    for _ in range(200):
        acc = (rng.standard_normal(16) * 2.0 ** rng.integers(-30, 30)).astype(np.float32)
        src1, src2 = random_bf16(rng, 32), random_bf16(rng, 32)
        np.testing.assert_array_equal(emulated(acc, src1, src2).view(np.uint32),
                                      sdm_vdpbf16ps(acc, src1, src2).view(np.uint32))


def test_the_odd_product_is_accumulated_first():
    # 1 - 2^24 is exact, + 2^24 gives 1; the other way round 1 + 2^24 rounds to 2^24 and gives 0
    assert one_lane(1.0, even=(2.0**24, 1.0), odd=(-(2.0**24), 1.0)) == 1.0
    assert one_lane(1.0, even=(-(2.0**24), 1.0), odd=(2.0**24, 1.0)) == 0.0


def test_each_accumulation_is_one_fma_rounding():
    # (1 + 2^-7)(1 - 2^-7) - 1 = -2^-14 exactly: no rounding of the product before the add
    assert one_lane(-1.0, even=(1.0 + 2.0**-7, 1.0 - 2.0**-7), odd=(0.0, 0.0)) == np.float32(-(2.0**-14))


def test_denormal_inputs_read_as_zero():
    src1, src2 = np.zeros(32, np.uint16), np.zeros(32, np.uint16)
    src1[0:2], src2[0:2] = [0x0001, ONE], [0x7180, 0x807F]  # denormal * 2^100, 1 * -denormal
    acc = np.full(16, 0.5, np.float32)
    assert emulated(acc, src1, src2)[0] == 0.5
    # an FP32 denormal accumulator too: 2^-127 + 2^-126 would be the normal 1.5 * 2^-126
    assert one_lane(2.0**-127, even=(2.0**-126, 1.0), odd=(0.0, 0.0)) == np.float32(2.0**-126)


def test_tiny_results_flush_to_zero_between_and_after_the_two_steps():
    # odd step: 1.5 * 2^-126 - 2^-126 = 2^-127 is tiny and flushed, so + 2^-126 gives 2^-126
    assert one_lane(1.5 * 2.0**-126, even=(2.0**-126, 1.0), odd=(-(2.0**-126), 1.0)) == np.float32(2.0**-126)
    assert one_lane(0.0, even=(2.0**-70, 2.0**-70), odd=(0.0, 0.0)) == 0.0
    # 2^-126 - 1.004 * 2^-151: 2^-126 at denormal precision, 2^-126 - 2^-150 (tiny) with 24 bits
    lane = one_lane(0.0, even=(1.0078125 * 2.0**-76, -1.9921875 * 2.0**-76), odd=(2.0**-63, 2.0**-63))
    assert lane == 0.0


def test_overflow_and_nan():
    src1, src2 = np.full(32, 0x7F00, np.uint16), np.full(32, 0x7F00, np.uint16)  # 2^127 squared
    assert np.isposinf(emulated(np.zeros(16, np.float32), src1, src2)).all()
    # a NaN in element 5 (lane 2's odd one) spoils lane 2 only
    out = emulated(np.ones(16, np.float32), np.where(np.arange(32) == 5, 0x7FC0, ONE), np.full(32, ONE))
    assert np.isnan(out[2]) and np.isfinite(np.delete(out, 2)).all()


def test_wrong_lengths_are_refused():
    with pytest.raises(ValueError, match="16 FP32 accumulators"):
        _testing.emulated_vdpbf16ps(np.zeros(8, np.float32), np.zeros(32, np.uint16), np.zeros(32, np.uint16))
