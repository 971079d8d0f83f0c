"""AVX-512 MoE kernels (avx512: F/BW/VL; avx512_bf16: + BF16 + VBMI) through the whole forward.

Driven through the C seam (_ext.PackedMoE) so that only the micro-kernel differs
between runs.  Every kernel is checked against the portable `reference` kernel reading the same
activation dtype (NMSE <= 1e-6) and against a float64 NumPy MoE on the dequantized weights
(NMSE <= 2e-5).  On a CPU without AVX-512 the same sources run as the *_emulated variants (SIMDe);
the native ones run where the CPU has the instructions.

Weights are quantized here with ml_dtypes (codes = float8_e4m3fn(clip(w / scale)), per-channel
scale = row amax / 448), independently of ktfp8's own codec."""
import ml_dtypes
import numpy as np
import pytest

from ktfp8 import backends
from ktfp8._native import _ext
from moe_oracle import dequantize, nmse, quantize_block, quantize_per_channel

E, HIDDEN, INTER, TOP_K = 5, 200, 72, 3
THREADS = 2
FMT = dict(zip(("fp8_per_channel", "fp8_block", "bf16"), _ext.ktfp8_wformat))
BF16 = 1  # moe_act_dtype(): 0 float32, 1 bfloat16
E4M3 = ml_dtypes.float8_e4m3fn

KERNELS = ["avx512_emulated", "avx512_bf16_emulated", "avx512", "avx512_bf16"]
# (format, block (block_n, block_k)): block_k 128 and 64 do not divide hidden 200; 34 = 2 mod 4
# makes K blocks start in the middle of the bf16 kernel's 64-byte code groups.
FORMATS = [("fp8_per_channel", None), ("fp8_block", (128, 128)), ("fp8_block", (64, 64)),
           ("fp8_block", (32, 34)), ("bf16", None)]
FORMAT_IDS = ["per_channel", "block128", "block64", "block32x34", "bf16"]


def usable(backend):
    return backend in backends.usable_variants()


def need(backend):
    if backend not in backends.compiled_variants():
        pytest.skip(f"{backend} is not compiled in this build")
    if not usable(backend):
        pytest.skip(f"this CPU cannot run {backend}")


# ------------------------------------------------------------------ weights (independent of ktfp8)

def dequantize64(codes, scale, fmt, block):
    """float64 weights of one projection [E, out, in]."""
    if fmt == "bf16":
        return codes.view(ml_dtypes.bfloat16).astype(np.float64)
    return dequantize(codes, scale, None if fmt == "fp8_per_channel" else block)


def make_experts(fmt, block, seed=0, hidden=HIDDEN, inter=INTER):
    """{'gate','up','down'}: (weights as the seam takes them, scale or None), plus the shape tuple."""
    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((E, inter, hidden)).astype(np.float32) * 0.08
    up = rng.standard_normal((E, inter, hidden)).astype(np.float32) * 0.08
    down = rng.standard_normal((E, hidden, inter)).astype(np.float32) * 0.1
    # a few outliers, so that per-channel / block scales differ a lot between rows
    gate[:, ::7, 3] *= 20
    down[:, 5, ::5] *= 30
    out = {}
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if fmt == "bf16":
            out[name] = (w.astype(ml_dtypes.bfloat16).view(np.uint16), None)
        elif fmt == "fp8_per_channel":
            out[name] = quantize_per_channel(w)
        else:
            out[name] = quantize_block(w, block)
    bn, bk = block or (0, 0)
    shape = (E, hidden, inter, FMT[fmt], bn, bk)
    return out, shape


def make_inputs(tokens, seed=1, skip=True, hidden=HIDDEN):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:TOP_K] for _ in range(tokens)]).astype(np.int64)
    if skip and tokens > 1:
        ids[1::3, 0] = -1  # "expert held elsewhere": the slot contributes nothing
    weights = rng.uniform(0.1, 1.0, (tokens, TOP_K)).astype(np.float32)
    return x, ids, weights


# ------------------------------------------------------------------ running the seam and oracles

def forward(backend, experts, shape, x, ids, weights, act_dtype):
    g, u, d = experts["gate"], experts["up"], experts["down"]
    kernel = _ext.PackedMoE(backends.variant(backend), shape, g[0], u[0], d[0], g[1], u[1], d[1], THREADS)
    y = np.full_like(x, np.nan)  # not accumulate: every element must be written
    kernel.forward(x, ids, weights, y, False, act_dtype)
    return y


