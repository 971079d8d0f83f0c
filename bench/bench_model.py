"""A whole transformers MoE model, ktfp8 FP8 experts beside transformers' BF16 experts:

    python -m pytest bench/bench_model.py --benchmark-only

Qwen3-30B-A3B at its real widths (ktfp8.bench.model) with KTFP8_BENCH_MODEL_LAYERS of its layers
(default 1: ~1.3 GB in BF16, and a quantized copy); prefill = one forward over 512 tokens, decode = one
token after a 32-token prompt, kv cache on.  `python -m ktfp8.bench.model` prints the tokens/s table."""
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

import ktfp8.hf  # noqa: E402
from ktfp8 import backends  # noqa: E402
from ktfp8.bench.model import BATCHED_MM_MAX_TOKENS, build_model  # noqa: E402

LAYERS = int(os.environ.get("KTFP8_BENCH_MODEL_LAYERS", "1"))
THREADS = backends.usable_cores()
PROMPT_TOKENS = {"prefill": 512, "decode": 32}
VOCAB = 8192


@pytest.fixture(scope="module")
def models():
    """{side: model}: transformers' sides share one BF16 model; ktfp8 runs a quantized copy of it."""
    torch.set_num_threads(THREADS)
    quantized = ktfp8.hf.prepare(build_model(LAYERS, VOCAB), "ktfp8", threads=THREADS)
    return {"transformers": build_model(LAYERS, VOCAB), "ktfp8": quantized}


def _prompt(n):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("side", ["eager", "grouped_mm", "batched_mm", "ktfp8"])
def test_model_tokens_per_second(benchmark, models, side, phase):
    if side == "batched_mm" and phase == "prefill":
        pytest.skip(f"batched_mm gathers one weight copy per token and expert (> {BATCHED_MM_MAX_TOKENS} tokens)")
    model = models["ktfp8" if side == "ktfp8" else "transformers"]
    if side != "ktfp8":
        model.set_experts_implementation(side)
    prompt = _prompt(PROMPT_TOKENS[phase])
    with torch.inference_mode():
        if phase == "prefill":
            benchmark.pedantic(lambda: model(input_ids=prompt, use_cache=False, logits_to_keep=1),
                               rounds=2, iterations=1, warmup_rounds=1)
            tokens = prompt.shape[1]
        else:
            cache = model(input_ids=prompt, use_cache=True).cache
            token = torch.tensor([[7]])
            benchmark.pedantic(lambda: model(input_ids=token, cache=cache, use_cache=True),
                               rounds=5, iterations=1, warmup_rounds=1)
            tokens = 1
    benchmark.extra_info.update(layers=LAYERS, threads=THREADS, phase=phase, side=side,
                                tokens_per_s=tokens / benchmark.stats.stats.median)
