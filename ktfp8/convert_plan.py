"""What `python -m ktfp8.convert` writes: which tensors are quantized, output names, dtypes and shapes,
their order and shards, and the config.json `quantization_config`.  Pure bookkeeping, no tensor data."""
import math
import re
from collections import Counter
from dataclasses import dataclass, replace

from .config import _EXPERT_COUNT_KEYS, _EXPERT_HIDDEN_KEYS, _EXPERT_INTERMEDIATE_KEYS, _read_hf_config
from .convert_fused import config_size, fused_items
from .convert_items import INPUT_DTYPES, Item, quantizable_dtype, scale_shape
from .loader import EXPERT_RE, EXPERTS_PARENT, ROLE, ROLES, SCALE_DTYPES, block_size_of, stacks_by_prefix
from .safetensors_io import SafetensorsError, tensor_nbytes

# a name inside a numbered layer, and what comes before 'layers.<n>.' (its root: a VLM's text decoder and
# vision encoder differ there, e.g. model.language_model. and model.vision_model.encoder.)
_DECODER_LAYER = re.compile(r"^(?P<root>(?:.*\.)?)layers\.\d+\.")
_EXPERTS_LAYER = re.compile(rf"^(?P<root>(?:.*\.)?)layers\.\d+\.{EXPERTS_PARENT}experts\.")
_ROUTERS = ("gate", "router", "shared_expert_gate")
_HEADS = ("lm_head", "head")
_EMBEDDINGS = ("wte", "wpe", "word_embeddings")


@dataclass
class Plan:
    items: list           # Item, in output order
    shards: list          # [[output tensor name, ...] per shard]
    specs: dict           # output tensor name -> (dtype, shape)
    ignore: list          # Linear modules left unquantized
    quantization_config: dict

    @property
    def quantized(self):
        return [i for i in self.items if i.action != "copy"]


def _module(name):
    return name[: -len(".weight")]


def is_linear_weight(name, info):
    """A 2-D `.weight` that is not an embedding: what a Linear layer stores."""
    if not name.endswith(".weight") or len(info.shape) != 2:
        return False
    last = _module(name).rsplit(".", 1)[-1]
    return "embed" not in last and last not in _EMBEDDINGS


def _decoder_roots(names):
    """The roots (see _DECODER_LAYER) of the layers that hold routed experts, per expert or fused: the
    decoder's.  None where no layer does (a dense model): every numbered layer's root then."""
    roots = {m["root"] for m in map(_EXPERTS_LAYER.match, names) if m}
    return roots or None


def _all_linear_target(name, roots):
    """--all-linear quantizes decoder-layer Linears (layers under one of `roots`: not a vision or audio
    encoder's) except routers (kept precise, and engines expect them unquantized; Hunyuan-A13B's is the
    Linear `wg` inside `mlp.gate`) and output heads."""
    layer = _DECODER_LAYER.match(name)
    parts = _module(name).rsplit(".", 2)[-2:]
    return (layer is not None and (roots is None or layer["root"] in roots)
            and not any(p in _ROUTERS for p in parts) and parts[-1] not in _HEADS)


def _quantized_item(action, name, info, spec, **extra):
    scale_name = name + ("_scale" if spec.per_channel else "_scale_inv")
    return Item(action, name, name, "F8_E4M3", info.shape, out_scale=scale_name,
                scale_shape=scale_shape(info.shape, spec), **extra)


def _classify(checkpoint, input_type, spec, all_linear, hf_config, fused):
    """Items in input order, but for the `fused` expert stacks (split by fused_items); input
    weight_scale_inv tensors are consumed by their weight's item."""
    items, consumed = [], set()
    in_block = block_size_of(hf_config) if input_type == "fp8" else None
    roots = _decoder_roots(checkpoint.names()) if all_linear else None
    for name in checkpoint.names():
        if name in fused:
            continue
        info = checkpoint.info(name)
        if info.dtype == "F8_E4M3" and name.endswith(".weight"):
            items.append(_fp8_item(checkpoint, name, info, input_type, spec, in_block, consumed))
            continue
        expert = EXPERT_RE.match(name)
        wanted = (expert is not None and expert["kind"] == "weight") or \
            (all_linear and is_linear_weight(name, info) and _all_linear_target(name, roots))
        if not wanted:
            items.append(Item("copy", name, name, info.dtype, info.shape))
            continue
        if not quantizable_dtype(info.dtype, input_type):
            raise SafetensorsError(f"tensor {name!r} is {info.dtype}, but --input-type {input_type} "
                                   f"expects {INPUT_DTYPES[input_type]} weights")
        _check_matrix(name, info.shape)
        _check_unscaled(checkpoint, name, info)
        items.append(_quantized_item("quantize", name, info, spec))
    weights = {i.src for i in items if i.action == "copy" and i.out_dtype == "F8_E4M3"
               and i.src.endswith(".weight")}    # FP8 weights already in the target format, copied with their scales
    scales = {name + "_scale_inv" for name in weights}
    return [replace(i, check_scale=i.src in scales, check_codes=i.src in weights)
            for i in items if i.src not in consumed]


