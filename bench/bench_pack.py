"""Loading cost: a MoE's construction (its experts packed once into the backend's tile layout) on the
benchmark layer (302 MB of FP8 codes, 604 MB of BF16), for every backend this CPU runs, on 1 thread
and on all, against the limit for the same bytes measured beside it on 1 thread: a copy into fresh
memory (np.copyto into a new array, whose pages the kernel zeroes on first touch, as it does the
packed buffer's).  A model pays this per MoE layer when it loads (58 layers of DeepSeek-V3, 48 of
Qwen3-30B-A3B).

    python -m pytest bench/bench_pack.py --benchmark-only
"""
import time

import numpy as np
import pytest

import ktfp8
from ktfp8 import backends
from ktfp8.bench import layers as L

LAYER = L.BENCH_LAYER
FORMATS = ("fp8_per_channel", "bf16")
_COPY_S = {}   # format -> median seconds of the fresh-memory copy (1 thread), measured beside the packs


@pytest.fixture(scope="module", params=FORMATS)
def experts(request):
    return request.param, L.random_experts(LAYER, request.param)


def _weights(experts):
    return [np.asarray(w).reshape(-1).view(np.uint8) for w in (experts.gate, experts.up, experts.down)]


def _copy_seconds(experts, rounds=5):
    """Median time of copying the expert weights into freshly allocated memory (NumPy, one thread)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for src in _weights(experts):
            np.copyto(np.empty_like(src), src)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


@pytest.mark.parametrize("threads", sorted({1, backends.default_threads(None)}))
@pytest.mark.parametrize("backend", backends.available_backends())
def test_pack(benchmark, experts, backend, threads):
    fmt, weights = experts
    if fmt not in _COPY_S:
        _COPY_S[fmt] = _copy_seconds(weights)
    cfg = LAYER.config(fmt)
    moe = benchmark.pedantic(lambda: ktfp8.MoE(cfg, weights, backend=backend, threads=threads), rounds=5,
                             warmup_rounds=1)
    assert moe.backend == backend
    seconds = benchmark.stats.stats.median
    nbytes = sum(w.nbytes for w in _weights(weights))
    benchmark.extra_info.update({"GB/s": round(nbytes / seconds / 1e9, 2),
                                 "copy GB/s (1 thread, fresh memory)": round(nbytes / _COPY_S[fmt] / 1e9, 2),
                                 "time over the copy": round(seconds / _COPY_S[fmt], 2)})
