"""ktfp8: FP8 (E4M3) per-channel Mixture-of-Experts kernels for CPUs.

    cfg = ktfp8.MoeConfig(expert_num=64, num_experts_per_tok=8, hidden_size=2048, intermediate_size=768)
    experts = ktfp8.quantize_experts(gate, up, down, cfg.quant_config)   # [E, out, in] float arrays
    moe = ktfp8.MoE(cfg, experts)                                         # packed once
    y = moe(x, *ktfp8.route(router_logits, cfg))

Public names: MoeConfig (alias MOEConfig), QuantConfig, quantize_experts, ExpertWeights, MoE,
moe_forward, route, available_backends, compiled_variants, cpu_features, the FP8 codec ktfp8.fp8,
checkpoints in ktfp8.loader, and the commands python -m ktfp8.convert / ktfp8.cpu.  Each has its
docstring (help(ktfp8.MoE)); the project's README.md (also the package description in its metadata)
has the overview and the catalogue of errors.  NumPy arrays and CPU torch tensors are both accepted;
`import ktfp8` never imports torch.
"""
from . import fp8
from .backends import available_backends, compiled_variants, cpu_features
from .config import MOEConfig, MoeConfig, QuantConfig
from .experts import ExpertWeights, quantize_experts
from .moe import MoE, moe_forward
from .routing import route

__version__ = "0.1.0"
