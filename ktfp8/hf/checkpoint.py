"""ktfp8.hf.from_pretrained: a transformers model from a folder written by `python -m ktfp8.convert`,
its routed experts memory-mapped from the FP8 shards (never widened), everything else loaded by
transformers as usual.

transformers would read the expert tensors into BF16 `gate_up_proj` / `down_proj` parameters.  Two
things keep it away from them: while the model is built, the experts modules get empty parameters
instead of [E, 2I, H] ones (a parameter-registration hook), and the checkpoint's expert tensor names
are renamed (key_mapping) so that no transformers weight converter matches and reads them."""
import contextlib
import os
import re
from pathlib import Path

import torch

from ..backends import requested_threads
from ..loader import CONVERT_SPLITS_FUSED, EXPERT_RE, PER_EXPERT_NAMES, FP8SafeTensorLoader, fused_experts_tensor
from . import experts as hf_experts
from .layer import build_layer, local_experts

_SKIPPED = "ktfp8_fp8_routed"        # what expert tensor names become for transformers: not a parameter
_KEY_MAPPING = {r"\.experts\.(\d+)\.": rf".{_SKIPPED}.\1."}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FP8_FORMATS = ("fp8_per_channel", "fp8_block")
# transformers from_pretrained arguments that from_pretrained sets itself
_SET_HERE = ("config", "key_mapping", "experts_implementation", "quantization_config", "device_map",
             "output_loading_info", "ignore_mismatched_sizes")
# from_pretrained arguments that the config's own loading takes too, and the model's still needs
_ALSO_FOR_THE_MODEL = ("attn_implementation", "cache_dir", "force_download", "proxies", "token", "revision",
                       "local_files_only", "subfolder")


@contextlib.contextmanager
def _expert_weights_left_empty():
    """While active, supported experts modules register empty gate_up_proj / down_proj parameters."""
    def hook(module, name, param):
        if name in hf_experts.RELEASED and type(module).__name__ in hf_experts.SUPPORTED_EXPERTS:
            return hf_experts.empty_parameter(param.dtype)
        return None
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _mixed_formats(folder, loader):
    """The ValueError for a checkpoint whose layers hold their experts in different formats."""
    first_layer_of = {}
    for layer in loader.moe_layers():
        first_layer_of.setdefault(loader.layer_format(layer), layer)
    if set(first_layer_of) <= set(_FP8_FORMATS):
        what = "mixes FP8 per-channel and block-wise experts across layers"
    else:
        what = "mixes expert formats across layers"
    examples = ", ".join(f"layer {layer} {fmt}" for fmt, layer in first_layer_of.items())
    return ValueError(f"{folder}: {what} ({examples}); ktfp8.hf loads checkpoints with one FP8 format in "
                      f"every layer (convert the BF16 model with `python -m ktfp8.convert`)")


def _check_folder(path):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a model folder (str or os.PathLike), got {type(path).__name__}")
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such model folder")
    loader = FP8SafeTensorLoader(folder)
    try:
        _check_experts_are_fp8(folder, loader)
    except BaseException:
        loader.close()              # not left to the exception's lifetime
        raise
    return loader


def _check_experts_are_fp8(folder, loader):
    """Refuses a folder whose experts ktfp8.hf.from_pretrained cannot run as FP8."""
    fused = fused_experts_tensor(loader.checkpoint)
    if fused is not None:
        raise ValueError(f"{folder}: its routed experts are stored fused (e.g. {fused[0]!r} {fused[1]}); "
                         f"ktfp8.hf.from_pretrained loads FP8 folders of {PER_EXPERT_NAMES}: "
                         f"{CONVERT_SPLITS_FUSED}. Or load a BF16 checkpoint like this one with transformers' "
                         f"from_pretrained(path, experts_implementation='ktfp8') after `import ktfp8.hf` (its "
                         f"experts are quantized on load)")
    if not loader.moe_layers():
        raise ValueError(f"{folder}: holds no routed experts (no ...experts.<e>.gate_proj.weight tensors); "
                         f"ktfp8.hf.from_pretrained loads MoE models whose experts are FP8, and a model "
                         f"without experts needs no ktfp8")
    if loader.format == "mixed":
        raise _mixed_formats(folder, loader)
    if loader.format not in _FP8_FORMATS:
        raise ValueError(f"{folder}: experts are {loader.format!r}, not FP8; load a BF16 folder with "
                         f"AutoModelForCausalLM.from_pretrained(path, experts_implementation='ktfp8') after "
                         f"`import ktfp8.hf`, or convert it with `python -m ktfp8.convert`")
    others = [n for n in loader.checkpoint.names()
              if EXPERT_RE.match(n) is None and loader.checkpoint.info(n).dtype == "F8_E4M3"]
    if others:
        raise ValueError(f"{folder}: FP8 tensors outside the routed experts (e.g. {others[0]!r}); ktfp8.hf "
                         f"loads checkpoints whose experts only are FP8 (convert without --all-linear)")


def text_model_class(config):
    """The transformers Auto class that from_pretrained and `python -m ktfp8.generate` load the config's
    model with: AutoModelForCausalLM, or where transformers has no causal-LM class for the model type but an
    image-text-to-text one (Qwen3-VL-MoE; Mistral 4 in transformers 5.25), AutoModelForImageTextToText,
    whose models generate from text prompts too.  ValueError for a model type with neither."""
    import transformers
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    for mapping, auto in ((modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "AutoModelForCausalLM"),
                          (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "AutoModelForImageTextToText")):
        if model_type in mapping:
            return getattr(transformers, auto)
    raise ValueError(f"model type {model_type!r} has no transformers AutoModelForCausalLM or "
                     f"AutoModelForImageTextToText class, which ktfp8.hf.from_pretrained and python -m "
                     f"ktfp8.generate load models with; ktfp8.hf runs its experts when its own transformers "
                     f"class loads its BF16 checkpoint: from_pretrained(bf16_path, experts_implementation='ktfp8') "
                     f"after `import ktfp8.hf`, or ktfp8.hf.prepare(model)")