def _check_matrix(name, shape):
    """A weight to quantize is a Linear's: 2-D, and not empty (a row of no weights has no scale)."""
    if len(shape) != 2:
        raise SafetensorsError(f"tensor {name!r} has shape {list(shape)}; a Linear weight is 2-D")
    if 0 in shape:
        raise SafetensorsError(f"tensor {name!r} has shape {list(shape)}; an empty weight has nothing to quantize")


def _check_unscaled(checkpoint, name, info):
    """A float weight to quantize has no scale beside it: one there is stale, and would be written beside
    the new scale (a weight_scale_inv makes a loader read the weight as block-wise FP8)."""
    for scale in (name + "_scale", name + "_scale_inv"):
        if scale in checkpoint:
            raise SafetensorsError(f"tensor {scale!r} scales {name!r}, which is {info.dtype}, not F8_E4M3: a "
                                   f"scale beside a float weight is stale; remove it from the input")


def _fp8_item(checkpoint, name, info, input_type, spec, in_block, consumed):
    if input_type != "fp8":
        raise SafetensorsError(f"tensor {name!r} is already F8_E4M3; use --input-type fp8 for a "
                               f"block-wise FP8 checkpoint")
    _check_matrix(name, info.shape)
    scale_name = name + "_scale_inv"
    if scale_name not in checkpoint:
        other = "a weight_scale (per-channel or per-tensor: ktfp8 loads it as it is)" \
            if name + "_scale" in checkpoint else "no weight_scale_inv"
        raise SafetensorsError(f"tensor {name!r} is F8_E4M3 with {other}; --input-type fp8 reads "
                               f"block-wise FP8 (weight + weight_scale_inv)")
    if name + "_scale" in checkpoint:
        raise SafetensorsError(f"tensor {name!r} has both a weight_scale_inv and a weight_scale "
                               f"({name + '_scale'!r}): one of them is stale; remove it from the input")
    scale = checkpoint.info(scale_name)
    expected = (math.ceil(info.shape[0] / in_block[0]), math.ceil(info.shape[1] / in_block[1]))
    if scale.shape != expected or scale.dtype not in SCALE_DTYPES:
        raise SafetensorsError(f"tensor {scale_name!r} is {scale.dtype} {list(scale.shape)}; weight_block_size "
                               f"{list(in_block)} needs F32 {list(expected)} for weight "
                               f"{list(info.shape)}")
    if not spec.per_channel and spec.block == in_block:     # already the target format: keep it bit-exact
        return Item("copy", name, name, info.dtype, info.shape)
    consumed.add(scale_name)
    return _quantized_item("requantize", name, info, spec, src_scale=scale_name, src_block=in_block)


def _check_experts(checkpoint, hf_config):
    """Refuses routed experts that no engine can load, before anything is written.  In each expert stack
    (e.g. model.layers.3.mlp.experts): experts 0 .. E-1, E from config.json (else the highest index + 1),
    each with gate, up and down weights; gate and up [intermediate, hidden], down [hidden, intermediate],
    sizes from config.json (the keys from_hf_config reads: _EXPERT_INTERMEDIATE_KEYS, _EXPERT_HIDDEN_KEYS),
    else those most experts of the stack have.  Shared experts, dense MLPs and other tensors are not
    routed experts and keep whatever shape they have.  Runs after _classify, which refused expert weights
    that are not 2-D."""
    config = _read_hf_config(hf_config)       # a multimodal config: its text_config
    count_key, count = config_size(config, *_EXPERT_COUNT_KEYS)
    sizes = {"intermediate": config_size(config, *_EXPERT_INTERMEDIATE_KEYS),
             "hidden": config_size(config, *_EXPERT_HIDDEN_KEYS)}
    for prefix, stack in stacks_by_prefix(checkpoint.names()).items():
        names = {(e, role): name for (role, kind), experts in stack.tensors.items() if kind == "weight"
                 for e, name in experts.items()}          # (expert, role) -> weight tensor name
        if not names:
            continue
        mixtral = any(EXPERT_RE.match(n)["proj"][0] == "w" for n in names.values())
        proj = {ROLE[p]: p for p in ROLE if (p[0] == "w") == mixtral}      # role -> w1 or gate_proj, ...
        highest = max(e for e, _ in names)
        if count is not None and highest >= count:
            name = next(names[highest, r] for r in ROLES if (highest, r) in names)
            raise SafetensorsError(f"tensor {name!r}: expert index {highest} is out of range (config.json: "
                                   f"{count_key} {count}, experts 0-{count - 1})")
        experts = range(highest + 1 if count is None else count)
        source = f"config.json: {count_key} {count}" if count is not None else \
            f"the highest index found is {highest}"
        for e in experts:
            for role in ROLES:
                if (e, role) not in names:
                    raise SafetensorsError(f"expert tensor '{prefix}.{e}.{proj[role]}.weight' is missing: "
                                           f"{prefix} needs experts 0-{experts.stop - 1} ({source}), each "
                                           f"with gate, up and down weights")
        shapes = {key: checkpoint.info(n).shape for key, n in names.items()}
        seen = Counter(shape[::-1] if role == "down" else shape for (_, role), shape in shapes.items())
        common = seen.most_common(1)[0][0]         # [intermediate, hidden] of most experts
        want = {dim: (value, key) if key else (common[i], None)
                for i, (dim, (key, value)) in enumerate(sizes.items())}
        for e in experts:
            for role in ROLES:
                dims = ("hidden", "intermediate") if role == "down" else ("intermediate", "hidden")
                expected = tuple(want[d][0] for d in dims)
                if shapes[e, role] != expected:
                    known = [f"{want[d][1]} {want[d][0]}" for d in dims if want[d][1]]
                    why = [f"config.json: {', '.join(known)}"] if known else []
                    why += [f"as most experts of {prefix}"] if len(known) < 2 else []
                    raise SafetensorsError(f"tensor {names[e, role]!r} has shape {list(shapes[e, role])}; "
                                           f"expected [{', '.join(dims)}] = {list(expected)} "
                                           f"({'; '.join(why)})")


