"""The layers the benchmark runs, their random weights, and the routing each timed call uses."""
import dataclasses
import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .. import backends
from .._native import _ext
from ..config import MoeConfig
from ..experts import ExpertWeights
from ..moe import native_shape

FORMATS = ("fp8_per_channel", "fp8_block", "bf16")
BYTES_PER_WEIGHT = {"fp8_per_channel": 1, "fp8_block": 1, "bf16": 2, "fp32": 4}
BLOCK = 128  # DeepSeek-V3's block-wise FP8 uses 128x128 blocks
WALK_L3_MULTIPLE = 4  # the copies of a layer a benchmark walks total at least this many L3s
MAX_COPIES = 8        # ... but no more copies than this (a tiny layer would need thousands)


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

    def packed_bytes(self, fmt):
        """The layer's bytes as packed in format `fmt` by the usable backend that packs the most (the
        packer's own size, _ext.packed_size): rows padded to whole tiles, a float32 scale per row (and
        K block), so that a tiny projection is mostly padding (H = I = 1: 1.7 KB an expert in FP8)."""
        shape = native_shape(self.experts, self.hidden, self.intermediate, fmt,
                             (BLOCK, BLOCK) if fmt == "fp8_block" else None)
        return max(_ext.packed_size(backends.variant(name), shape) for name in backends.usable_variants())

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


# A per-channel quantized Gaussian row puts its largest weight, about 4 sigma for a row of 2048, at 448.
GAUSSIAN_SIGMAS_AT_448 = 4.0


