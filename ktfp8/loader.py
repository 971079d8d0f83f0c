"""FP8SafeTensorLoader: the routed experts of a Hugging Face checkpoint folder, memory-mapped.

Reads single-file and sharded (`model.safetensors.index.json`) folders, recognises expert naming of
DeepSeek/Qwen (`mlp.experts.{e}.{gate,up,down}_proj`) and Mixtral (`block_sparse_moe.experts.{e}.w1/w3/w2`)
under any prefix (`model.`, `model.language_model.`, ...), and the weight formats fp8_per_channel
(`weight_scale` [N] or [N, 1]; a per-tensor [] or [1] is every row's), fp8_block (`weight_scale_inv`),
bf16 / fp16 / fp32."""
import itertools
import json
import numbers
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import MoeConfig, QuantConfig, as_block
from .experts import MAX_SCALE, ExpertMatrices, ExpertWeights, check_expert_range
from .safetensors_io import SafetensorsError, SafetensorsFile

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# the module a decoder layer holds its routed experts in, with its dot: mlp (most families), block_sparse_moe
# (Mixtral's checkpoints and those copying them), feed_forward (Jamba), ffn (DeepSeek-V4), or none: the
# layer itself (Gemma 4, whose layer holds a dense mlp beside its experts)
EXPERTS_PARENT = r"(?:(?:mlp|block_sparse_moe|feed_forward|ffn)\.)?"
_EXPERT_STACK = rf"(?P<stack>(?:.*\.)?layers\.(?P<layer>\d+)\.{EXPERTS_PARENT}experts)"
EXPERT_RE = re.compile(
    rf"^{_EXPERT_STACK}\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"\.(?P<kind>weight|weight_scale|weight_scale_inv)$")
# transformers 5's own layout of a layer's routed experts, which the loader does not read: one 3-D tensor
# per projection pair, `...experts.gate_up_proj` ([E, 2I, H], or [E, H, 2I] as Qwen3-VL-MoE's checkpoints
# hold it) and `...experts.down_proj`, under any prefix; FUSED_STACK_RE: those of a decoder layer's experts
# stack, which python -m ktfp8.convert can name per expert
FUSED_EXPERTS_RE = re.compile(r"^(?:.*\.)?experts\.(?:gate_up_proj|down_proj)$")
FUSED_STACK_RE = re.compile(rf"^{_EXPERT_STACK}\.(?P<part>gate_up_proj|down_proj)$")
PER_EXPERT_NAMES = "per-expert tensors only (...experts.<e>.gate_proj.weight, up_proj, down_proj)"
# Model types whose fused experts python -m ktfp8.convert splits into per-expert weights -> the layouts
# they come in (stored transposed or not).  transformers' own layout (Mistral 4's checkpoints, and what
# transformers 5 saves): gate_up_proj [E, 2I, H], each expert's gate rows then its up rows, and down_proj
# [E, H, I]; so do LaraMini's, GraniteMoE-SWA's, HY-V4's, ZAYA's and Gemma 4's, whose checkpoints transformers 5.25
# loads with no weight conversion (their parameters' own layout).  Qwen3-VL-MoE's Hub checkpoints hold them
# transposed, [E, H, 2I] and [E, I, H].  Other model types are refused: a fused layout may interleave gate
# and up, or carry biases.
FUSED_LAYOUTS = {"mistral4": (False,), "qwen3_vl_moe": (True, False), "qwen3_vl_moe_text": (True, False),
                 "lara_mini": (False,), "granitemoe_swa": (False,), "hy_v4": (False,), "zaya": (False,),
                 "gemma4": (False,), "gemma4_text": (False,)}
FUSED_MODEL_TYPES = ", ".join(t for t in FUSED_LAYOUTS if not t.endswith("_text"))
CONVERT_SPLITS_FUSED = f"python -m ktfp8.convert writes them, also from the fused experts of {FUSED_MODEL_TYPES} " \
    "checkpoints"
ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
ROLES = ("gate", "up", "down")
FLOAT_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
SCALE_DTYPES = ("F32", "BF16", "F16")
DEFAULT_BLOCK = (128, 128)
BLOCK_FIELD = "quantization_config.weight_block_size"


class Checkpoint:
    """Tensor name -> (shard file, header entry) for a checkpoint folder; files open lazily, once."""

    def __init__(self, folder):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SafetensorsError(f"{self.folder}: not a directory (expected a Hugging Face model folder)")
        index = self.folder / INDEX_NAME
        self._files = {}
        if index.is_file():
            self.weight_map = _read_index(index)
        else:
            files = [self.folder / SINGLE_NAME] if (self.folder / SINGLE_NAME).is_file() else \
                sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise SafetensorsError(f"{self.folder}: no {INDEX_NAME} and no .safetensors files")
            self.weight_map = {}
            for path in files:
                for name in self.file(path.name).tensors:        # opened once: kept for the checks below
                    if name in self.weight_map:
                        raise SafetensorsError(f"{self.folder}: tensor {name!r} is in both "
                                               f"{self.weight_map[name]} and {path.name}")
                    self.weight_map[name] = path.name
        for name, file_name in self.weight_map.items():      # validates every header and entry now
            if name not in self.file(file_name):
                raise SafetensorsError(f"{self.folder / file_name}: tensor {name!r} is missing from this "
                                       f"shard (the index lists it there)")
        if index.is_file():
            self._add_unlisted()

    def _add_unlisted(self):
        """Tensors of the index's shards that the index does not list: transformers loads every tensor of
        each shard, so they are part of the model (the converter, going by the index alone, dropped them).
        A tensor in two shards stays where the index lists it, or in the first shard by name."""
        for file_name in sorted(set(self.weight_map.values())):
            for name in self.file(file_name).tensors:
                self.weight_map.setdefault(name, file_name)

    def file(self, file_name) -> SafetensorsFile:
        if self._files is None:
            raise ValueError(f"{self.folder}: checkpoint is closed")
        f = self._files.get(file_name)
        if f is None:
            f = self._files[file_name] = SafetensorsFile(self.folder / file_name)
        return f

    def names(self):
        return list(self.weight_map)

    def __contains__(self, name):
        return name in self.weight_map

    def file_of(self, name) -> SafetensorsFile:
        if name not in self.weight_map:
            raise SafetensorsError(f"{self.folder}: no tensor named {name!r} in this checkpoint")
        return self.file(self.weight_map[name])

    def info(self, name):
        return self.file_of(name).info(name)

    def hf_config(self):
        path = self.folder / "config.json"
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text())
        except (ValueError, RecursionError) as e:       # RecursionError: nested thousands deep
            raise SafetensorsError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise SafetensorsError(f"{path}: holds a JSON {type(config).__name__}, expected an object")
        return config

    def close(self):
        """Closes every shard; views handed out stay valid.  Reading more afterwards is a ValueError."""
        for f in (self._files or {}).values():
            f.close()
        self._files = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_index(path):
    try:
        index = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:           # RecursionError: nested thousands deep
        raise SafetensorsError(f"{path}: not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SafetensorsError(f"{path}: needs a 'weight_map' object mapping tensor names to file names")
    for file_name in set(weight_map.values()):
        if Path(file_name).name != file_name:
            raise SafetensorsError(f"{path}: shard name {file_name!r} must be a plain file name")
        if not (path.parent / file_name).is_file():
            raise SafetensorsError(f"{path.parent / file_name}: shard listed in {path.name} is missing")
    return weight_map


@dataclass
class ExpertStack:
    """The expert tensors of one layer: prefix (e.g. 'model.layers.3.mlp.experts'), layer (3) and
    tensors[(role, kind)] = {expert index: tensor name}, role in gate/up/down, kind weight/weight_scale/..."""
    prefix: str
    layer: int
    tensors: dict = field(default_factory=dict)

    def kinds(self):
        return {kind for _, kind in self.tensors}


def stacks_by_prefix(names):
    """{prefix: ExpertStack} for the routed-expert tensors among `names`, one stack per prefix (e.g.
    'model.layers.3.mlp.experts'); refuses a projection of one expert named twice."""
    stacks = {}
    for name in names:
        m = EXPERT_RE.match(name)
        if m is None:
            continue
        stack = stacks.setdefault(m["stack"], ExpertStack(m["stack"], int(m["layer"])))
        role, expert = ROLE[m["proj"]], int(m["expert"])
        other = stack.tensors.setdefault((role, m["kind"]), {}).setdefault(expert, name)
        if other != name:          # gate_proj and w1 (Mixtral's name) of one expert: which to load?
            first, second = sorted((other, name))
            raise SafetensorsError(f"tensors {first!r} and {second!r} are both expert {expert}'s {role} "
                                   f"{m['kind']}; a checkpoint names each projection once")
    return stacks


def expert_stacks(names):
    """{layer: ExpertStack} for the routed-expert tensors among `names`: the loader addresses experts by
    layer.  Where one layer number has experts under two roots (what comes before 'layers.<n>'), the
    root with more layers is the model's decoder: Qwen3-Next and Qwen3.5 checkpoints keep the experts of
    their multi-token-prediction block under 'mtp.layers.0', beside 'model.layers.0', and transformers
    leaves 'mtp.' out of the model too.  Two prefixes of one layer under roots of as many layers (or
    under one root) are refused: which to load is not clear."""
    stacks = list(stacks_by_prefix(names).values())
    root_layers = Counter(_root(s) for s in stacks)
    by_layer = {}
    for stack in stacks:
        by_layer.setdefault(stack.layer, []).append(stack)
    layers = {}
    for layer, candidates in by_layer.items():
        candidates.sort(key=lambda s: (-root_layers[_root(s)], s.prefix))
        if len(candidates) > 1 and root_layers[_root(candidates[0])] == root_layers[_root(candidates[1])]:
            first, second = sorted(s.prefix for s in candidates[:2])
            raise SafetensorsError(f"layer {layer} has experts under two prefixes: {first!r} and {second!r}")
        layers[layer] = candidates[0]
    return layers


def _root(stack):
    """'mtp.' of 'mtp.layers.0.mlp.experts', 'model.' of 'model.layers.3.mlp.experts'."""
    return stack.prefix[:stack.prefix.rindex(f"layers.{stack.layer}.")]


def block_size_of(hf_config, source="config.json"):
    """quantization_config.weight_block_size of a block-wise FP8 config.json (default 128 x 128), any
    pair of positive edges: python -m ktfp8.convert reads blocks that the MoE kernels do not run."""
    quant = (hf_config or {}).get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {quant!r}")
    block = quant.get("weight_block_size")
    if block is None:
        return DEFAULT_BLOCK
    if not (isinstance(block, list) and len(block) == 2 and all(_is_positive_int(b) for b in block)):
        raise ValueError(f"{source}: {BLOCK_FIELD} must be a list of two positive integers "
                         f"[block_out, block_in], got {block!r}")
    return as_block(block, f"{source}: {BLOCK_FIELD}")


def _ids(ids, total):
    """[4, 5, 6] of `total` expert indices whose first ones are `ids` (as _absent gives them), the first 8
    of more: a message stays a line."""
    return str(ids) if total <= 8 else f"{str(ids[:8])[:-1]}, ... ({total} in all)]"


def _absent(present, count):
    """(the first 9 indices of range(count) not in `present`, how many there are), from the gaps between
    the present ones: never walks range(count), which a stray index such as 10**9 makes long."""
    gaps, start = [], 0
    for e in sorted({i for i in present if i < count}) + [count]:
        if e > start:
            gaps.append(range(start, e))
        start = e + 1
    return list(itertools.islice(itertools.chain.from_iterable(gaps), 9)), sum(map(len, gaps))


def _is_positive_int(value):
    # JSON true is a Python bool, an int subclass: [true, true] is not a block of 1 x 1
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


SCALE_RULE = f"scales must be finite, >= 0 and at most {MAX_SCALE:.4g} (FLT_MAX / 256)"


def first_bad_scale(scale):
    """([index], value) of the first value of float32 `scale` that breaks SCALE_RULE, or None: NaN or Inf
    turns every output of its rows into NaN, no converter writes a negative scale, and above MAX_SCALE
    the kernels' packed scales (avx512, avx2) would be Inf, and the largest codes' weights are beyond
    float32.  Zero is allowed: an all-zero row may carry scale 0.  The loader and python -m ktfp8.convert
    refuse the same values."""
    bad = ~np.isfinite(scale) | (scale < 0) | (scale > MAX_SCALE)
    if not bad.any():
        return None
    index = [int(i) for i in np.argwhere(bad)[0]]
    return index, scale[tuple(index)]


def _check_scale_values(path, names, scale):
    """first_bad_scale of the scales of experts `names` (float32 [E, ...]), refused naming the expert."""
    found = first_bad_scale(scale)
    if found is not None:
        (expert, *index), value = found
        raise SafetensorsError(f"{path}: {names[expert]} holds {value!s} at {index}; {SCALE_RULE}")


def fused_expert_names(checkpoint):
    """The tensors, in checkpoint order, that hold a layer's routed experts fused (see FUSED_EXPERTS_RE)."""
    return [n for n in checkpoint.names() if FUSED_EXPERTS_RE.match(n) and len(checkpoint.info(n).shape) == 3]


def fused_experts_tensor(checkpoint):
    """(name, shape) of the first tensor, in name order, of fused_expert_names; None where there is none."""
    fused = fused_expert_names(checkpoint)
    return (min(fused), list(checkpoint.info(min(fused)).shape)) if fused else None


class FP8SafeTensorLoader:
    """Experts of a Hugging Face checkpoint folder: `.format`, `.moe_layers()`, `.load_experts(layer)`
    (memory-mapped ExpertWeights), `.config` (ktfp8 MoeConfig from config.json).

    The loader holds every shard open while it lives.  `close()` (or a `with` block) gives them back:
    experts loaded before stay valid (their views hold the map), and loading more is a ValueError.  A
    MoE built from loaded experts holds its own packed copy and needs neither the loader nor the
    experts: closing the loader and dropping the experts frees the mapped pages."""

    def __init__(self, path):
        self.path = Path(path)
        self.checkpoint = Checkpoint(self.path)
        self.hf_config = self.checkpoint.hf_config()
        self._layers = expert_stacks(self.checkpoint.names())
        self._formats = {layer: self._layer_format(layer) for layer in self._layers}
        self.format = self._overall_format()

    def close(self):
        self.checkpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def moe_layers(self):
        """Indices of the layers that hold routed experts, ascending."""
        return sorted(self._layers)

    def tensor(self, name):
        """Any tensor of the checkpoint by name (e.g. a router weight), as a read-only memory-map view;
        F8_E4M3 as uint8 codes, BF16 as ml_dtypes.bfloat16."""
        return self.checkpoint.file_of(name).memmap(name)

    def layer_format(self, layer):
        self._check_layer(layer)
        return self._formats[layer]

    @property
    def config(self):
        """ktfp8.MoeConfig for this model: MoeConfig.from_hf_config of its config.json, with
        quant_config as below."""
        if self.hf_config is None:
            raise ValueError(f"{self.path}: no config.json to build a MoeConfig from")
        return MoeConfig.from_hf_config(self.hf_config, quant_config=self.quant_config)

    @property
    def quant_config(self):
        """ktfp8.QuantConfig that matches the experts' format: FP8 per-channel (also the target of
        quantize_experts for fp16/fp32 experts), block-wise with the checkpoint's square block edge, or
        BF16.  ValueError for what no kernel runs: formats mixed across layers, other blocks."""
        if self.format == "mixed":
            raise ValueError(f"{self.path}: expert formats differ across layers "
                             f"({dict(sorted(self._formats.items()))}); mixing per-channel and block-wise FP8 "
                             f"(or FP8 and unquantized) experts across layers is not supported")
        if self.format == "fp8_block":
            return self._block_quant_config()
        if self.format == "bf16":
            return QuantConfig("BF16")
        return QuantConfig("FP8", per_channel=True)

    def load_expert_tensors(self, layer, experts=None):
        """(gate, up, down) weights of `layer` as stored, each [E, out, in]: memory-map views when the
        experts lie at equal distances in one shard (as ktfp8 writes them, and safetensors for up to 10
        experts), else stacked copies (load_experts copies nothing: ExpertMatrices).
        experts=range(a, b): only those experts' tensors (the bytes of the others are never mapped in)."""
        experts = self._expert_range(layer, experts)
        return tuple(self._weights(layer, role, experts) for role in ROLES)

    def load_experts(self, layer, experts=None) -> ExpertWeights:
        """The experts of `layer` as ExpertWeights (fp8_per_channel, fp8_block or bf16), memory-mapped.
        experts=range(a, b) (contiguous global ids): a shard holding only those experts, whose bytes are
        the only ones read; a MoE over it skips the other ids.
        fp16/fp32 checkpoints are not FP8 or BF16: convert them first (python -m ktfp8.convert)."""
        fmt = self.layer_format(layer)
        experts = self._expert_range(layer, experts)
        weights = tuple(self._weights(layer, role, experts, matrices=True) for role in ROLES)
        shard = {"first_expert": experts.start, "total_experts": self.expert_count(layer)}
        if fmt == "bf16":
            return ExpertWeights("bf16", *weights, **shard)
        if fmt in ("fp16", "fp32"):
            raise ValueError(f"{self.path}: layer {layer} experts are {fmt}; load_experts returns FP8 or BF16 "
                             f"experts: convert the checkpoint with `python -m ktfp8.convert`, or quantize "
                             f"load_expert_tensors({layer}) with ktfp8.quantize_experts")
        if fmt == "fp8_per_channel":
            scales = [self._per_channel_scale(layer, role, w, experts) for role, w in zip(ROLES, weights)]
            return ExpertWeights(fmt, *weights, *scales, **shard)
        block = self._block_size()
        scales = [self._block_scale(layer, role, w, block, experts) for role, w in zip(ROLES, weights)]
        return ExpertWeights(fmt, *weights, *scales, block=block, **shard)

    def release_experts(self, layer):
        """Gives back the memory-mapped pages of `layer`'s expert tensors once a MoE has packed them:
        while the loader is open they stay charged to this process (clean page cache, but counted in
        RSS and in a cgroup's memory), so a model loaded layer by layer would hold every layer twice
        until close().  Experts loaded before stay valid (their pages are read again if used)."""
        self._check_layer(layer)
        for names in self._layers[layer].tensors.values():
            for name in names.values():
                self.checkpoint.file_of(name).release(name)

    def expert_count(self, layer):
        """Number of routed experts of `layer` in the checkpoint: the highest expert index among its weights
        + 1, as python -m ktfp8.convert counts them without config.json; load_experts refuses a layer that
        lacks a tensor of experts 0 .. count - 1.  (Counting names took a stray tensor of expert 7 beside
        experts 0-3 for "expert 4 is missing".)"""
        self._check_layer(layer)
        return 1 + max((e for r in ROLES for e in self._layers[layer].tensors.get((r, "weight"), {})), default=-1)

    # -- internals ------------------------------------------------------------------------------
    def _block_size(self):
        return block_size_of(self.hf_config, self.path / "config.json")

    def _block_quant_config(self):
        block = self._block_size()
        field_value = f"{self.path / 'config.json'} {BLOCK_FIELD} {list(block)}"
        if block[0] != block[1]:
            raise ValueError(f"{field_value}: non-square blocks are not supported (ktfp8's kernels take one "
                             f"square block edge, QuantConfig.group_size); requantize with python -m "
                             f"ktfp8.convert --input-type fp8, per-channel or with a square block")
        try:
            return QuantConfig("FP8", per_channel=False, group_size=block[0])
        except ValueError as e:     # an edge the kernels cannot run: QuantConfig says why
            raise ValueError(f"{field_value}: {e}") from None

    def _check_layer(self, layer):
        # True == 1 and 1.0 == 1 as dict keys: a bool or float would silently name an int layer
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
            raise TypeError(f"layer must be an int, got {type(layer).__name__} {layer!r}")
        if layer not in self._layers:
            fused = fused_experts_tensor(self.checkpoint)
            why = f"; its routed experts are stored fused (e.g. {fused[0]!r} {fused[1]}), and FP8SafeTensorLoader " \
                f"reads {PER_EXPERT_NAMES}: {CONVERT_SPLITS_FUSED}" if fused else ""
            raise ValueError(f"layer {layer!r} has no experts in {self.path}; MoE layers: {self.moe_layers()}{why}")

    def _expert_range(self, layer, experts):
        total = self.expert_count(layer)
        return range(total) if experts is None else check_expert_range(experts, total, "experts")

    def _names(self, layer, role, kind, experts):
        stack = self._layers[layer]
        names = stack.tensors.get((role, kind))
        if not names:
            raise SafetensorsError(f"{self.path}: layer {layer} has no {role} expert {kind} tensors "
                                   f"under {stack.prefix}")
        count = self.expert_count(layer)
        # names' keys are distinct indices >= 0: count of them with the highest count - 1 are range(count)
        # (a stray index such as 10**9 would make set(range(count)) too large to build)
        if len(names) != count or max(names) != count - 1:
            raise SafetensorsError(f"{self.path}: layer {layer}: {self._wrong_ids(layer, role, kind, count)}")
        return [names[e] for e in experts]

    def _wrong_ids(self, layer, role, kind, count):
        """Why the `role` `kind` tensors of `layer` are not those of experts 0 .. count - 1 (a phrase): a
        tensor beyond the experts with weights, whole experts absent below the highest index (named: a stray
        tensor, or experts that were never written), else the experts this projection lacks."""
        stack = self._layers[layer]
        names = stack.tensors[role, kind]
        beyond = sorted(e for e in names if e >= count)       # a scale of an expert without weights
        if beyond:
            return (f"{role} {kind} {names[beyond[0]]!r} names expert {beyond[0]}, but the layer's experts "
                    f"(those with weights) are 0-{count - 1}")
        missing = _ids(*_absent(names, count))
        weights = [stack.tensors.get((r, "weight"), {}) for r in ROLES]
        absent, absent_count = _absent({e for w in weights for e in w}, count)
        if not absent_count:
            return f"{role} {kind} missing for experts {missing}"
        highest = next(w[count - 1] for w in weights if count - 1 in w)
        return (f"experts {_ids(absent, absent_count)} have no gate, up or down weight, yet {highest!r} names "
                f"expert {count - 1}: expert indices run from 0 without a gap ({role} {kind} missing for "
                f"experts {missing})")

    def _stack(self, layer, role, kind, experts, matrices=False):
        """The tensors of `kind` of `role` of the experts, [E, ...]: one memory-map view where they lie at
        one distance in one shard; else matrices=True: an ExpertMatrices of their views (MoE packs them
        where they lie), matrices=False: a stacked copy."""
        names = self._names(layer, role, kind, experts)
        files = {self.checkpoint.weight_map[n] for n in names}
        infos = [self.checkpoint.info(n) for n in names]
        other = next((i for i in infos if i.shape != infos[0].shape or i.dtype != infos[0].dtype), None)
        if other is not None:
            raise SafetensorsError(f"{self.path}: layer {layer} {role} {kind}: experts differ in shape or dtype "
                                   f"({other.name}: {other.dtype} {list(other.shape)}, but {infos[0].name}: "
                                   f"{infos[0].dtype} {list(infos[0].shape)})")
        if len(files) == 1:
            view = self.checkpoint.file_of(names[0]).stacked_memmap(names)
            if view is not None:
                return view
        views = [self.checkpoint.file_of(n).memmap(n) for n in names]
        return ExpertMatrices(views) if matrices and views[0].ndim == 2 else np.stack(views)

    def _weights(self, layer, role, experts, matrices=False):
        weights = self._stack(layer, role, "weight", experts, matrices)
        if weights.ndim != 3:
            name = self._names(layer, role, "weight", experts)[0]
            raise SafetensorsError(f"{self.path}: {name} has shape {list(weights.shape[1:])}; expert weights "
                                   f"are 2-D [out, in]")
        return weights

    def _layer_format(self, layer):
        stack = self._layers[layer]
        dtypes = {self.checkpoint.info(n).dtype
                  for role in ROLES for n in stack.tensors.get((role, "weight"), {}).values()}
        if len(dtypes) != 1:
            raise SafetensorsError(f"{self.path}: layer {layer} expert weights have dtypes {sorted(dtypes)}; "
                                   f"expected one")
        dtype = dtypes.pop()
        if dtype in FLOAT_FORMATS:
            return FLOAT_FORMATS[dtype]
        if dtype != "F8_E4M3":
            raise SafetensorsError(f"{self.path}: layer {layer} expert weights are {dtype}; supported: "
                                   f"F8_E4M3, BF16, F16, F32")
        if "weight_scale_inv" in stack.kinds():
            return "fp8_block"
        if "weight_scale" in stack.kinds():
            return "fp8_per_channel"
        raise SafetensorsError(f"{self.path}: layer {layer} experts are F8_E4M3 without weight_scale or "
                               f"weight_scale_inv tensors")

    def _overall_format(self):
        formats = set(self._formats.values())
        if len(formats) == 1:
            return formats.pop()
        if formats:
            return "mixed"      # layer_format(layer) tells each layer's
        names = self.checkpoint.names()
        if any(n.endswith(".weight_scale_inv") for n in names):
            return "fp8_block"
        if any(n.endswith(".weight_scale") for n in names):
            return "fp8_per_channel"
        dtypes = [self.checkpoint.info(n).dtype for n in names if n.endswith(".weight")]
        floats = [d for d in dtypes if d in FLOAT_FORMATS]
        return FLOAT_FORMATS[max(set(floats), key=floats.count)] if floats else "unknown"

    def _scale(self, layer, role, kind, experts):
        """The `kind` scales of the `role` experts as stored ([E, ...]), checked, as float32."""
        names = self._names(layer, role, kind, experts)
        scale = self._stack(layer, role, kind, experts)
        dtype = self.checkpoint.info(names[0]).dtype
        if dtype not in SCALE_DTYPES:
            raise SafetensorsError(f"{self.path}: {names[0]} is {dtype}; expected F32 (or BF16/F16, widened)")
        scale = scale if scale.dtype == np.float32 else scale.astype(np.float32)
        _check_scale_values(self.path, names, scale)
        return scale

    def _per_channel_scale(self, layer, role, weights, experts):
        scale = self._scale(layer, role, "weight_scale", experts)
        E, out, _ = weights.shape
        if scale.shape in ((E,), (E, 1)):     # per-tensor (compressed-tensors "tensor"): every row's scale
            scale = np.repeat(scale.reshape(E, 1, 1), out, axis=1)
        if scale.shape == (E, out):
            scale = scale[..., None]
        if scale.shape != (E, out, 1):
            raise SafetensorsError(f"{self.path}: layer {layer} {role} weight_scale has per-expert shape "
                                   f"{list(scale.shape[1:])}; per-channel needs [{out}] or [{out}, 1] "
                                   f"(per-tensor: [] or [1])")
        return scale

    def _block_scale(self, layer, role, weights, block, experts):
        scale = self._scale(layer, role, "weight_scale_inv", experts)
        E, out, inn = weights.shape
        expected = (E, -(-out // block[0]), -(-inn // block[1]))
        if scale.shape != expected:
            raise SafetensorsError(f"{self.path}: layer {layer} {role} weight_scale_inv has shape "
                                   f"{list(scale.shape)}; block {list(block)} needs {list(expected)}")
        return scale
