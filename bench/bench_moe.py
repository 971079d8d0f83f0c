"""MoE decode and prefill on the benchmark layer: E=64, top-8, hidden 2048, intermediate 768
(FP8 experts 302 MB >> L3), per backend and weight format.

Each round routes to freshly drawn experts so the active weights come from DRAM, not cache.
Reported per case (extra_info, and a summary table at the end): effective GB/s = active expert
bytes / time, as a fraction of the measured read bandwidth; TFLOP/s as a fraction of the measured
vector peak.  Run: pytest bench/bench_moe.py --benchmark-only"""
import numpy as np
import pytest

import ktfp8
from ktfp8.experts import ExpertWeights
from ktfp8.moe import MoE

E, TOPK, HIDDEN, INTER = 64, 8, 2048, 768
FORMATS = ["fp8_per_channel", "fp8_block", "bf16"]


def _random_experts(fmt, seed=0):
    """Random codes/bf16 bits (no quantization needed to measure speed), realistic scales."""
    rng = np.random.default_rng(seed)
    shapes = [(E, INTER, HIDDEN), (E, INTER, HIDDEN), (E, HIDDEN, INTER)]
    if fmt == "bf16":
        # bf16 bit patterns of small normal numbers: sign, exponent 0x70..0x7c, any mantissa
        ws = [((rng.integers(0x3800, 0x3E00, s, dtype=np.uint16)) | (rng.integers(0, 2, s, dtype=np.uint16) << 15))
              for s in shapes]
        return ExpertWeights("bf16", *ws)
    codes = [rng.integers(0, 0x7E, s, dtype=np.uint8) | (rng.integers(0, 2, s, dtype=np.uint8) << 7) for s in shapes]
    if fmt == "fp8_per_channel":
        scales = [(rng.random((E, s[1], 1)) * 1e-3).astype(np.float32) for s in shapes]
        return ExpertWeights(fmt, *codes, *scales)
    scales = [(rng.random((E, -(-s[1] // 128), -(-s[2] // 128))) * 1e-3).astype(np.float32) for s in shapes]
    return ExpertWeights(fmt, *codes, *scales, block=(128, 128))


def _config(fmt):
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=TOPK, hidden_size=HIDDEN, intermediate_size=INTER)
    cfg.quant_config.method = "BF16" if fmt == "bf16" else "FP8"
    cfg.quant_config.per_channel = fmt != "fp8_block"
    cfg.quant_config.group_size = 128 if fmt == "fp8_block" else 0
    return cfg


_MOES = {}


def _moe(fmt, backend):
    key = (fmt, backend)
    if key not in _MOES:
        _MOES.clear()  # one packed layer at a time keeps memory bounded
        _MOES[key] = MoE(_config(fmt), _random_experts(fmt), backend=backend)
    return _MOES[key]


@pytest.mark.parametrize("T", [1, 4, 64, 512])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ktfp8.available_backends())
def test_moe_layer(benchmark, limits, moe_results, backend, fmt, T):
    if backend == "reference" and T > 4:
        pytest.skip("the portable reference is an oracle, not a contender, at prefill sizes")
    moe = _moe(fmt, backend)
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, HIDDEN)).astype(np.float32)
    w = rng.random((T, TOPK)).astype(np.float32)
    drawn = []

    def setup():
        ids = np.stack([rng.permutation(E)[:TOPK] for _ in range(T)]).astype(np.int64)
        drawn.append(len(np.unique(ids)))
        return (x, ids, w), {}

    rounds = 20 if T <= 64 else 5
    benchmark.pedantic(moe, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    bytes_per_weight = 2 if fmt == "bf16" else 1
    active_bytes = np.median(drawn) * 3 * HIDDEN * INTER * bytes_per_weight
    gbs = active_bytes / seconds / 1e9
    tflops = 2 * T * TOPK * 3 * HIDDEN * INTER / seconds / 1e12
    info = dict(ms=seconds * 1e3, gbs=gbs, bw_fraction=gbs / limits.read_gbs, tflops=tflops,
                peak_fraction=tflops * 1e3 / limits.compute_gflops)
    benchmark.extra_info.update(info)
    moe_results.append((backend, fmt, T, info))