def _check_kwargs(kwargs):
    """Refuses the transformers from_pretrained arguments that ktfp8.hf sets itself."""
    if "torch_dtype" in kwargs:             # transformers would let dtype= win, silently here
        raise TypeError("ktfp8.hf.from_pretrained: torch_dtype= is transformers' older name of dtype=; "
                        "pass dtype=torch.bfloat16 or dtype=torch.float32")
    for reserved in _SET_HERE:
        if reserved in kwargs:
            raise TypeError(f"ktfp8.hf.from_pretrained sets {reserved}= itself; do not pass it")


def from_pretrained(path, *, threads=None, dtype=torch.bfloat16, **kwargs):
    """The transformers model of a ktfp8-converted FP8 folder (per-channel or block-wise) as
    text_model_class loads it (a causal LM, else an image-text-to-text one), its experts run by ktfp8
    straight from the memory-mapped FP8 shards.

    threads: kernel threads of the MoE layers (default: KTFP8_NUM_THREADS, OMP_NUM_THREADS, all cores);
    dtype: of everything transformers holds (activations too): torch.bfloat16 or torch.float32;
    kwargs: passed on to that class's from_pretrained (e.g. attn_implementation), those naming config
    attributes (use_cache=False, output_router_logits=True) applied to the config, as transformers does."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    if dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype!r}")
    if threads is not None:
        requested_threads(threads)          # refused before the model loads; the layers apply it
    _check_kwargs(kwargs)
    with _check_folder(path) as loader:      # closed once every layer has packed its experts
        # transformers' from_pretrained applies such overrides only where it loads the config itself
        config, model_kwargs = AutoConfig.from_pretrained(path, return_unused_kwargs=True, **kwargs)
        model_kwargs.update((k, kwargs[k]) for k in _ALSO_FOR_THE_MODEL if k in kwargs)
        hf_experts.check_model_type(config)
        auto_class = text_model_class(config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config        # the experts are ours; the rest is not quantized
        quant_config = loader.quant_config

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()          # the report lists the experts we skip on purpose
        try:
            with _expert_weights_left_empty():
                # mismatched sizes come back in `info` (transformers' own error points at a report
                # that the verbosity above hides), and check_loading_info names them
                model, info = auto_class.from_pretrained(
                    path, config=config, dtype=dtype, key_mapping=_KEY_MAPPING, output_loading_info=True,
                    ignore_mismatched_sizes=True, experts_implementation=hf_experts.implementation_name(quant_config),
                    **model_kwargs)
        finally:
            hf_logging.set_verbosity(verbosity)
        check_loading_info(path, model, info, released=hf_experts.RELEASED)

        _attach_experts(model, loader, quant_config, threads, path)
        return model


def check_loading_info(path, model, info, released=()):
    """ValueError naming what of a checkpoint does not fit `model` (its config.json), from transformers'
    output_loading_info: weights the checkpoint lacks (transformers would fill them with random values
    and go on), or holds with another shape; `released`: the names of parameters ktfp8 leaves out."""
    missing = sorted(k for k in info["missing_keys"] if k.rpartition(".")[2] not in released)
    mismatched = sorted(info["mismatched_keys"])
    if not (missing or mismatched):
        return
    found = []
    if mismatched:
        key, held, wanted = mismatched[0]
        found.append(f"{len(mismatched)} weight(s) of another shape than config.json gives, e.g. {key} "
                     f"{tuple(held)} in the checkpoint, {tuple(wanted)} in {type(model).__name__}")
    if missing:
        found.append(f"{len(missing)} of the model's weight(s) missing, e.g. {missing[0]}")
    raise ValueError(f"{path}: the checkpoint does not fit its config.json: " + "; ".join(found))


def _attach_experts(model, loader, quant_config, threads, path):
    """Each experts module of `model` runs its layer's experts from `loader`, packed for this CPU."""
    for name, module, block in hf_experts.experts_modules(model):
        hf_experts.check_supported(module)
        m = _LAYER_RE.search(name)
        if m is None or int(m[1]) not in loader.moe_layers():
            raise ValueError(f"{path}: no expert tensors for {name} (the checkpoint has experts in layers "
                             f"{loader.moe_layers()})")
        layer = int(m[1])
        held = loader.expert_count(layer)
        if held < module.num_experts:   # (more: the layer's own check names config.json's count)
            raise ValueError(f"{path}: {name} has {module.num_experts} experts by config.json, the checkpoint "
                             f"holds experts 0-{held - 1} of layer {layer}")
        top_k = hf_experts.layer_top_k(module, block)      # per layer where config.json lists them (Hunyuan)
        config_of_layer = hf_experts.layer_config(module, quant_config, top_k, threads)
        experts = loader.load_experts(layer, experts=local_experts(module.num_experts))
        hf_experts.attach(module, build_layer(config_of_layer, experts, threads=threads), quant_config,
                          source=os.fspath(path))
        loader.release_experts(layer)      # packed: one layer's codes mapped at a time, not all of them
