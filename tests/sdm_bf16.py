"""Exact-rational oracle of the BF16 dot-product arithmetic the Intel SDM defines for VDPBF16PS and
TDPBF16PS: BF16 operands and FP32 accumulators read with denormals as zero (DAZ), each accumulation
rounded once to FP32 (nearest-even), and a result below 2^-126 after that rounding (x86 tininess
after rounding) flushed to zero (FTZ).  Zeros carry no sign here: compare values, not bits, where
a result may be zero."""
import math
from fractions import Fraction

import numpy as np

TWO_M126 = Fraction(1, 2**126)


def bf16_value(bits):
    """make_fp32 with DAZ: exact value of a bf16 bit pattern, denormals as zero."""
    bits = int(bits)
    if bits & 0x7F80 == 0:
        return Fraction(0)
    return Fraction(float(np.array([bits << 16], np.uint32).view(np.float32)[0]))


def f32_value(x):
    """An FP32 accumulator (a tile's, a zmm lane's), DAZ."""
    x = float(x)
    return Fraction(0) if abs(x) < 2.0**-126 else Fraction(x)


def round_f32_ftz(x):
    """x rounded to FP32: 24-bit significand, nearest-even, unbounded exponent; then flushed to
    zero when below 2^-126 and overflowing to infinity at 2^128."""
    if x == 0:
        return Fraction(0)
    mag = abs(x)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    if Fraction(2) ** e > mag:
        e -= 1
    unit = Fraction(2) ** (e - 23)
    r = round(mag / unit) * unit  # Fraction.__round__ rounds half to even
    if r < TWO_M126:
        return Fraction(0)
    if r >= Fraction(2) ** 128:
        return math.copysign(math.inf, x)
    return r if x > 0 else -r


def random_bf16(rng, shape, exp_lo=-20, exp_hi=20):
    """bf16 bit patterns of normal numbers with exponents in [exp_lo, exp_hi] and random signs."""
    exp = rng.integers(exp_lo, exp_hi + 1, shape) + 127
    mant = rng.integers(0, 128, shape)
    sign = rng.integers(0, 2, shape)
    return ((sign << 15) | (exp << 7) | mant).astype(np.uint16)
