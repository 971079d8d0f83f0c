"""ktfp8 inside Hugging Face transformers: FP8 routed experts for transformers MoE models on CPUs.

`import ktfp8.hf` registers the experts implementations (transformers' `experts_implementation=`):
  "ktfp8"        FP8 E4M3, one float32 scale per output row (per-channel)
  "ktfp8_block"  FP8 E4M3, one scale per 128 x 128 block (DeepSeek-V3 layout)
  "ktfp8_bf16"   BF16 weights, ktfp8 kernels
A model's expert weights are converted the first time each block runs (or all at once with
`prepare(model)`), then the transformers expert parameters are released.
`from_pretrained(path)` loads a folder written by `python -m ktfp8.convert` with its experts
memory-mapped from the FP8 shards.  Needs torch and transformers; `import ktfp8` alone does not."""
try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: F401
except ImportError as e:        # pragma: no cover - depends on the environment
    raise ImportError(f"ktfp8.hf needs torch and transformers >= 5 (its experts implementations) ({e}); "
                      f"install them, e.g. `pip install torch 'transformers>=5'`") from e

from .checkpoint import from_pretrained
from .experts import IMPLEMENTATIONS, SUPPORTED_MODEL_TYPES, prepare, register_implementations

register_implementations()

__all__ = ["from_pretrained", "prepare", "IMPLEMENTATIONS", "SUPPORTED_MODEL_TYPES"]
