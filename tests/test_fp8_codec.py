"""ktfp8.fp8 against an independent oracle (ml_dtypes + NumPy), for every codec variant this CPU runs.

Each usable variant (the *_emulated ones included) is forced in turn with backend=...; the oracle
(moe_oracle.oracle_*) never calls ktfp8."""
import ml_dtypes
import numpy as np
import pytest

from ktfp8 import backends, fp8
from moe_oracle import TINY, oracle_dequantize, oracle_encode, oracle_quantize, same_bits, same_values

F8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
VARIANTS = backends.usable_variants()


# ------------------------------------------------------------------------------------ inputs

def special_f32():
    """Boundaries: zeros, infinities, NaNs of both signs and payloads, the saturation region
    around 448 / 464 / 480, the normal/subnormal edge 2^-6, the subnormal ties, float32 extremes."""
    f = np.float32
    base = [0.0, 448.0, 464.0, 480.0, 496.0, 512.0, 1e30, 3.4028235e38, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10,
            3 * 2.0 ** -10, 5 * 2.0 ** -10, 15 * 2.0 ** -10, 17 * 2.0 ** -10, 2.0 ** -7, 1.0, 1.0625, 1.1875,
            float(TINY), 1e-40, 1.1754944e-38]
    vals = np.array(base, f)
    with np.errstate(over="ignore"):
        vals = np.concatenate([vals, np.nextafter(vals, f(np.inf)), np.nextafter(vals, f(0))])
    vals = np.concatenate([vals, -vals, np.array([np.inf, -np.inf], f)])
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32).view(f)
    return np.concatenate([vals, nans])


def e4m3_ties():
    """Every midpoint between neighbouring E4M3 values (exact in float32) and its two float32
    neighbours, both signs, the saturation region included."""
    grid = np.arange(0, 127, dtype=np.uint8).view(F8).astype(np.float32)  # 0 .. 448, ascending
    grid = np.append(grid, np.float32(480))                               # 480: where 448 would round up
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    t = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))])
    return np.concatenate([t, -t])


