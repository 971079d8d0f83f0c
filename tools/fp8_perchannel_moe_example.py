#!/usr/bin/env python3
"""FP8 per-channel MoE, configured the way KTransformers users know, checked against NumPy.

    python tools/fp8_perchannel_moe_example.py

Builds a small random layer, quantizes it to FP8 E4M3 with one scale per output row, runs it with
AMXFP8PerChannel_MOE (or ktfp8.MoE's fallback on CPUs without AVX-512-BF16), and compares the
output with a float64 NumPy computation on the dequantized weights."""
import argparse

import numpy as np

import ktfp8
from ktfp8 import moe as ktmoe

argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help says what this does; no options
E, TOPK, HIDDEN, INTER, TOKENS = 16, 4, 512, 256, 8

cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=TOPK, hidden_size=HIDDEN, intermediate_size=INTER)
cfg.quant_config.method = "FP8"
cfg.quant_config.per_channel = True
cfg.quant_config.group_size = 0

rng = np.random.default_rng(0)
gate = (rng.standard_normal((E, INTER, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
up = (rng.standard_normal((E, INTER, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
down = (rng.standard_normal((E, HIDDEN, INTER)) / np.sqrt(INTER)).astype(np.float32)
experts = ktfp8.quantize_experts(gate, up, down, cfg.quant_config)

if ktmoe._HAS_FP8_PERCHANNEL_SUPPORT:
    moe = ktmoe.AMXFP8PerChannel_MOE(cfg, experts)
else:
    print(f"AMXFP8PerChannel_MOE needs AVX-512-BF16 or AMX; this CPU runs {ktfp8.available_backends()}")
    moe = ktfp8.MoE(cfg, experts)
print(f"backend: {moe.backend}, packed weights: {moe.nbytes / 1e6:.1f} MB")

x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
router_logits = rng.standard_normal((TOKENS, E)).astype(np.float32)
topk_ids, topk_weights = ktfp8.route(router_logits, cfg)
y = moe(x, topk_ids, topk_weights)

# the same layer in float64 on the dequantized weights
g64, u64, d64 = (ktfp8.fp8.dequantize(c, s).astype(np.float64) for c, s in
                 ((experts.gate, experts.gate_scale), (experts.up, experts.up_scale),
                  (experts.down, experts.down_scale)))
want = np.zeros((TOKENS, HIDDEN))
for t in range(TOKENS):
    for e, w in zip(topk_ids[t], topk_weights[t]):
        g, u = g64[e] @ x[t], u64[e] @ x[t]
        want[t] += w * (d64[e] @ (g / (1 + np.exp(-g)) * u))
nmse = ((y - want) ** 2).sum() / (want ** 2).sum()
print(f"NMSE vs float64 reference: {nmse:.2e}")
assert nmse < 2e-5, "output does not match the reference"
print("OK")
