"""The AMX MoE kernel against the reference kernel, through the C seam (moe_pack / moe_forward).

`amx_emulated` is the same source as `amx` compiled against the tile emulation; it runs on any CPU
with AVX2.  Native `amx` joins where the CPU and OS allow it.  The reference runs with BF16
activations (act_dtype 1), the rounding the AMX kernel applies, so the comparison isolates the
kernel: FP32 sums in another order (NMSE <= 1e-6).

Which path runs depends on m, the tokens routed to one expert: m < 16 takes the avx512_bf16
micro-kernel, m >= 16 the tiles (passes of 4 x 16 tokens, a short last tile for m % 16).  The
routing below gives every expert a chosen m on one side or the other.  Sizes are odd (hidden 200,
intermediate 72: K padded to 224 / 96, 13 and 5 weight tiles with partly empty last ones) and
small, because every emulated TDPBF16PS is 8192 scalar FMAs.
"""
import ml_dtypes
import numpy as np
import pytest

from ktfp8 import backends
from ktfp8._native import _ext
from moe_oracle import nmse, quantize_block, quantize_per_channel

HIDDEN, INTER = 200, 72
FMT_CHANNEL, FMT_BLOCK, FMT_BF16 = _ext.ktfp8_wformat
ACT_BF16 = _ext.ktfp8_dtype.KTFP8_BF16

AMX_BACKENDS = ["amx_emulated"] + (["amx"] if "amx" in backends.usable_variants() else [])


def make_experts(fmt, experts, block=(128, 128), seed=0):
    """(shape tuple for the seam, [gate, up, down], [scales]) with weights ~ N(0, 1/in)."""
    rng = np.random.default_rng(seed)
    dense = [rng.standard_normal((experts, INTER, HIDDEN)) / np.sqrt(HIDDEN),
             rng.standard_normal((experts, INTER, HIDDEN)) / np.sqrt(HIDDEN),
             rng.standard_normal((experts, HIDDEN, INTER)) / np.sqrt(INTER)]
    dense = [d.astype(np.float32) for d in dense]
    if fmt == FMT_BF16:
        weights = [d.astype(ml_dtypes.bfloat16).view(np.uint16) for d in dense]
        scales = [None] * 3
        bn, bk = 0, 0
    elif fmt == FMT_CHANNEL:
        weights, scales = zip(*(quantize_per_channel(d) for d in dense))
        bn, bk = 0, 0
    else:
        bn, bk = block
        weights, scales = zip(*(quantize_block(d, block) for d in dense))
    return (experts, HIDDEN, INTER, fmt, bn, bk), list(weights), list(scales)


def forward(backend, shape, weights, scales, x, ids, w, threads=2):
    kernel = _ext.PackedMoE(backends.variant(backend), shape, *weights, *scales, threads)
    y = np.zeros_like(x)
    kernel.forward(x, ids, w, y, False, ACT_BF16)
    return y


def routing(rng, tokens_per_expert, top_k=2):
    """topk_ids [T, top_k] in which expert e receives exactly tokens_per_expert[e] tokens; the other
    slots hold -1 (expert held elsewhere).  Weights are random positive."""
    t = max(tokens_per_expert)
    ids = np.full((t, top_k), -1, np.int64)
    for e, m in enumerate(tokens_per_expert):
        open_tokens = np.flatnonzero((ids < 0).any(axis=1))
        for token in rng.choice(open_tokens, size=m, replace=False):
            ids[token, np.flatnonzero(ids[token] < 0)[0]] = e
    weights = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    return ids, weights


# m per expert: 3 and 15 below the threshold; 16 exactly one tile; 37 = 2 tiles + 5 rows;
# 70 = one pass of 4 tiles + a pass with a 6-row tile.  Expert 0 holds most tokens so that the
# top-2 routing can place them all.
CASES = {"decode": [3, 15], "one_tile": [16, 3], "prefill": [70, 37, 15]}


@pytest.mark.parametrize("backend", AMX_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fmt, block", [(FMT_CHANNEL, None), (FMT_BLOCK, (128, 128)), (FMT_BLOCK, (64, 64)),
                                        (FMT_BF16, None)],
                         ids=["per_channel", "block128", "block64", "bf16"])
def test_matches_reference(backend, case, fmt, block):
    tokens = CASES[case]
    shape, weights, scales = make_experts(fmt, len(tokens), block=block or (128, 128))
    rng = np.random.default_rng(len(tokens) * 7 + fmt)
    ids, w = routing(rng, tokens)
    x = rng.standard_normal((ids.shape[0], HIDDEN)).astype(np.float32)
    ref = forward("reference", shape, weights, scales, x, ids, w)
    y = forward(backend, shape, weights, scales, x, ids, w)
    assert np.all(np.isfinite(y))
    assert nmse(y, ref) <= 1e-6


@pytest.mark.parametrize("backend", AMX_BACKENDS)
def test_block_not_a_multiple_of_the_k_slab(backend):
    """block_k = 48 splits 32-K slabs: the kernel hands such jobs to avx512_bf16, still correct."""
    shape, weights, scales = make_experts(FMT_BLOCK, 2, block=(48, 48))
    rng = np.random.default_rng(5)
    ids, w = routing(rng, [20, 4])
    x = rng.standard_normal((ids.shape[0], HIDDEN)).astype(np.float32)
    ref = forward("reference", shape, weights, scales, x, ids, w)
    assert nmse(forward(backend, shape, weights, scales, x, ids, w), ref) <= 1e-6


def test_threshold_splits_the_two_paths():
    """Below 16 tokens per expert the AMX backend *is* the avx512_bf16 micro-kernel (bit-identical
    output); from 16 on the tiles sum in another order, so the bits differ."""
    for m, same in ((15, True), (16, False)):
        shape, weights, scales = make_experts(FMT_CHANNEL, 1)
        rng = np.random.default_rng(m)
        ids, w = routing(rng, [m], top_k=1)
        x = rng.standard_normal((m, HIDDEN)).astype(np.float32)
        y_amx = forward("amx_emulated", shape, weights, scales, x, ids, w)
        y_vec = forward("avx512_bf16_emulated", shape, weights, scales, x, ids, w)
        assert np.array_equal(y_amx, y_vec) == same, m


def test_amx_emulated_is_listed_but_never_chosen():
    assert "amx_emulated" in backends.compiled_variants()
    assert "amx_emulated" not in backends.available_backends()