def random_f32(n, rng):
    """n float32 values: a quarter random bit patterns (every class: NaN, Inf, subnormal), a
    quarter float32 subnormals, a quarter log-uniform over the E4M3 range and beyond, a quarter
    uniform over the E4M3 subnormal range; then the ties and the boundaries, repeated."""
    q = n // 4
    bits = rng.integers(0, 2 ** 32, q, dtype=np.uint64).astype(np.uint32).view(np.float32)
    sub32 = (rng.integers(0, 2 ** 23, q, dtype=np.uint32) | (rng.integers(0, 2, q, dtype=np.uint32) << 31)).view(np.float32)
    logu = (2.0 ** rng.uniform(-14, 11, q) * rng.choice([-1, 1], q)).astype(np.float32)
    sub8 = rng.uniform(-2.0 ** -6, 2.0 ** -6, q).astype(np.float32)
    fixed = np.concatenate([e4m3_ties(), special_f32()])
    fixed = np.tile(fixed, -(-(n - 4 * q) // fixed.size) + 1)
    return np.concatenate([bits, sub32, logu, sub8, fixed])


@pytest.fixture(params=VARIANTS)
def variant(request):
    return request.param


# ------------------------------------------------------------------------------------ encode / decode

def test_encode_every_bfloat16(variant):
    x = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(BF16)
    same_bits(fp8.encode(x, backend=variant), oracle_encode(x))


def test_encode_every_float16(variant):
    x = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    same_bits(fp8.encode(x, backend=variant), oracle_encode(x))


def test_encode_random_float32(variant):
    x = random_f32(1_000_000, np.random.default_rng(0))
    assert x.size >= 1_000_000
    codes = fp8.encode(x, backend=variant)
    same_bits(codes, oracle_encode(x))
    # NaN keeps its sign; +-Inf saturate to +-448
    assert set(codes[np.isnan(x)]) == {0x7F, 0xFF}
    assert set(codes[np.isinf(x)]) == {0x7E, 0xFE}


def test_encode_lengths_offsets_and_shapes(variant):
    """Every tail length around the vector widths (32, 64) and unaligned starts; any shape."""
    x = random_f32(4096, np.random.default_rng(1))
    for dtype in (np.float32, BF16, np.float16):
        with np.errstate(over="ignore", invalid="ignore"):
            xd = x.astype(dtype)
        for offset in (0, 1, 3):
            for n in list(range(0, 140)) + [1000, 1023]:
                part = xd[offset:offset + n]
                same_bits(fp8.encode(part, backend=variant), oracle_encode(part))
    cube = x[:4 * 5 * 7].reshape(4, 5, 7)
    same_bits(fp8.encode(cube, backend=variant), oracle_encode(cube))
    scalar = np.array(np.float32(3.3))
    assert fp8.encode(scalar, backend=variant).shape == () and fp8.encode(scalar)[()] == oracle_encode(scalar)[()]


def test_decode_every_code(variant):
    codes = np.arange(256, dtype=np.uint8)
    as_f8 = codes.view(F8)
    same_bits(fp8.decode(codes, backend=variant), as_f8.astype(np.float32))
    same_bits(fp8.decode(as_f8, BF16, backend=variant), as_f8.astype(BF16))
    # long unaligned runs through every vector path and tail
    many = np.tile(codes, 9)[5:5 + 2000]
    same_bits(fp8.decode(many, backend=variant), many.view(F8).astype(np.float32))
    same_bits(fp8.decode(many, BF16, backend=variant), many.view(F8).astype(BF16))
    for n in range(0, 100):
        same_bits(fp8.decode(many[3:3 + n], backend=variant), many[3:3 + n].view(F8).astype(np.float32))


def test_empty_encode_decode(variant):
    assert fp8.encode(np.empty((0, 3), np.float32), backend=variant).shape == (0, 3)
    out = fp8.decode(np.empty((2, 0), np.uint8), BF16, backend=variant)
    assert out.shape == (2, 0) and out.dtype == BF16


# ------------------------------------------------------------------------------------ quantize

def hard_matrix(rng, shape, dtype):
    """A random weight matrix whose first rows are the hard cases: all zero, a NaN, +-Inf, only
    Inf, tiny (subnormal in dtype), huge (near the top of dtype's range)."""
    tiny, huge = (1e-6, 100.0) if dtype == np.float16 else (1e-41, 1e30)
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape[:-1] + (1,)))).astype(np.float32)
    cols = shape[-1]
    flat = w.reshape(-1, cols)
    flat[0] = 0
    flat[1, cols // 2] = np.nan
    flat[2, 0], flat[2, -1] = np.inf, -np.inf
    flat[3] = np.inf
    flat[4] *= tiny
    flat[5] *= huge
    return w.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("shape", [(37, 211), (3, 9, 70)])
def test_quantize_per_channel(variant, dtype, shape):
    w = hard_matrix(np.random.default_rng(2), shape, dtype)
    codes, scale = fp8.quantize(w, backend=variant)
    want_codes, want_scale = oracle_quantize(w, True, None)
    assert codes.dtype == np.uint8 and scale.dtype == np.float32
    assert scale.shape == shape[:-1] + (1,)
    same_bits(scale, want_scale)
    same_bits(codes, want_codes)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("shape,block", [((45, 70), (16, 32)), ((45, 70), (128, 128)), ((2, 33, 130), (7, 13)),
                                         ((6, 5), (1, 1)), ((130, 260), (128, 128))])
def test_quantize_blockwise(variant, dtype, shape, block):
    w = hard_matrix(np.random.default_rng(3), shape, dtype)
    codes, scale = fp8.quantize(w, per_channel=False, block=block, backend=variant)
    want_codes, want_scale = oracle_quantize(w, False, block)
    assert scale.shape == shape[:-2] + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    same_bits(scale, want_scale)
    same_bits(codes, want_codes)


def test_scale_underflow_keeps_zeros_zero(variant):
    w = np.array([[1e-44, 0.0, -1e-44, 5e-45]], np.float32)
    codes, scale = fp8.quantize(w, backend=variant)
    assert scale[0, 0] == TINY
    same_bits(codes, oracle_quantize(w, True, None)[0])
    assert codes[0, 1] == 0 and not np.isnan(codes.view(F8).astype(np.float32)).any()


# ------------------------------------------------------------------------------------ dequantize

@pytest.mark.parametrize("per_channel,block", [(True, (128, 128)), (False, (16, 32)), (False, (5, 7))])
def test_dequantize_matches_oracle(variant, per_channel, block):
    w = hard_matrix(np.random.default_rng(4), (3, 40, 75), np.float32)
    codes, scale = fp8.quantize(w, per_channel=per_channel, block=block, backend=variant)
    want = oracle_dequantize(codes, scale, block)
    same_values(fp8.dequantize(codes, scale, block=block, backend=variant), want)
    same_values(fp8.dequantize(codes.view(F8), scale, BF16, block=block, backend=variant), want.astype(BF16))


def test_dequantize_special_scales(variant):
    """Every code times scales that make products overflow, underflow into subnormals, or NaN."""
    codes = np.tile(np.arange(256, dtype=np.uint8), (6, 1))
    scale = np.array([[1e38], [1e-40], [-3.0], [np.inf], [np.nan], [0.0]], np.float32)
    want = oracle_dequantize(codes, scale, None)
    same_values(fp8.dequantize(codes, scale, backend=variant), want)
    same_values(fp8.dequantize(codes, scale, BF16, backend=variant), want.astype(BF16))


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("per_channel,block", [(True, (128, 128)), (False, (32, 48))])
def test_round_trip_error_bound(variant, dtype, per_channel, block):
    """|w - dequantize(quantize(w))| <= 2^-4 |w| + 2^-10 scale, plus float32 rounding slack: half an
    E4M3 ulp (3 mantissa bits: 2^-4 relative in the normal range, 2^-10 absolute below 2^-6 once
    divided by the scale), and two float32 roundings (w / scale, code * scale)."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((2, 64, 200)) * np.exp(rng.uniform(-6, 6, (2, 64, 1)))).astype(dtype)
    codes, scale = fp8.quantize(w, per_channel=per_channel, block=block, backend=variant)
    deq = fp8.dequantize(codes, scale, block=block, backend=variant).astype(np.float64)
    w64 = w.astype(np.float64)
    full = oracle_dequantize(np.full_like(codes, 0x38), scale, block).astype(np.float64)  # code 0x38 = 1.0
    bound = (2.0 ** -4 * np.abs(w64) + 2.0 ** -10 * full) * (1 + 2.0 ** -18)
    assert np.all(np.abs(w64 - deq) <= bound)
    assert np.abs(w64 - deq).max() > 0  # quantization did happen


# ------------------------------------------------------------------------------------ threads, env

def test_threads_do_not_change_results(variant):
    rng = np.random.default_rng(6)
    w = rng.standard_normal((2, 300, 1000)).astype(np.float32)
    x = rng.standard_normal(300_000).astype(np.float32)
    for per_channel in (True, False):
        one = fp8.quantize(w, per_channel, backend=variant, threads=1)
        two = fp8.quantize(w, per_channel, backend=variant, threads=2)
        same_bits(one[0], two[0])
        same_bits(one[1], two[1])
        same_bits(fp8.dequantize(*one, backend=variant, threads=1), fp8.dequantize(*one, backend=variant, threads=2))
    same_bits(fp8.encode(x, backend=variant, threads=1), fp8.encode(x, backend=variant, threads=2))
    codes = fp8.encode(x)
    same_bits(fp8.decode(codes, backend=variant, threads=1), fp8.decode(codes, backend=variant, threads=2))


def test_environment_forces_backend(monkeypatch, variant):
    x = random_f32(1000, np.random.default_rng(7))
    monkeypatch.setenv("KTFP8_BACKEND", variant)
    same_bits(fp8.encode(x), oracle_encode(x))
    monkeypatch.setenv("KTFP8_BACKEND", "no_such_backend")
    with pytest.raises(ValueError, match="KTFP8_BACKEND"):
        fp8.encode(x)


def test_non_contiguous_inputs_are_copied():
    w = hard_matrix(np.random.default_rng(8), (40, 90), np.float32)
    for view in (w[:, ::2], w.T, np.asfortranarray(w)):
        codes, scale = fp8.quantize(view)
        want_codes, want_scale = fp8.quantize(np.ascontiguousarray(view))
        same_bits(codes, want_codes)
        same_bits(scale, want_scale)
        same_bits(fp8.encode(view), oracle_encode(view))
    codes, scale = fp8.quantize(w)
    same_bits(fp8.dequantize(codes.T.copy().T, scale[::1]), fp8.dequantize(codes, scale))


def test_read_only_inputs_and_narrow_scales():
    """Memory-mapped checkpoints arrive read-only; bfloat16 / float16 scales are exact in float32."""
    w = hard_matrix(np.random.default_rng(9), (16, 40), np.float32)
    codes, scale = fp8.quantize(w)
    for a in (w, codes, scale):
        a.setflags(write=False)
    same_bits(fp8.quantize(w)[0], codes)
    same_bits(fp8.encode(w), oracle_encode(w))
    same_values(fp8.dequantize(codes, scale), oracle_dequantize(codes, scale, None))
    narrow = scale.astype(BF16)
    same_values(fp8.dequantize(codes, narrow), oracle_dequantize(codes, narrow.astype(np.float32), None))


# ------------------------------------------------------------------------------------ bad input

W = np.ones((4, 8), np.float32)
CODES = np.zeros((4, 8), np.uint8)
SCALE = np.ones((4, 1), np.float32)


@pytest.mark.parametrize("call,exc,name", [
    (lambda: fp8.encode([1.0, 2.0]), TypeError, "x"),
    (lambda: fp8.encode(np.ones(3, np.int32)), TypeError, "x"),
    (lambda: fp8.encode(np.ones(3, np.float64)), TypeError, "x"),
    (lambda: fp8.decode(np.ones(3, np.float32)), TypeError, "codes"),
    (lambda: fp8.decode(CODES, np.float16), ValueError, "dtype"),
    (lambda: fp8.decode(CODES, "not a dtype"), TypeError, "dtype"),
    (lambda: fp8.quantize(np.ones(8, np.float32)), ValueError, "w"),
    (lambda: fp8.quantize(np.ones((2, 2, 2, 2), np.float32)), ValueError, "w"),
    (lambda: fp8.quantize(np.ones((0, 8), np.float32)), ValueError, "w"),
    (lambda: fp8.quantize(np.ones((3, 4, 0), np.float32)), ValueError, "w"),
    (lambda: fp8.quantize(np.ones((4, 8), np.int8)), TypeError, "w"),
    (lambda: fp8.quantize(W, per_channel="yes"), TypeError, "per_channel"),
    (lambda: fp8.quantize(W, per_channel=False, block=0), ValueError, "block"),
    (lambda: fp8.quantize(W, per_channel=False, block=(128, -1)), ValueError, "block"),
    (lambda: fp8.quantize(W, per_channel=False, block=(0, 0)), ValueError, "block"),
    (lambda: fp8.quantize(W, per_channel=False, block="128"), TypeError, "block"),
    (lambda: fp8.quantize(W, per_channel=False, block=(1, 2, 3)), TypeError, "block"),
    (lambda: fp8.quantize(W, per_channel=False, block=(2.0, 2)), TypeError, "block"),
    (lambda: fp8.quantize(W, backend="no_such_backend"), ValueError, "backend"),
    (lambda: fp8.quantize(W, threads=0), ValueError, "threads"),
    (lambda: fp8.dequantize(np.zeros(8, np.uint8), SCALE), ValueError, "codes"),
    (lambda: fp8.dequantize(np.zeros((0, 8), np.uint8), np.ones((0, 1), np.float32)), ValueError, "codes"),
    (lambda: fp8.dequantize(W, SCALE), TypeError, "codes"),
    (lambda: fp8.dequantize(CODES, np.ones((4, 2), np.float32)), ValueError, "scale"),
    (lambda: fp8.dequantize(CODES, np.ones((1, 4, 1), np.float32)), ValueError, "scale"),
    (lambda: fp8.dequantize(CODES, np.ones(4, np.float32)), ValueError, "scale"),
    (lambda: fp8.dequantize(CODES, np.ones((4, 1), np.float64)), TypeError, "scale"),
    (lambda: fp8.dequantize(CODES, [[1.0]] * 4), TypeError, "scale"),
    (lambda: fp8.dequantize(CODES, SCALE, np.float16), ValueError, "out_dtype"),
    (lambda: fp8.dequantize(CODES, np.ones((1, 1), np.float32), block=0), ValueError, "block"),
])
def test_bad_input_names_the_argument(call, exc, name):
    with pytest.raises(exc, match=rf"\b{name}\b"):
        call()


def test_blockwise_scale_shape_is_checked_against_block():
    codes, scale = fp8.quantize(np.ones((40, 70), np.float32), per_channel=False, block=(16, 32))
    assert scale.shape == (3, 3)
    fp8.dequantize(codes, scale, block=(16, 32))
    with pytest.raises(ValueError, match="scale"):
        fp8.dequantize(codes, scale)  # default block (128, 128) expects (1, 1)
