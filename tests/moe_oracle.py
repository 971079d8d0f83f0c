"""Independent oracle for MoE tests: weights quantized with ml_dtypes, the layer computed in float64."""
import ml_dtypes
import numpy as np

from ktfp8.experts import ExpertWeights

E4M3 = ml_dtypes.float8_e4m3fn


def quantize_per_channel(w):
    """[E, out, in] float32 -> (codes uint8, scale float32 [E, out, 1]), with ml_dtypes."""
    scale = (np.abs(w).max(axis=-1, keepdims=True) / 448).astype(np.float32)
    scale[scale == 0] = 1
    codes = np.clip(w / scale, -448, 448).astype(E4M3).view(np.uint8)
    return codes, scale


def quantize_block(w, block):
    """[E, out, in] -> (codes, scale [E, ceil(out/bn), ceil(in/bk)]); block = edge or (bn, bk)."""
    bn, bk = (block, block) if np.isscalar(block) else block
    E, n, k = w.shape
    nbn, nbk = -(-n // bn), -(-k // bk)
    padded = np.zeros((E, nbn * bn, nbk * bk), np.float32)
    padded[:, :n, :k] = w
    amax = np.abs(padded.reshape(E, nbn, bn, nbk, bk)).max(axis=(2, 4))
    scale = np.where(amax > 0, amax / 448, 1).astype(np.float32)
    full = np.repeat(np.repeat(scale, bn, axis=1), bk, axis=2)[:, :n, :k]
    codes = np.clip(w / full, -448, 448).astype(E4M3).view(np.uint8)
    return codes, scale


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


def moe_fp64(x, topk_ids, topk_weights, gate, up, down, act=None):
    """y[t] = sum_s w[t,s] * down_e @ (silu(gate_e @ x_t) * (up_e @ x_t)), float64, ids < 0 skipped.

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
        with np.errstate(over="ignore", invalid="ignore"):  # exp(-g) of a very negative g; NaN codes
            h = round_to(g / (1 + np.exp(-g)) * u, act)
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
