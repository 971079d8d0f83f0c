"""The independent oracle of the tests, shared by every test module: FP8 E4M3 encoding, scales and
block quantization by their definitions with ml_dtypes and NumPy; the MoE layer in float64."""
import ml_dtypes
import numpy as np

from ktfp8.experts import ExpertWeights

E4M3 = ml_dtypes.float8_e4m3fn
TINY = np.finfo(np.float32).smallest_subnormal


def oracle_encode(x):
    """ml_dtypes' E4M3 of clip(x, -448, 448), as uint8 codes (x converted exactly to float32)."""
    with np.errstate(invalid="ignore"):  # NaN -> E4M3 NaN is wanted
        return np.clip(x.astype(np.float32), -448, 448).astype(E4M3).view(np.uint8)


def oracle_scale(amax):
    """amax / 448 in float32; 1 where amax is 0; the smallest subnormal where the quotient underflows."""
    amax = amax.astype(np.float32)
    scale = amax / np.float32(448)
    scale = np.where((amax > 0) & (scale == 0), TINY, scale)
    return np.where(amax > 0, scale, np.float32(1)).astype(np.float32)


def finite_abs(w):
    w = w.astype(np.float32)
    return np.where(np.isfinite(w), np.abs(w), np.float32(0))


def oracle_quantize(w, per_channel, block):
    """Codes and scales by the definition: blocks cut at the edges, codes = E4M3(clip(w32 / scale))."""
    w32 = w.astype(np.float32)
    *lead, rows, cols = w.shape
    bn, bk = (1, cols) if per_channel else block
    nrb, ncb = -(-rows // bn), -(-cols // bk)
    scale = np.empty((*lead, nrb, ncb), np.float32)
    full_scale = np.empty(w.shape, np.float32)
    for i in range(nrb):
        for j in range(ncb):
            rs, cs = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            s = oracle_scale(finite_abs(w32[..., rs, cs]).max(axis=(-2, -1)))
            scale[..., i, j] = s
            full_scale[..., rs, cs] = s[..., None, None]
    with np.errstate(all="ignore"):
        codes = oracle_encode(w32 / full_scale)
    return codes, scale


def oracle_dequantize(codes, scale, block):
    """decode(codes) * scale of its block, in float32."""
    values = codes.view(E4M3).astype(np.float32)
    *_, rows, cols = codes.shape
    bn, bk = (1, cols) if scale.shape[-2:] == (rows, 1) else block
    full = np.repeat(np.repeat(scale, bn, axis=-2), bk, axis=-1)[..., :rows, :cols]
    with np.errstate(all="ignore"):
        return values * full


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    bad = np.flatnonzero(a.view(width).ravel() != b.view(width).ravel())
    assert bad.size == 0, f"{bad.size} mismatches, first at {bad[:5]}: {a.ravel()[bad[:5]]} vs {b.ravel()[bad[:5]]}"


def same_values(a, b):
    """Equal as numbers, NaN == NaN (NaN payloads of products are the FPU's business)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    nan = np.isnan(a32)
    assert np.array_equal(nan, np.isnan(b32))
    same_bits(np.where(nan, 0, a32).astype(np.float32), np.where(nan, 0, b32).astype(np.float32))


def quantize_per_channel(w):
    """[E, out, in] float32 -> (codes uint8, scale float32 [E, out, 1])."""
    return oracle_quantize(w, True, None)


def quantize_block(w, block):
    """[E, out, in] -> (codes, scale [E, ceil(out/bn), ceil(in/bk)]); block = edge or (bn, bk)."""
    return oracle_quantize(w, False, (block, block) if np.isscalar(block) else tuple(block))


def dequantize(codes, scale, block=None):
    """float64 weights from codes and per-channel ([E, out] or [E, out, 1]) or block scales."""
    v = codes.view(E4M3).astype(np.float64)
    scale = scale.astype(np.float64)
    if block is None:
        return v * scale.reshape(v.shape[0], v.shape[1], 1)
    bn, bk = (block, block) if np.isscalar(block) else block
    full = np.repeat(np.repeat(scale, bn, axis=1), bk, axis=2)
    return v * full[:, :v.shape[1], :v.shape[2]]


def make_experts(fmt, E, H, I, seed=0, block=64, outliers=False):
    """(ExpertWeights, float64 (gate, up, down) they stand for).  block: fp8_block's edge or
    (block_n, block_k).  outliers: a few rows and columns scaled up 20-30x, so that per-channel and
    block scales differ a lot between rows and blocks."""
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal((E, I, H)) / np.sqrt(H)).astype(np.float32)
    up = (rng.standard_normal((E, I, H)) / np.sqrt(H)).astype(np.float32)
    down = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    if outliers:
        gate[:, ::7, min(3, H - 1)] *= 20
        down[:, min(5, H - 1), ::5] *= 30
    if fmt == "bf16":
        ws = [a.astype(ml_dtypes.bfloat16) for a in (gate, up, down)]
        return ExpertWeights("bf16", *ws), [a.astype(np.float64) for a in ws]
    if fmt == "fp8_per_channel":
        q = [quantize_per_channel(a) for a in (gate, up, down)]
        ew = ExpertWeights(fmt, q[0][0], q[1][0], q[2][0], q[0][1], q[1][1], q[2][1])
        return ew, [dequantize(c, s) for c, s in q]
    block = (block, block) if np.isscalar(block) else tuple(block)
    q = [quantize_block(a, block) for a in (gate, up, down)]
    ew = ExpertWeights(fmt, q[0][0], q[1][0], q[2][0], q[0][1], q[1][1], q[2][1], block=block)
    return ew, [dequantize(c, s, block) for c, s in q]


def round_to(a, dtype):
    """a rounded to dtype (float32 or bfloat16; None: unchanged), returned as float64.  float64
    values go through float32 first, as a kernel that computes in FP32 and then rounds."""
    if dtype is None:
        return np.asarray(a, np.float64)
    return np.asarray(a).astype(np.float32).astype(dtype).astype(np.float64)


def gate_activation(g, hidden_act):
    """MoeConfig.hidden_act of float64 g, from its definition: silu, or the tanh GELU
    0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))."""
    with np.errstate(over="ignore", invalid="ignore"):  # exp(-g) of a very negative g; NaN codes
        if hidden_act == "silu":
            return g / (1 + np.exp(-g))
        assert hidden_act == "gelu_pytorch_tanh", hidden_act
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))


def moe_fp64(x, topk_ids, topk_weights, gate, up, down, act=None, swiglu_limit=None, hidden_act="silu"):
    """y[t] = sum_s w[t,s] * down_e @ (silu(gate_e @ x_t) * (up_e @ x_t)), float64, ids < 0 skipped;
    with swiglu_limit L, silu(min(g, L)) * clip(u, -L, L) (DeepSeek-V4's experts, as transformers writes
    them: gate.clamp(max=L), up.clamp(-L, L)); hidden_act "gelu_pytorch_tanh": the tanh GELU for silu.

    act (None, np.float32 or ml_dtypes.bfloat16): the activation dtype of a kernel -- x and h are
    rounded to it where the kernel rounds them (moe_driver.c), so that only summation order
    separates the kernel from this.  einsum without BLAS, so it also runs under an emulated CPU."""
    x = round_to(x, act)
    y = np.zeros(x.shape, np.float64)
    ids = np.asarray(topk_ids)
    for e in np.unique(ids[ids >= 0]):
        tokens, slots = np.nonzero(ids == e)
        xe = x[tokens]
        g = np.einsum("th,ih->ti", xe, gate[e])
        u = np.einsum("th,ih->ti", xe, up[e])
        if swiglu_limit is not None:
            g, u = np.minimum(g, swiglu_limit), np.clip(u, -swiglu_limit, swiglu_limit)
        with np.errstate(invalid="ignore"):  # NaN codes
            h = round_to(gate_activation(g, hidden_act) * u, act)
        z = np.einsum("ti,hi->th", h, down[e])
        np.add.at(y, tokens, np.asarray(topk_weights, np.float64)[tokens, slots][:, None] * z)
    return y


def random_routing(T, E, k, seed=0, skip_fraction=0.0):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64).reshape(T, k)
    if skip_fraction:
        ids[rng.random((T, k)) < skip_fraction] = -1
    weights = rng.random((T, k)).astype(np.float32)
    return ids, weights


def nmse(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(((got - want) ** 2).sum() / max((want ** 2).sum(), 1e-300))
