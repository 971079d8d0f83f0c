"""Fixed cost of one small call, which a model pays per layer per token (a 48-layer MoE model makes
96 such MoE / routing calls per decoded token): a tiny MoE (E=8, H=64, I=32, T=1, one thread), the
same layer as a transformers experts module under ktfp8.hf (torch tensors, inference mode), the FP8
encoding of 64 float32 values (default backend and threads, as a user calls it), and the routing of
one token over 8 experts.

    python -m pytest bench/bench_call_overhead.py --benchmark-only

Goals on an AMX Xeon (issue 14): MoE <= 10 us, encode <= 5 us, route <= 10 us.  What remains of the
MoE figure is mostly ktfp8_moe_forward itself (the Python side and the seam take ~1-3 us).  The
experts module adds transformers' dispatch and the tensors' checks: on the Zen 4 VM its median was
30.4-30.9 us against 37.5-38.3 while every call went through the custom op ktfp8::moe (three runs of
each, alternated), the MoE on NumPy arrays 4.7 us.  Since the plain call skips ktfp8.moe's and
accepts_tensors' Python checks (PackedMoE.forward_plain; the tensors then through NumPy views): the
MoE 2.8-2.9 us against 4.9-5.0, the experts module 20.0-20.6 against 29.0-29.4; after a flush 26-29
against 56-66 and 230-276 against 341-367 (four runs of each, alternated).  Since plain tensors go to
the kernel by address (_torch.plain_layer_memory), the layer's call takes 0.74x-0.75x the time of the
NumPy views' after a flush on the Zen 3 VM, 0.76x-0.77x back to back (alternated in one process);
this file's medians there swing by more than that from run to run (after a flush 316-429 us before,
325-354 after; interquartile ranges 66-118 us).

The *_after_a_flush cases read 4x the L3's bytes before each call, as a model's previous MoE layer
streams its weights from DRAM: the call's Python then runs from DRAM too, and costs several times
what it does back to back (the figure to set against a decode call's milliseconds)."""
import numpy as np
import pytest

import ktfp8
from ktfp8 import fp8, roofline
from ktfp8.bench import layers

CFG = ktfp8.MoeConfig(expert_num=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=32)


@pytest.fixture(scope="module")
def tiny_moe():
    rng = np.random.default_rng(0)
    w = [rng.standard_normal(s).astype(np.float32) for s in ((8, 32, 64), (8, 32, 64), (8, 64, 32))]
    return ktfp8.MoE(CFG, ktfp8.quantize_experts(*w, CFG.quant_config), threads=1)


FLUSH_ROUNDS = 200


@pytest.fixture(scope="module")
def flush():
    """Reads a buffer of 4x the L3 (128 MiB where it is unknown) once, in C: what a decode step's
    previous MoE layer does to the caches."""
    buf = roofline.probe_buffer(layers.probe_bytes(1 << 27), 1)

    def read_once():   # returns nothing: pytest-benchmark would take a value for the call's arguments
        roofline.read_bandwidth(1, repeats=1, buf=buf)
    return read_once


def run(benchmark, flush, fn, *args):
    """fn(*args) timed back to back, or each call after a flush of the caches."""
    if flush is None:
        return benchmark(fn, *args)
    return benchmark.pedantic(fn, args=args, setup=flush, rounds=FLUSH_ROUNDS)


@pytest.mark.parametrize("after_a_flush", [False, True], ids=["", "after_a_flush"])
def test_moe_tiny_call(benchmark, tiny_moe, request, after_a_flush):
    x = np.ones((1, 64), np.float32)
    ids, weights = np.array([[1, 5]], np.int64), np.array([[0.6, 0.4]], np.float32)
    y = run(benchmark, request.getfixturevalue("flush") if after_a_flush else None, tiny_moe, x, ids, weights)
    assert y.shape == (1, 64) and np.isfinite(y).all()


@pytest.mark.parametrize("after_a_flush", [False, True], ids=["", "after_a_flush"])
def test_hf_experts_tiny_call(benchmark, request, after_a_flush):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", minversion="5")
    import ktfp8.hf
    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
    model = ktfp8.hf.prepare(transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16), threads=1)
    experts = model.model.layers[0].mlp.experts
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    ids, weights = torch.tensor([[1, 5]]), torch.tensor([[0.6, 0.4]], dtype=torch.bfloat16)
    with torch.inference_mode():
        y = run(benchmark, request.getfixturevalue("flush") if after_a_flush else None, experts, x, ids, weights)
    assert y.shape == (1, 64) and torch.isfinite(y).all()


def test_encode_64_values(benchmark):
    x = np.linspace(-500, 500, 64, dtype=np.float32)
    codes = benchmark(fp8.encode, x)
    assert codes.shape == (64,) and codes.dtype == np.uint8


def test_route_one_token(benchmark):
    logits = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)
    ids, weights = benchmark(ktfp8.route, logits, CFG)
    assert ids.tolist() == [[7, 6]]
