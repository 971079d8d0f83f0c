"""What `python -m ktfp8.convert` writes: which tensors are quantized, output names, dtypes and shapes,
their order and shards, and the config.json `quantization_config`.  Pure bookkeeping, no tensor data."""
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from .config import (_EXPERT_COUNT_KEYS, _EXPERT_HIDDEN_KEYS, _EXPERT_INTERMEDIATE_KEYS, MAX_BLOCK_EDGE,
                     ODD_BLOCK_EDGE, _one_value, _read_hf_config)
from .loader import (EXPERT_RE, FUSED_LAYOUTS, FUSED_STACK_RE, PER_EXPERT_NAMES, ROLE, ROLES, _is_positive_int,
                     block_size_of, fused_expert_names, stacks_by_prefix)
from .safetensors_io import SafetensorsError, tensor_nbytes

INPUT_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32", "fp8": "F8_E4M3"}
FLOAT_DTYPES = ("BF16", "F16", "F32")
SCALE_DTYPES = ("F32", "BF16", "F16")
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
_ROUTERS = ("gate", "router", "shared_expert_gate")
_HEADS = ("lm_head", "head")
_EMBEDDINGS = ("wte", "wpe", "word_embeddings")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class QuantSpec:
    """Target format: per-channel (block None) or block-wise with block = (block_n, block_k)."""
    per_channel: bool
    block: Optional[Tuple[int, int]] = None


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    """json object_pairs_hook: a key given twice is refused (json.loads would keep the last one silently,
    e.g. per_channel true then false), as the safetensors header parser refuses it."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_quant_config(text):
    """--quant-config JSON -> QuantSpec.  Keys: method ("FP8"), per_channel (bool, default true),
    group_size (per-channel: 0 or absent; block-wise: the block edge, default 128)."""
    try:
        raw = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ValueError(f"--quant-config: duplicate key {e.args[0]!r}; give each key once: {text!r}") from None
    except (ValueError, RecursionError) as e:      # RecursionError: nested thousands deep
        raise ValueError(f"--quant-config is not valid JSON ({e}): {text!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--quant-config must be a JSON object, got {text!r}")
    unknown = set(raw) - {"method", "per_channel", "group_size"}
    if unknown:
        raise ValueError(f"--quant-config: unknown keys {sorted(unknown)}; allowed: method, per_channel, "
                         f"group_size")
    if raw.get("method", "FP8") != "FP8":
        raise ValueError(f"--quant-config: method must be \"FP8\", got {raw.get('method')!r}")
    per_channel = raw.get("per_channel", True)
    if not isinstance(per_channel, bool):
        raise ValueError(f"--quant-config: per_channel must be true or false, got {per_channel!r}")
    group = raw.get("group_size", 0 if per_channel else 128)
    if isinstance(group, bool) or not isinstance(group, int):
        raise ValueError(f"--quant-config: group_size must be an integer, got {group!r}")
    if per_channel:
        if group != 0:
            raise ValueError(f"--quant-config: per_channel needs group_size 0 (one scale per row), got {group}")
        return QuantSpec(True)
    if group <= 0:
        raise ValueError(f"--quant-config: block-wise (per_channel false) needs group_size > 0, got {group}")
    if group > MAX_BLOCK_EDGE:
        raise ValueError(f"--quant-config: group_size must be at most {MAX_BLOCK_EDGE} (the kernels' block edges "
                         f"are 32-bit), got {group}")
    if group % 2:
        raise ValueError(f"--quant-config: group_size must be even, got {group}: {ODD_BLOCK_EDGE}")
    return QuantSpec(False, (group, group))


def parse_size(text):
    """'5GB', '500MB', '2GiB', '1000' -> bytes (decimal units like Hugging Face; KiB/MiB/GiB binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m and m[2].upper()
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"size {text!r} is not like 5GB, 500MB, 2GiB or a byte count")
    size = int(float(m[1]) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


@dataclass(frozen=True)
class Item:
    """One input tensor and what becomes of it.  action: "copy" (bytes unchanged), "quantize" (float ->
    FP8), "requantize" (block FP8 + weight_scale_inv -> FP8 of the target format)."""
    action: str
    src: str
    out: str
    out_dtype: str
    shape: Tuple[int, ...]
    src_scale: Optional[str] = None          # weight_scale_inv of a block-wise FP8 input
    src_block: Optional[Tuple[int, int]] = None
    out_scale: Optional[str] = None          # weight_scale (per-channel) or weight_scale_inv (block-wise)
    scale_shape: Tuple[int, ...] = ()
    fused: Optional["FusedPart"] = None      # src holds a layer's experts fused: which part is this weight
    check_scale: bool = False                # a copied weight_scale_inv: refused where the loader refuses it

    def outputs(self):
        specs = [(self.out, self.out_dtype, self.shape)]
        if self.out_scale:
            specs.append((self.out_scale, "F32", self.scale_shape))
        return specs


@dataclass(frozen=True)
class FusedPart:
    """Where one expert's [out, in] weight lies in a fused stack (gate_up_proj or down_proj): expert
    `expert`'s rows first .. first + out of its matrix, or with `transposed` its columns (the matrix is
    stored [in, out])."""
    expert: int
    first: int
    transposed: bool


def input_nbytes(item, checkpoint):
    """Bytes of the input that `item` converts: its part of a fused stack, else the whole tensor."""
    info = checkpoint.info(item.src)
    return tensor_nbytes(info.dtype, item.shape) if item.fused else info.nbytes


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


def _all_linear_target(name):
    """--all-linear quantizes decoder-layer Linears except routers (kept precise, and engines expect
    them unquantized) and output heads."""
    last = _module(name).rsplit(".", 1)[-1]
    return bool(_DECODER_LAYER.search(name)) and last not in _ROUTERS and last not in _HEADS


def _scale_shape(shape, spec):
    out, inn = shape
    if spec.per_channel:
        return (out, 1)
    return (math.ceil(out / spec.block[0]), math.ceil(inn / spec.block[1]))


def _quantized_item(action, name, info, spec, **extra):
    scale_name = name + ("_scale" if spec.per_channel else "_scale_inv")
    return Item(action, name, name, "F8_E4M3", info.shape, out_scale=scale_name,
                scale_shape=_scale_shape(info.shape, spec), **extra)


def _classify(checkpoint, input_type, spec, all_linear, hf_config, fused):
    """Items in input order, but for the `fused` expert stacks (split by _fused_items); input
    weight_scale_inv tensors are consumed by their weight's item."""
    items, consumed = [], set()
    in_block = block_size_of(hf_config) if input_type == "fp8" else None
    for name in checkpoint.names():
        if name in fused:
            continue
        info = checkpoint.info(name)
        if info.dtype == "F8_E4M3" and name.endswith(".weight"):
            items.append(_fp8_item(checkpoint, name, info, input_type, spec, in_block, consumed))
            continue
        expert = EXPERT_RE.match(name)
        wanted = (expert is not None and expert["kind"] == "weight") or \
            (all_linear and is_linear_weight(name, info) and _all_linear_target(name))
        if not wanted:
            items.append(Item("copy", name, name, info.dtype, info.shape))
            continue
        if not _quantizable_dtype(info.dtype, input_type):
            raise SafetensorsError(f"tensor {name!r} is {info.dtype}, but --input-type {input_type} "
                                   f"expects {INPUT_DTYPES[input_type]} weights")
        _check_matrix(name, info.shape)
        items.append(_quantized_item("quantize", name, info, spec))
    kept = {i.src + "_scale_inv" for i in items if i.action == "copy" and i.out_dtype == "F8_E4M3"
            and i.src.endswith(".weight")}       # FP8 weights already in the target format, copied with their scales
    return [replace(i, check_scale=True) if i.src in kept else i for i in items if i.src not in consumed]


def _quantizable_dtype(dtype, input_type):
    """Whether a weight of `dtype` may be quantized under --input-type: the float type it names, or under
    --input-type fp8 any float type."""
    return dtype in FLOAT_DTYPES and (input_type == "fp8" or dtype == INPUT_DTYPES[input_type])


def _check_matrix(name, shape):
    """A weight to quantize is a Linear's: 2-D, and not empty (a row of no weights has no scale)."""
    if len(shape) != 2:
        raise SafetensorsError(f"tensor {name!r} has shape {list(shape)}; a Linear weight is 2-D")
    if 0 in shape:
        raise SafetensorsError(f"tensor {name!r} has shape {list(shape)}; an empty weight has nothing to quantize")


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


def _config_size(config, *keys):
    """(key, value) of the first of `keys` that config.json sets, or (None, None) where it sets none of
    them or not as one positive integer; a per-layer list holding one value (Hunyuan-A13B's
    moe_intermediate_size) is that value, one whose values differ is none."""
    key = next((k for k in keys if config.get(k) is not None), None)
    value = _one_value(config.get(key))
    return (key, value) if key and _is_positive_int(value) else (None, None)


def _check_experts(checkpoint, hf_config):
    """Refuses routed experts that no engine can load, before anything is written.  In each expert stack
    (e.g. model.layers.3.mlp.experts): experts 0 .. E-1, E from config.json (else the highest index + 1),
    each with gate, up and down weights; gate and up [intermediate, hidden], down [hidden, intermediate],
    sizes from config.json (the keys from_hf_config reads: _EXPERT_INTERMEDIATE_KEYS, _EXPERT_HIDDEN_KEYS),
    else those most experts of the stack have.  Shared experts, dense MLPs and other tensors are not
    routed experts and keep whatever shape they have.  Runs after _classify, which refused expert weights
    that are not 2-D."""
    config = _read_hf_config(hf_config)       # a multimodal config: its text_config
    count_key, count = _config_size(config, *_EXPERT_COUNT_KEYS)
    sizes = {"intermediate": _config_size(config, *_EXPERT_INTERMEDIATE_KEYS),
             "hidden": _config_size(config, *_EXPERT_HIDDEN_KEYS)}
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
                                           f"{prefix} needs experts 0-{len(experts) - 1} ({source}), each "
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
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


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


def _fused_layouts(checkpoint, hf_config, fused_names, all_linear):
    """The layouts (stored transposed or not) the checkpoint's fused experts (fused_names) may have;
    refuses a model type whose layout is not known (with --all-linear too, which would leave them, most
    of the weights, unquantized)."""
    types = list(dict.fromkeys(t for t in (hf_config.get("model_type"), _read_hf_config(hf_config).get("model_type"))
                               if t))   # the model's and its text model's, once each
    for t in types:
        if t in FUSED_LAYOUTS:
            return FUSED_LAYOUTS[t]
    also = "; refused with --all-linear too, which would leave them, most of the weights, unquantized" \
        if all_linear else ""
    known = " and ".join(t for t in FUSED_LAYOUTS if not t.endswith("_text"))
    first = min(fused_names)
    raise SafetensorsError(f"{checkpoint.folder}: tensor {first!r} {list(checkpoint.info(first).shape)} holds a "
                           f"layer's routed experts fused in one 3-D tensor, whose layout python -m ktfp8.convert "
                           f"does not know for model type {' / '.join(types) or '(none given)'}: it splits the "
                           f"fused experts of {known} checkpoints, and otherwise reads {PER_EXPERT_NAMES}{also}. "
                           f"A BF16 checkpoint like this one is quantized on load instead: transformers' "
                           f"from_pretrained(path, experts_implementation=\"ktfp8\") after `import ktfp8.hf`")


def _fused_items(checkpoint, input_type, spec, all_linear, hf_config):
    """The per-expert FP8 weights of every fused expert stack (see FUSED_LAYOUTS), in no order."""
    names = fused_expert_names(checkpoint)
    if not names:
        return []
    layouts = _fused_layouts(checkpoint, hf_config, names, all_linear)
    stacks = {}
    for name in names:
        m = FUSED_STACK_RE.match(name)
        if m is None:
            raise SafetensorsError(f"tensor {name!r} holds routed experts fused outside a decoder layer's "
                                   f"mlp.experts (...layers.<n>.mlp.experts.gate_up_proj); python -m "
                                   f"ktfp8.convert has no per-expert names for them")
        stacks.setdefault(m["stack"], {})[m["part"]] = name
    per_expert = stacks_by_prefix(checkpoint.names())
    items = []
    for stack, parts in stacks.items():
        for part in ("gate_up_proj", "down_proj"):
            if part not in parts:
                other = next(iter(parts.values()))
                raise SafetensorsError(f"tensor {other!r} holds routed experts fused, but '{stack}.{part}' "
                                       f"is missing")
        if stack in per_expert:
            raise SafetensorsError(f"{stack} holds its routed experts twice: fused ({parts['gate_up_proj']!r}) "
                                   f"and per expert; python -m ktfp8.convert reads one or the other")
        items += _split_stack(checkpoint, stack, parts, layouts, input_type, spec, hf_config)
    return items


def _fused_sizes(stack_shapes, transposed, config):
    """((E, H, I), why) of a fused stack read as `transposed` or not: config.json's sizes where it gives
    them, else those gate_up_proj's shape holds; why says where they come from."""
    gate_up = stack_shapes["gate_up_proj"]
    held = (gate_up[0], gate_up[1 if transposed else 2], gate_up[2 if transposed else 1] // 2)
    sizes, why = [], []
    for keys, value in zip((_EXPERT_COUNT_KEYS, _EXPERT_HIDDEN_KEYS, _EXPERT_INTERMEDIATE_KEYS), held):
        key, given = _config_size(config, *keys)
        sizes.append(given if key else value)
        why += [f"{key} {given}"] if key else []
    return tuple(sizes), f"config.json: {', '.join(why)}" if why else "as gate_up_proj holds them"


def _fused_shapes(E, H, I, transposed):
    """{part: (shape, its dimensions in words)} of a fused stack of E experts [I, H] / [H, I]."""
    if transposed:
        return {"gate_up_proj": ((E, H, 2 * I), "[experts, hidden, 2 x intermediate]"),
                "down_proj": ((E, I, H), "[experts, intermediate, hidden]")}
    return {"gate_up_proj": ((E, 2 * I, H), "[experts, 2 x intermediate, hidden]"),
            "down_proj": ((E, H, I), "[experts, hidden, intermediate]")}


def _split_stack(checkpoint, stack, parts, layouts, input_type, spec, hf_config):
    """Items gate, up and down of each expert of one fused stack, after checking its dtypes and shapes
    against each of `layouts` (stored transposed or not; down_proj's shape tells them apart)."""
    infos = {part: checkpoint.info(name) for part, name in parts.items()}
    for part, info in infos.items():
        if not _quantizable_dtype(info.dtype, input_type):
            raise SafetensorsError(f"tensor {parts[part]!r} is {info.dtype}; python -m ktfp8.convert reads fused "
                                   f"experts as BF16, FP16 or FP32 weights matching --input-type ({input_type}: "
                                   f"{INPUT_DTYPES[input_type]})")
    config, shapes = _read_hf_config(hf_config), {part: tuple(info.shape) for part, info in infos.items()}
    tried = []
    for transposed in layouts:
        (E, H, I), why = _fused_sizes(shapes, transposed, config)
        want = _fused_shapes(E, H, I, transposed)
        wrong = next((part for part in ("gate_up_proj", "down_proj") if shapes[part] != want[part][0]), None)
        if wrong is None:
            break
        tried.append(f"{want[wrong][1]} = {list(want[wrong][0])} ({why})")
    else:
        raise SafetensorsError(f"tensor {parts[wrong]!r} has shape {list(shapes[wrong])}; expected "
                               f"{' or '.join(tried)}")
    if 0 in (H, I):
        raise SafetensorsError(f"tensor {parts['gate_up_proj']!r} has shape {list(shapes['gate_up_proj'])}; experts "
                               f"of no width have nothing to quantize")
    items = []
    for e in range(E):
        for proj, part, first, shape in (("gate_proj", "gate_up_proj", 0, (I, H)),
                                         ("up_proj", "gate_up_proj", I, (I, H)), ("down_proj", "down_proj", 0, (H, I))):
            out = f"{stack}.{e}.{proj}.weight"
            items.append(Item("quantize", parts[part], out, "F8_E4M3", shape,
                              out_scale=out + ("_scale" if spec.per_channel else "_scale_inv"),
                              scale_shape=_scale_shape(shape, spec), fused=FusedPart(e, first, transposed)))
    return items


def build_plan(checkpoint, input_type, spec, all_linear, max_shard_bytes):
    hf_config = checkpoint.hf_config() or {}
    fused = _fused_items(checkpoint, input_type, spec, all_linear, hf_config)
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
    ignore = sorted({_module(i.out) for i in items
                     if i.action == "copy" and is_linear_weight(i.out, checkpoint.info(i.src))} - quantized,
                    key=_sort_key)
    shards = _assign_shards(_units(items), max_shard_bytes)
    return Plan(items, shards, specs, ignore, quantization_config(spec, ignore))
