"""ktfp8 inside Hugging Face transformers: FP8 routed experts for transformers MoE models on CPUs.

`import ktfp8.hf` registers the experts implementations (transformers' `experts_implementation=`):
  "ktfp8"        FP8 E4M3, one float32 scale per output row (per-channel)
  "ktfp8_block"  FP8 E4M3, one scale per 128 x 128 block (DeepSeek-V3 layout)
  "ktfp8_bf16"   BF16 weights, ktfp8 kernels
A model's expert weights are converted the first time each block runs (or all at once with
`prepare(model)`), then the transformers expert parameters are released.
`from_pretrained(path)` loads a folder written by `python -m ktfp8.convert` with its experts
memory-mapped from the FP8 shards.  Needs torch and transformers; `import ktfp8` alone does not."""
import re

# The oldest releases the ktfp8.hf tests pass on (2026-12-07): transformers 5.0-5.6 refuse a registered
# experts_implementation by name (5.0.0 run, the others' modeling_utils.py read); 5.7.0 and 5.10.1 fail
# dozens of the tests, 5.15.0, 5.20.0, 5.22.0 and 5.23.0 nine (a model output has no `.cache` before 5.24:
# python -m ktfp8.generate; HunYuan's per-layer top_k); 5.24.0 and 5.25.0 pass.  transformers 5 itself
# disables torch older than 2.6.
MIN_VERSIONS = {"torch": (2, 6), "transformers": (5, 24)}
# PyPI's torch is the multi-GB CUDA build on Linux; these kernels run on CPUs, and so can the rest of the model
_INSTALL = ("pip install 'torch>=2.6' --index-url https://download.pytorch.org/whl/cpu && "
            "pip install 'transformers>=5.24'")
try:
    import torch
    import transformers
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: F401
except ImportError as e:        # pragma: no cover - depends on the environment
    raise ImportError(f"ktfp8.hf needs torch and transformers ({e}); install them, e.g. `{_INSTALL}`") from e


def _release(version):
    """(major, minor) of a version string such as '2.13.0+cpu', '5.25.0.dev0' or '5.3rc1'."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in (version.split(".") + ["0"])[:2])


def _refuse_old_versions():
    for module in (torch, transformers):
        oldest = MIN_VERSIONS[module.__name__]
        if _release(module.__version__) < oldest:
            raise ImportError(f"ktfp8.hf needs {module.__name__} {'.'.join(map(str, oldest))} or later, found "
                              f"{module.__version__}; upgrade it, e.g. `{_INSTALL}`")


_refuse_old_versions()

from .checkpoint import from_pretrained  # noqa: E402  (after the version check)
from .experts import IMPLEMENTATIONS, SUPPORTED_MODEL_TYPES, prepare, register_implementations  # noqa: E402

register_implementations()

__all__ = ["from_pretrained", "prepare", "IMPLEMENTATIONS", "SUPPORTED_MODEL_TYPES"]
