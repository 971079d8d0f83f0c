"""ktfp8: FP8 (E4M3) per-channel Mixture-of-Experts kernels for CPUs.  Public names: API.md."""
from . import fp8
from .backends import available_backends, compiled_variants, cpu_features
from .config import MOEConfig, MoeConfig, QuantConfig
from .experts import ExpertWeights, quantize_experts
from .moe import MoE, moe_forward
from .routing import route

__version__ = "0.1.0"