def gaussian_code_table(entries=1 << 16):
    """[entries] uint8: the FP8 codes of `entries` equally likely quantiles of a Gaussian scaled so
    that GAUSSIAN_SIGMAS_AT_448 sigma is 448, ascending; indexed by uniform random integers it draws
    codes distributed as a per-channel quantized Gaussian's (about 1e-4 of them subnormal)."""
    z = np.sort(np.random.default_rng(0).standard_normal(entries * 16))[8::16]  # the entries' middles
    w = np.clip(z * (448.0 / GAUSSIAN_SIGMAS_AT_448), -448.0, 448.0)
    return w.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def random_experts(layer, fmt, seed=0):
    """Random FP8 codes distributed as a per-channel quantized Gaussian's, or BF16 values of a trained
    layer's magnitude, with realistic scales, and no quantization needed.  Speed does not depend on
    the values, with one exception: avx2 feeds the subnormal codes to its FMAs as subnormal floats,
    free on Zen 3, a microcode assist each on Intel cores.  On an Intel Xeon VM (moe_avx2.c), 1
    thread, 8 experts, the codes of a quantized Gaussian (9e-5 subnormal) took 1.03x the time of no
    subnormal codes at T=1 and 1.15x at T=16; uniform codes (5.6 % subnormal, what this drew before)
    30x at T=1."""
    rng = np.random.default_rng(seed)
    E, H, I = layer.experts, layer.hidden, layer.intermediate
    shapes = [(E, I, H), (E, I, H), (E, H, I)]
    if fmt == "bf16":
        # bf16 bit patterns of magnitude 2^-15..2^-4 (exponent field 0x70..0x7b), random sign
        ws = [(rng.integers(0x3800, 0x3E00, s, dtype=np.uint16) | (rng.integers(0, 2, s, dtype=np.uint16) << 15))
              .view(ml_dtypes.bfloat16) for s in shapes]
        return ExpertWeights("bf16", *ws)
    table = gaussian_code_table()
    codes = [table[rng.integers(0, len(table), s, dtype=np.uint16)] for s in shapes]
    if fmt == "fp8_per_channel":
        scales = [(rng.random((E, s[1], 1)) * 1e-3).astype(np.float32) for s in shapes]
        return ExpertWeights(fmt, *codes, *scales)
    scales = [(rng.random((E, -(-s[1] // BLOCK), -(-s[2] // BLOCK))) * 1e-3).astype(np.float32) for s in shapes]
    return ExpertWeights(fmt, *codes, *scales, block=(BLOCK, BLOCK))


def activations(layer, tokens, seed=0):
    return np.random.default_rng(seed).standard_normal((tokens, layer.hidden)).astype(ml_dtypes.bfloat16)


def routing_rounds(layer, tokens, rounds, seed=0, copies=1):
    """`rounds` draws (topk_ids, topk_weights, copy), one per timed call, each token picking top_k
    distinct experts, so that no call finds its weights in cache, as in a model's forward:

    - calls walk `copies` distinct copies of the layer in turn (copy = call number % copies), as a
      forward walks its layers;
    - within a copy, the experts are split into g = E // (tokens * top_k) disjoint pools (at least 1),
      visited in turn, and a call draws only from its pool: at T=1 on 64 experts, top-8, each call
      reads 8 experts no call of the last 8 * copies has read.  So an expert's weights are read again
      only after about the whole walk (copies x the layer) has been streamed."""
    rng = np.random.default_rng(seed)
    E, k = layer.experts, layer.top_k
    pools = max(1, E // (tokens * k))
    size = E // pools
    order = rng.permutation(E)  # the pools: a random partition, so a call's experts lie apart in memory
    draws = []
    for r in range(rounds):
        first = ((r // copies) % pools) * size
        pool = order[first:first + size]
        ids = np.stack([rng.permutation(pool)[:k] for _ in range(tokens)]).astype(np.int64)
        w = rng.random((tokens, k)).astype(np.float32)
        draws.append((ids, w / w.sum(axis=1, keepdims=True), r % copies))
    return draws


def walk_reaches_dram(walk_bytes, l3_mib):
    """Whether a walk of walk_bytes totals WALK_L3_MULTIPLE x the L3 (of l3_mib MiB; unknown: assumed
    so): a shorter one, capped by MAX_COPIES or by memory, is read partly from cache."""
    return not l3_mib or walk_bytes is None or walk_bytes >= WALK_L3_MULTIPLE * l3_mib * 2**20


def probe_bytes(fallback):
    """Bytes of the read probe run beside the walks: WALK_L3_MULTIPLE x the L3, as the walks total at
    least, or `fallback` where the L3 is unknown."""
    l3 = l3_bytes()
    return WALK_L3_MULTIPLE * l3 if l3 else fallback


def l3_bytes():
    """Total bytes of the distinct L3 caches this machine reports (sysfs), else glibc's figure for one
    L3, else None."""
    sizes = {}
    base = "/sys/devices/system/cpu"
    for cpu in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        caches = os.path.join(base, cpu, "cache")
        if not (cpu.startswith("cpu") and cpu[3:].isdigit() and os.path.isdir(caches)):
            continue
        for index in os.listdir(caches):
            try:
                with open(os.path.join(caches, index, "level")) as f:
                    if f.read().strip() != "3":
                        continue
                with open(os.path.join(caches, index, "size")) as f:
                    size = _size_bytes(f.read().strip())
                with open(os.path.join(caches, index, "shared_cpu_list")) as f:
                    sizes[f.read().strip()] = size  # one entry per L3 instance
            except (OSError, ValueError):
                continue
    if sizes:
        return sum(sizes.values())
    try:
        return os.sysconf("SC_LEVEL3_CACHE_SIZE") or None
    except (ValueError, OSError):
        return None


def _size_bytes(text):
    """sysfs cache sizes: '32768K', '2M', '300M' or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def copies_for(walk_bytes, copy_bytes, memory_bytes, max_copies=MAX_COPIES):
    """How many copies of a layer (copy_bytes each) a benchmark walks: enough that they total at
    least `walk_bytes`, within `memory_bytes` and `max_copies`; at least 1."""
    wanted = -(-int(walk_bytes) // max(1, int(copy_bytes)))
    return max(1, min(wanted, int(memory_bytes) // max(1, int(copy_bytes)), max_copies))


def copied(experts):
    """The same weights in memory of their own (a second layer with identical values)."""
    arrays = {f.name: getattr(experts, f.name) for f in dataclasses.fields(experts)}
    return ExpertWeights(**{k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v
                            for k, v in arrays.items()})


def active_weight_bytes(layer, ids, fmt):
    """Bytes of expert weights a call with these ids must read at least once."""
    return len(np.unique(ids)) * layer.weights_per_expert * BYTES_PER_WEIGHT[fmt]