def moe64(experts, fmt, block, x, ids, weights):
    """The MoE in float64 on dequantized weights: y = sum_slots w * down(silu(gate x) * up x)."""
    g, u, d = (dequantize64(*experts[n], fmt, block) for n in ("gate", "up", "down"))
    x64 = x.astype(np.float64)
    y = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = ids[t, slot]
            if e < 0:
                continue
            gx, ux = g[e] @ x64[t], u[e] @ x64[t]
            h = gx / (1.0 + np.exp(-gx)) * ux
            y[t] += float(weights[t, slot]) * (d[e] @ h)
    return y


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("fmt,block", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_matches_reference_kernel(backend, fmt, block, tokens):
    """Same activation dtype as the kernel, so only accumulation order separates the two.
    T = 1, 3 run the decode path (<= 4 tokens per expert), 17 and 64 the prefill path."""
    need(backend)
    act = backends.variant(backend).act_dtype
    experts, shape = make_experts(fmt, block)
    x, ids, weights = make_inputs(tokens)
    y = forward(backend, experts, shape, x, ids, weights, act)
    ref = forward("reference", experts, shape, x, ids, weights, act)
    assert np.all(np.isfinite(y))
    err = nmse(y, ref)
    assert err <= 1e-6, f"{backend} {fmt} {block} T={tokens}: NMSE {err:.3g} vs reference"


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("fmt,block", [FORMATS[i] for i in (0, 2, 4)], ids=[FORMAT_IDS[i] for i in (0, 2, 4)])
@pytest.mark.parametrize("tokens", [2, 20])
def test_sizes_without_padding(backend, fmt, block, tokens):
    """hidden 256 and intermediate 96 are multiples of 32: no zero padding at the end of K, so a
    kernel that stops short of k, or reads a block's scale for the wrong K range, shows."""
    need(backend)
    act = backends.variant(backend).act_dtype
    experts, shape = make_experts(fmt, block, seed=7, hidden=256, inter=96)
    x, ids, weights = make_inputs(tokens, seed=8, hidden=256)
    y = forward(backend, experts, shape, x, ids, weights, act)
    ref = forward("reference", experts, shape, x, ids, weights, act)
    err = nmse(y, ref)
    assert err <= 1e-6, f"{backend} {fmt} {block} T={tokens}: NMSE {err:.3g} vs reference"


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("fmt,block", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("tokens", [2, 24])
def test_matches_float64_oracle(backend, fmt, block, tokens):
    """float32 input against the float64 MoE on the same dequantized weights (the bf16 kernel
    also rounds x and h to bf16 on the way: that is inside the budget)."""
    need(backend)
    experts, shape = make_experts(fmt, block, seed=3)
    x, ids, weights = make_inputs(tokens, seed=4)
    y = forward(backend, experts, shape, x, ids, weights, backends.variant(backend).act_dtype)
    err = nmse(y, moe64(experts, fmt, block, x, ids, weights))
    assert err <= 2e-5, f"{backend} {fmt} {block} T={tokens}: NMSE {err:.3g} vs float64"


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("tokens", [1, 9])
def test_every_code_converts_exactly(backend, tokens):
    """Row j of down holds the single code j at K index 0; gate and up make h = silu(1) * 1 for
    every intermediate row.  So y[t, j] = decode(j) * scale[j] * h[0]: one product per output, the
    same rounding in every kernel, hence bit-identical to the reference for all 256 codes
    (subnormals and +-0 included); the NaN codes 0x7F, 0xFF give NaN in their own column only."""
    need(backend)
    hidden, inter = 256, 16
    one = np.float32(1).astype(E4M3).view(np.uint8)
    gate = np.zeros((1, inter, hidden), np.uint8)
    gate[0, :, 0] = one
    up = gate.copy()
    down = np.zeros((1, hidden, inter), np.uint8)
    down[0, :, 0] = np.arange(hidden)
    down_scale = np.random.default_rng(5).uniform(0.5, 2.0, (1, hidden)).astype(np.float32)
    ones = np.ones((1, inter), np.float32)
    experts = {"gate": (gate, ones), "up": (up, ones), "down": (down, down_scale)}
    shape = (1, hidden, inter, FMT["fp8_per_channel"], 0, 0)
    x = np.zeros((tokens, hidden), np.float32)
    x[:, 0] = 1.0
    ids = np.zeros((tokens, 1), np.int64)
    weights = np.ones((tokens, 1), np.float32)
    act = backends.variant(backend).act_dtype
    y = forward(backend, experts, shape, x, ids, weights, act)
    ref = forward("reference", experts, shape, x, ids, weights, act)
    np.testing.assert_array_equal(y, ref)
    nan_codes = [0x7F, 0xFF]
    assert np.array_equal(np.flatnonzero(np.isnan(y[0])), nan_codes)
    h0 = np.float32(1 / (1 + np.exp(-1.0)))
    if act == BF16:
        h0 = h0.astype(ml_dtypes.bfloat16)  # h is rounded to bf16 for the bf16 kernel
    expected = np.arange(hidden, dtype=np.uint8).view(E4M3).astype(np.float64) * down_scale[0] * float(h0)
    finite = np.isfinite(expected)
    assert np.all(expected[np.array([0x01, 0x81, 0x07])] != 0)  # subnormal codes are in the check
    np.testing.assert_allclose(y[:, finite], np.broadcast_to(expected[finite], (tokens, finite.sum())),
                               rtol=3e-7, atol=0)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("fmt,block", FORMATS[:3], ids=FORMAT_IDS[:3])
@pytest.mark.parametrize("tokens", [2, 12])
def test_nan_code_propagates_to_its_outputs_only(backend, fmt, block, tokens):
    """A NaN code in row 7 of expert 2's down projection: y[t, 7] is NaN exactly for the tokens
    routed to expert 2, everything else stays equal to the reference."""
    need(backend)
    experts, shape = make_experts(fmt, block)
    codes = experts["down"][0].copy()
    codes[2, 7, 40] = 0xFF
    experts["down"] = (codes, experts["down"][1])
    x, ids, weights = make_inputs(tokens, skip=False)
    act = backends.variant(backend).act_dtype
    y = forward(backend, experts, shape, x, ids, weights, act)
    ref = forward("reference", experts, shape, x, ids, weights, act)
    expected = np.zeros_like(y, dtype=bool)
    expected[np.any(ids == 2, axis=1), 7] = True
    assert expected.any()
    np.testing.assert_array_equal(np.isnan(y), expected)
    assert nmse(y[~expected], ref[~expected]) <= 1e-6