def _sort_key(name):
    """Natural order, with each layer's experts grouped per projection (gate weights of all experts,
    then their scales, ...), so a loader can map a whole stack with one view."""
    m = EXPERT_RE.match(name)
    if m:
        name = f"{m['stack']}.{m['proj']}.{m['kind']}.{m['expert']}"
    return natural_key(name)


def natural_key(name):
    """`name` in natural order ("layers.2" before "layers.10"): its runs of ASCII digits as ints.  The
    split leaves them at the odd places, so two keys compare an int with an int (str.isdigit would also
    take a superscript two, which int() refuses)."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"([0-9]+)", name))]


def _units(items):
    """Runs of output tensors to keep in one shard when they fit: an expert stack of one projection
    and kind (weights, or scales), or one tensor."""
    units, current, current_key = [], [], None
    for name, dtype, shape in sorted((s for item in items for s in item.outputs()),
                                     key=lambda s: _sort_key(s[0])):
        m = EXPERT_RE.match(name)
        key = (m["stack"], m["proj"], m["kind"]) if m else None
        if key is None or key != current_key:
            if current:
                units.append(current)
            current = []
        current.append((name, dtype, shape))
        current_key = key
    if current:
        units.append(current)
    return units


def _assign_shards(units, max_bytes):
    shards, current, size = [], [], 0

    def close():
        nonlocal current, size
        if current:
            shards.append(current)
        current, size = [], 0

    for unit in units:
        unit_bytes = sum(tensor_nbytes(d, s) for _, d, s in unit)
        if size + unit_bytes > max_bytes:
            close()
        for name, dtype, shape in unit:       # a unit larger than a shard is split between tensors
            nbytes = tensor_nbytes(dtype, shape)
            if current and size + nbytes > max_bytes:
                close()
            current.append(name)
            size += nbytes
    close()
    return shards or [[]]


def quantization_config(spec, ignore):
    """config.json `quantization_config`: compressed-tensors float-quantized channel-wise weights, or
    the DeepSeek-V3 block-wise FP8 form (`ignored_layers` is read by vLLM and by transformers)."""
    if not spec.per_channel:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(spec.block), "ignored_layers": ignore}
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None}


def build_plan(checkpoint, input_type, spec, all_linear, max_shard_bytes):
    hf_config = checkpoint.hf_config() or {}
    fused = fused_items(checkpoint, input_type, spec, all_linear, hf_config)
    items = _classify(checkpoint, input_type, spec, all_linear, hf_config, {i.src for i in fused}) + fused
    _check_experts(checkpoint, hf_config)
    if input_type == "fp8" and not any(i.src_scale or i.out_dtype == "F8_E4M3" and i.action == "copy"
                                       for i in items):
        raise SafetensorsError(f"{checkpoint.folder}: --input-type fp8, but no F8_E4M3 weights with "
                               f"weight_scale_inv were found")
    if not any(i.out_dtype == "F8_E4M3" for i in items):
        raise SafetensorsError(f"{checkpoint.folder}: found no weights to quantize (no expert projections"
                               f"{'' if all_linear else '; --all-linear selects every Linear'})")
    items.sort(key=lambda i: _sort_key(i.out))
    specs = {name: (dtype, shape) for item in items for name, dtype, shape in item.outputs()}
    quantized = {_module(i.out) for i in items if i.out_dtype == "F8_E4M3"}
    # a BF16 output head is never quantized; a tied one (tie_word_embeddings) has no tensor of its own, but
    # is a Linear all the same, which a loader that finds it missing from `ignore` quantizes (with no
    # scale).  An FP8 input's FP8 head is requantized as its other FP8 weights are, and so not listed.
    copied = {_module(i.out) for i in items if i.action == "copy" and is_linear_weight(i.out, checkpoint.info(i.src))}
    ignore = sorted((copied | {"lm_head"}) - quantized, key=_sort_key)
    shards = _assign_shards(_units(items), max_shard_bytes)
    return Plan(items, shards, specs, ignore, quantization_config(spec, ignore))
