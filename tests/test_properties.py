"""Property tests (hypothesis): random shapes, routings and bit patterns, every usable backend.

MoE: every fast backend against the float64 oracle rounded where the kernel rounds (kernel_tester:
x and h in the kernel's activation dtype, y in the input's), over random odd sizes, T, top-k, ids
with repeats and negatives, all three weight formats (even block edges), float32 / bfloat16
activations, accumulate.
Codec: random bit patterns (every float class) through encode / quantize / dequantize on every
variant, against ml_dtypes.  Budgets: fuzz_settings (KTFP8_FUZZ_LONG=1 for a long run)."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ktfp8 import backends, fp8
from ktfp8.moe import MoE
from fuzz_settings import LONG, budget
from kernel_tester import assert_matches, expected, kernel, moe_config
from moe_oracle import make_experts, moe_fp64, nmse
from moe_oracle import oracle_dequantize, oracle_encode, oracle_quantize, same_bits, same_values

VARIANTS = backends.usable_variants()
FAST = [b for b in VARIANTS if b != "reference"]
FORMATS = ["fp8_per_channel", "fp8_block", "bf16"]
BF16 = ml_dtypes.bfloat16


def _max_size(backend):
    # software-emulated AVX-512 / AMX is ~100x slower than native: keep its matrices small
    return 64 if backend.endswith("_emulated") else (300 if LONG else 200)


@st.composite
def moe_cases(draw, backend):
    size = _max_size(backend)
    fmt = draw(st.sampled_from(FORMATS))
    E = draw(st.integers(1, 8))
    H = draw(st.integers(1, size))
    I = draw(st.integers(1, size))
    k = draw(st.integers(1, E))
    T = draw(st.integers(0, 40))     # up to 40: experts get >= 16 rows, the AMX / prefill paths
    block = 2 * draw(st.integers(1, 48))                    # even block edges, 2 .. 96
    # ids in [-2, E): repeats inside a row are allowed, negatives mean "skip this slot"
    ids = draw(hnp.arrays(np.int64, (T, k), elements=st.integers(-2, E - 1)))
    ids = ids.astype(draw(st.sampled_from([np.int32, np.int64])))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    x_dtype = draw(st.sampled_from([np.float32, BF16]))
    accumulate = draw(st.booleans())
    return fmt, E, H, I, k, T, block, ids, seed, x_dtype, accumulate


NATIVE_FAST = [b for b in FAST if not b.endswith("_emulated")]
EMULATED = [b for b in FAST if b.endswith("_emulated")]


def _check_against_oracle(backend, case):
    fmt, E, H, I, k, T, block, ids, seed, x_dtype, accumulate = case
    rows = np.bincount(ids[ids >= 0].astype(np.int64), minlength=E).max() if T else 0
    event("an expert gets >= 16 rows (tile / prefill paths)" if rows >= 16 else "every expert < 16 rows")
    experts, dense = make_experts(fmt, E, H, I, seed=seed % 1000, block=block)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32).astype(x_dtype)
    w = rng.standard_normal((T, k)).astype(np.float32)
    fast = MoE(moe_config(fmt, E, H, I, k, block), experts, backend=backend, threads=int(rng.integers(1, 4)))
    base = rng.standard_normal((T, H)).astype(np.float32).astype(x_dtype) if accumulate else None
    got = fast(x, ids, w, out=base.copy(), accumulate=True) if accumulate else fast(x, ids, w)
    assert got.dtype == x.dtype and got.shape == (T, H)
    assert np.isfinite(got.astype(np.float32)).all()
    want = expected(dense, x, ids, w, kernel(backend).act, base=base)
    if x.dtype == BF16:
        exact = moe_fp64(x, ids, w, *dense, act=kernel(backend).act) + (0 if base is None else base.astype(np.float64))
        want = _either_side_of_bf16_ties(got, want, exact)
    # 1e-6, not kernel_tester's 1e-9 for FP32: with one or two outputs and topk_weights of both signs
    # y can be a near-cancellation, whose FP32 relative error is large however exact each term is
    assert_matches(got, want, 1e-6, backend)


def _either_side_of_bf16_ties(got, want, exact):
    """want, except where the float64 result lies on a BF16 rounding tie (to within FP32's error)
    and got is one of the two BF16 neighbours: an FP32 kernel's sum lands on either side of such a
    tie, and with few outputs one BF16 ulp (2^-8 relative) alone exceeds the NMSE budget.  (Seen:
    H = 1, 12 tokens, y = 1.10546875 exactly, midway between 1.1015625 and 1.109375.)"""
    got = np.asarray(got, np.float64)
    bits = np.asarray(exact, np.float32).view(np.uint32)
    down = (bits & 0xFFFF0000).view(np.float32).astype(np.float64)       # BF16 truncation: toward 0
    up = ((bits & 0xFFFF0000) + 0x10000).view(np.float32).astype(np.float64)  # next BF16 away from 0
    tie = np.abs(exact - (down + up) / 2) <= 2.0 ** -20 * np.abs(exact)
    return np.where(tie & ((got == down) | (got == up)), got, want)


@pytest.mark.parametrize("backend", NATIVE_FAST)
@budget(40)
@given(data=st.data())
def test_fast_backend_matches_oracle(backend, data):
    _check_against_oracle(backend, data.draw(moe_cases(backend)))


@pytest.mark.skipif(not EMULATED, reason="this build has no emulated variants")
@pytest.mark.parametrize("backend", EMULATED or ["none"])
@budget(20)
@given(data=st.data())
def test_emulated_backend_matches_oracle(backend, data):
    _check_against_oracle(backend, data.draw(moe_cases(backend)))


@budget(25)
@given(E=st.integers(1, 6), H=st.integers(1, 70), I=st.integers(1, 70), T=st.integers(1, 6), data=st.data())
def test_reference_is_the_sum_over_slots(E, H, I, T, data):
    """The reference kernel itself: for random routings, y equals the sum of single-slot calls
    (repeats and skipped slots included), i.e. grouping by expert neither drops nor doubles a pair."""
    k = data.draw(st.integers(1, E))
    ids = data.draw(hnp.arrays(np.int64, (T, k), elements=st.integers(-1, E - 1)))
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=E * H + I)
    moe = MoE(moe_config("fp8_per_channel", E, H, I, k), experts, backend="reference", threads=1)
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, k)).astype(np.float32)
    total = np.zeros((T, H), np.float64)
    for s in range(k):
        one_w = np.zeros_like(w)
        one_w[:, s] = w[:, s]
        total += moe(x, ids, one_w)
    assert nmse(moe(x, ids, w), total) <= 1e-10


# ------------------------------------------------------------------------------------ codec

def _f32_bits(n):
    return hnp.arrays(np.uint32, n, elements=st.integers(0, 2 ** 32 - 1)).map(lambda a: a.view(np.float32))


@pytest.mark.parametrize("variant", VARIANTS)
@budget(60)
@given(n=st.integers(1, 300), offset=st.integers(0, 7), threads=st.integers(1, 3), data=st.data())
def test_encode_random_bit_patterns(variant, n, offset, threads, data):
    x = data.draw(_f32_bits(n + offset))[offset:]          # misaligned start, any length: the tails
    same_bits(fp8.encode(x, backend=variant, threads=threads), oracle_encode(x))
    h = data.draw(hnp.arrays(np.uint16, n, elements=st.integers(0, 2 ** 16 - 1)))
    for dt in (BF16, np.float16):
        same_bits(fp8.encode(h.view(dt), backend=variant, threads=threads), oracle_encode(h.view(dt)))


@pytest.mark.parametrize("variant", VARIANTS)
@budget(40)
@given(lead=st.sampled_from([(), (1,), (3,)]), rows=st.integers(1, 40), cols=st.integers(1, 150),
       per_channel=st.booleans(), bn=st.integers(1, 40), bk=st.integers(1, 150), threads=st.integers(1, 3),
       any_bits=st.booleans(), data=st.data())
def test_quantize_random_bit_patterns(variant, lead, rows, cols, per_channel, bn, bk, threads, any_bits, data):
    shape = lead + (rows, cols)
    # any bit pattern (NaN, Inf, subnormals mixed in a row), or finite values of one range
    if any_bits:
        w = data.draw(_f32_bits(int(np.prod(shape)))).reshape(shape)
    else:
        w = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-1e4, 1e4, width=32)))
    codes, scale = fp8.quantize(w, per_channel=per_channel, block=(bn, bk), backend=variant, threads=threads)
    want_codes, want_scale = oracle_quantize(w, per_channel, (bn, bk))
    same_bits(scale, want_scale)
    same_bits(codes, want_codes)
    back = fp8.dequantize(codes, scale, block=(bn, bk), backend=variant, threads=threads)
    same_values(back, oracle_dequantize(codes, scale, (bn, bk)))


@pytest.mark.parametrize("variant", VARIANTS)
@budget(30)
@given(codes=hnp.arrays(np.uint8, hnp.array_shapes(max_dims=3, max_side=40)),
       dtype=st.sampled_from([np.float32, BF16]))
def test_decode_random_codes(variant, codes, dtype):
    assume(codes.size > 0)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).astype(dtype)
    same_values(fp8.decode(codes, dtype, backend=variant), want)
