"""The converter's reading of a layer's routed experts fused in one 3-D tensor (gate_up_proj, down_proj;
see loader.FUSED_LAYOUTS): which model types it knows, the shapes it checks, and one Item per expert
weight.  The sizes come from config.json where it gives them (config_size, which the plan's expert
checks use too)."""
from .config import _EXPERT_COUNT_KEYS, _EXPERT_HIDDEN_KEYS, _EXPERT_INTERMEDIATE_KEYS, _one_value, _read_hf_config
from .convert_items import INPUT_DTYPES, FusedPart, Item, quantizable_dtype, scale_shape
from .loader import (FUSED_LAYOUTS, FUSED_MODEL_TYPES, FUSED_STACK_RE, PER_EXPERT_NAMES, _is_positive_int,
                     fused_expert_names, stacks_by_prefix)
from .safetensors_io import SafetensorsError


def config_size(config, *keys):
    """(key, value) of the first of `keys` that config.json sets, or (None, None) where it sets none of
    them or not as one positive integer; a per-layer list holding one value (Hunyuan-A13B's
    moe_intermediate_size) is that value, one whose values differ is none."""
    key = next((k for k in keys if config.get(k) is not None), None)
    value = _one_value(config.get(key))
    return (key, value) if key and _is_positive_int(value) else (None, None)


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
    first = min(fused_names)
    raise SafetensorsError(f"{checkpoint.folder}: tensor {first!r} {list(checkpoint.info(first).shape)} holds a "
                           f"layer's routed experts fused in one 3-D tensor, whose layout python -m ktfp8.convert "
                           f"does not know for model type {' / '.join(types) or '(none given)'}: it splits the "
                           f"fused experts of {FUSED_MODEL_TYPES} checkpoints, and otherwise reads "
                           f"{PER_EXPERT_NAMES}{also}. "
                           f"A BF16 checkpoint like this one is quantized on load instead: transformers' "
                           f"from_pretrained(path, experts_implementation=\"ktfp8\") after `import ktfp8.hf`")


def fused_items(checkpoint, input_type, spec, all_linear, hf_config):
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
                                   f"mlp.experts or experts (...layers.<n>.mlp.experts.gate_up_proj, "
                                   f"...layers.<n>.experts.gate_up_proj); python -m ktfp8.convert has no "
                                   f"per-expert names for them")
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
        key, given = config_size(config, *keys)
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
        if not quantizable_dtype(info.dtype, input_type):
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
                              scale_shape=scale_shape(shape, spec), fused=FusedPart(e, first, transposed)))
    return items
