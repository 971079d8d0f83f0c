"""Fixed cost of one small call, which a model pays per layer per token (a 48-layer MoE model makes
96 such MoE / routing calls per decoded token): a tiny MoE (E=8, H=64, I=32, T=1, one thread), the
FP8 encoding of 64 float32 values (default backend and threads, as a user calls it), and the routing
of one token over 8 experts.

    python -m pytest bench/bench_call_overhead.py --benchmark-only

Goals on an AMX Xeon (issue 14): MoE <= 10 us, encode <= 5 us, route <= 10 us.  What remains of the
MoE figure is mostly ktfp8_moe_forward itself (the Python side and the seam take ~1-3 us)."""
import numpy as np
import pytest

import ktfp8
from ktfp8 import fp8

CFG = ktfp8.MoeConfig(expert_num=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=32)


@pytest.fixture(scope="module")
def tiny_moe():
    rng = np.random.default_rng(0)
    w = [rng.standard_normal(s).astype(np.float32) for s in ((8, 32, 64), (8, 32, 64), (8, 64, 32))]
    return ktfp8.MoE(CFG, ktfp8.quantize_experts(*w, CFG.quant_config), threads=1)


def test_moe_tiny_call(benchmark, tiny_moe):
    x = np.ones((1, 64), np.float32)
    ids, weights = np.array([[1, 5]], np.int64), np.array([[0.6, 0.4]], np.float32)
    y = benchmark(tiny_moe, x, ids, weights)
    assert y.shape == (1, 64) and np.isfinite(y).all()


def test_encode_64_values(benchmark):
    x = np.linspace(-500, 500, 64, dtype=np.float32)
    codes = benchmark(fp8.encode, x)
    assert codes.shape == (64,) and codes.dtype == np.uint8


def test_route_one_token(benchmark):
    logits = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)
    ids, weights = benchmark(ktfp8.route, logits, CFG)
    assert ids.tolist() == [[7, 6]]
