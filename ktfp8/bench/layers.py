"""The layers the benchmark runs, their random weights, and the routing each timed call uses."""
import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..config import MoeConfig
from ..experts import ExpertWeights

FORMATS = ("fp8_per_channel", "fp8_block", "bf16")
BYTES_PER_WEIGHT = {"fp8_per_channel": 1, "fp8_block": 1, "bf16": 2, "fp32": 4}
BLOCK = 128  # DeepSeek-V3's block-wise FP8 uses 128x128 blocks


@dataclass(frozen=True)
class Layer:
    name: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int

    @property
    def weights_per_expert(self):
        return 3 * self.hidden * self.intermediate  # gate, up, down

    def flops(self, tokens):
        """Multiply-adds x2 of the routed experts for `tokens` tokens."""
        return 2 * tokens * self.top_k * self.weights_per_expert

    def config(self, fmt):
        cfg = MoeConfig(expert_num=self.experts, num_experts_per_tok=self.top_k,
                        hidden_size=self.hidden, intermediate_size=self.intermediate)
        cfg.quant_config.method = "BF16" if fmt == "bf16" else "FP8"
        cfg.quant_config.per_channel = fmt != "fp8_block"
        cfg.quant_config.group_size = BLOCK if fmt == "fp8_block" else 0
        return cfg


# FP8 experts 302 MB, far beyond any L3.
BENCH_LAYER = Layer("bench E=64 top-8 H=2048 I=768", 64, 8, 2048, 768)


def ram_bytes():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def deepseek_v3_slice(ram=None):
    """DeepSeek-V3's MoE layer shape (hidden 7168, intermediate 2048, top-8) with as many experts as
    fit in a quarter of RAM in BF16, the widest format every side holds (V3 itself has 256)."""
    per_expert = 3 * 7168 * 2048 * BYTES_PER_WEIGHT["bf16"]
    experts = min(256, max(8, (ram or ram_bytes()) // 4 // per_expert))
    return Layer(f"DeepSeek-V3 slice E={experts} top-8 H=7168 I=2048", int(experts), 8, 7168, 2048)


def random_experts(layer, fmt, seed=0):
    """Random FP8 codes (finite, both signs) or BF16 values of a trained layer's magnitude, with
    realistic scales: speed does not depend on the values, and no quantization is needed."""
    rng = np.random.default_rng(seed)
    E, H, I = layer.experts, layer.hidden, layer.intermediate
    shapes = [(E, I, H), (E, I, H), (E, H, I)]
    if fmt == "bf16":
        # bf16 bit patterns of magnitude 2^-15..2^-4 (exponent field 0x70..0x7b), random sign
        ws = [(rng.integers(0x3800, 0x3E00, s, dtype=np.uint16) | (rng.integers(0, 2, s, dtype=np.uint16) << 15))
              .view(ml_dtypes.bfloat16) for s in shapes]
        return ExpertWeights("bf16", *ws)
    # codes 0x00..0x7d with a random sign bit: every finite E4M3 magnitude below 448, never NaN
    codes = [rng.integers(0, 0x7E, s, dtype=np.uint8) | (rng.integers(0, 2, s, dtype=np.uint8) << 7) for s in shapes]
    if fmt == "fp8_per_channel":
        scales = [(rng.random((E, s[1], 1)) * 1e-3).astype(np.float32) for s in shapes]
        return ExpertWeights(fmt, *codes, *scales)
    scales = [(rng.random((E, -(-s[1] // BLOCK), -(-s[2] // BLOCK))) * 1e-3).astype(np.float32) for s in shapes]
    return ExpertWeights(fmt, *codes, *scales, block=(BLOCK, BLOCK))


def activations(layer, tokens, seed=0):
    return np.random.default_rng(seed).standard_normal((tokens, layer.hidden)).astype(ml_dtypes.bfloat16)


def routing_rounds(layer, tokens, rounds, seed=0):
    """`rounds` (topk_ids, topk_weights) draws, one per timed call, each token picking top_k distinct
    experts.  So that a call never finds its weights in cache, a call that touches at most half the
    experts draws them from the half the previous call did not use; larger calls draw from all of
    them (the whole layer, far beyond L3, is then streamed every call)."""
    rng = np.random.default_rng(seed)
    E, k = layer.experts, layer.top_k
    half = tokens * k <= E // 2 and k <= E // 2
    draws = []
    for r in range(rounds):
        pool = (np.arange(E // 2) + (r % 2) * (E // 2)) if half else np.arange(E)
        ids = np.stack([rng.permutation(pool)[:k] for _ in range(tokens)]).astype(np.int64)
        w = rng.random((tokens, k)).astype(np.float32)
        draws.append((ids, w / w.sum(axis=1, keepdims=True)))
    return draws


def active_weight_bytes(layer, ids, fmt):
    """Bytes of expert weights a call with these ids must read at least once."""
    return len(np.unique(ids)) * layer.weights_per_expert * BYTES_PER_WEIGHT[fmt]
