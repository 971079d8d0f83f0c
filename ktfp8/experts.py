"""ExpertWeights: the routed experts of one MoE layer, as codes + scales (or BF16), HF layout."""
from dataclasses import dataclass
from typing import Optional, Tuple

import ml_dtypes
import numpy as np

from ._torch import accepts_tensors, to_numpy
from .config import MAX_SIZE, as_block, as_quant_config

FORMATS = ("fp8_per_channel", "fp8_block", "bf16")
# The largest |scale| an FP8 expert may carry (Inf too is refused): the avx512 and avx2 kernels fold
# their conversion's 2^8 (FP8 -> FP16 bits) into the packed scales, and a larger scale would become Inf
# there.  fp8.quantize's largest is FLT_MAX / 448, below it; above it the largest codes' weights
# (448 x scale) are beyond float32 anyway.
MAX_SCALE = float(np.finfo(np.float32).max) / 256


class ExpertMatrices:
    """[E, out, in] expert matrices held where they lie, as E [out, in] arrays (memory-map views).

    A checkpoint's experts need not lie at one distance from each other: safetensors writes tensor
    names in string order (experts 0, 1, 10, 100, ..., 2, ...), and a layer may span two shards.  No
    NumPy view covers such a layer, and stacking one would copy it; ktfp8.MoE packs from the matrices
    as they are.  m[e] is expert e's matrix, m[a:b] an ExpertMatrices of those experts, and
    np.asarray(m) a stacked copy."""

    ndim = 3

    def __init__(self, matrices):
        self.matrices = tuple(matrices)
        if not self.matrices:
            raise ValueError("ExpertMatrices needs at least one expert matrix")
        first = self.matrices[0]
        for m in self.matrices:
            if not isinstance(m, np.ndarray) or m.ndim != 2 or m.shape != first.shape or m.dtype != first.dtype:
                raise ValueError(f"ExpertMatrices matrices must be 2-D arrays of one shape and dtype like the first "
                                 f"({first.shape}, {first.dtype})")
        self.shape = (len(self.matrices),) + first.shape
        self.dtype = first.dtype

    @property
    def nbytes(self):
        return sum(m.nbytes for m in self.matrices)

    def __len__(self):
        return len(self.matrices)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return ExpertMatrices(self.matrices[key])
        if isinstance(key, (int, np.integer)):
            return self.matrices[key]
        if isinstance(key, tuple) and key and isinstance(key[0], (int, np.integer)):
            return self.matrices[key[0]][key[1:]]
        return np.asarray(self)[key]

    def __array__(self, dtype=None, copy=None):
        if copy is False:
            raise ValueError("an ExpertMatrices is not one array: np.asarray of it stacks a copy")
        stacked = np.stack(self.matrices)
        return stacked if dtype is None else stacked.astype(dtype, copy=False)

    def view(self, dtype):
        """The same bytes as `dtype` (of the same item size), matrix by matrix."""
        return ExpertMatrices(m.view(dtype) for m in self.matrices)

    def __repr__(self):
        return f"ExpertMatrices(shape={self.shape}, dtype={self.dtype})"


@dataclass(frozen=True)
class ExpertWeights:
    """gate, up: [E, intermediate, hidden]; down: [E, hidden, intermediate] (HF Linear [out, in]).

    fp8_per_channel: uint8 codes + float32 scales [E, out, 1];
    fp8_block:       uint8 codes + float32 scales [E, ceil(out/bn), ceil(in/bk)], block = (bn, bk);
    bf16:            ml_dtypes.bfloat16 weights, scales None.
    Arrays may be memory-mapped; nothing is copied until a MoE packs them.  A weight may also be an
    ExpertMatrices (per-expert matrices where a checkpoint holds them; FP8SafeTensorLoader gives one where
    no view covers a layer's experts).  CPU torch tensors are
    accepted and held as NumPy views of their memory (no copy).

    A shard of a layer holds the contiguous global expert ids `expert_range` =
    range(first_expert, first_expert + expert_num) of the layer's `total_experts` (default: the whole
    layer, first_expert 0).  A MoE over a shard skips the ids outside it."""
    format: str
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    gate_scale: Optional[np.ndarray] = None
    up_scale: Optional[np.ndarray] = None
    down_scale: Optional[np.ndarray] = None
    block: Optional[Tuple[int, int]] = None
    first_expert: int = 0
    total_experts: Optional[int] = None

    def __post_init__(self):
        for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"):
            object.__setattr__(self, name, to_numpy(getattr(self, name), f"ExpertWeights.{name}"))
        _validate(self)
        _validate_shard(self)

    @property
    def expert_num(self):
        return self.gate.shape[0]

    @property
    def hidden_size(self):
        return self.gate.shape[2]

    @property
    def intermediate_size(self):
        return self.gate.shape[1]

    @property
    def expert_range(self):
        """Global ids of the experts held, within range(total_experts)."""
        return range(self.first_expert, self.first_expert + self.expert_num)

    def shard(self, experts):
        """The experts `experts` (a range of global ids inside expert_range) as an ExpertWeights of
        views (no copy), so a rank or NUMA node holds and packs only its own."""
        own = self.expert_range
        check_expert_range(experts, self.total_experts, "experts")
        if experts.start < own.start or experts.stop > own.stop:
            raise ValueError(f"experts={experts!r} is not inside the experts held, {own!r}")
        lo, hi = experts.start - own.start, experts.stop - own.start
        arrays = [None if a is None else a[lo:hi] for a in (self.gate, self.up, self.down,
                                                              self.gate_scale, self.up_scale, self.down_scale)]
        return ExpertWeights(self.format, *arrays, block=self.block, first_expert=experts.start,
                             total_experts=self.total_experts)

    @property
    def nbytes(self):
        arrays = (self.gate, self.up, self.down, self.gate_scale, self.up_scale, self.down_scale)
        return sum(a.nbytes for a in arrays if a is not None)


def check_expert_range(experts, total, name="experts"):
    """`experts` must be a non-empty range(a, b) with step 1 inside range(total); returns it."""
    if not isinstance(experts, range):
        raise TypeError(f"{name} must be a range(start, stop) of expert ids, got {type(experts).__name__}")
    if experts.step != 1:
        raise ValueError(f"{name} must be a contiguous range (step 1), got {experts!r}")
    if len(experts) == 0:
        raise ValueError(f"{name} must hold at least one expert, got the empty {experts!r}")
    if experts.start < 0 or experts.stop > total:
        raise ValueError(f"{name}={experts!r} is outside the layer's experts range(0, {total})")
    return experts


def split_experts(expert_num, parts, name="parts"):
    """`parts` contiguous ranges covering range(expert_num), sizes differing by at most one (the first
    expert_num % parts ranges hold one more): how ranks or NUMA nodes share a layer's experts."""
    for what, v in (("expert_num", expert_num), (name, parts)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{what} must be a positive int, got {v!r}")
    if parts > expert_num:
        raise ValueError(f"{name}={parts} would leave {parts - expert_num} of them without experts: a layer "
                         f"of {expert_num} experts splits over at most {expert_num}")
    size, extra = divmod(int(expert_num), int(parts))
    bounds = [p * size + min(p, extra) for p in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _validate_shard(w):
    if w.total_experts is None:      # frozen dataclass: the one place a default is filled in
        _check_count("first_expert", w.first_expert)
        object.__setattr__(w, "total_experts", w.first_expert + w.expert_num)
    for name in ("first_expert", "total_experts"):
        object.__setattr__(w, name, _check_count(name, getattr(w, name)))
    if w.first_expert + w.expert_num > w.total_experts:
        raise ValueError(f"ExpertWeights holds experts {w.expert_range!r}, beyond total_experts="
                         f"{w.total_experts}")


def _check_count(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= MAX_SIZE:
        raise ValueError(f"ExpertWeights.{name} must be a non-negative int at most {MAX_SIZE}, got {v!r}")
    return int(v)


def _validate(w):
    if w.format not in FORMATS:
        raise ValueError(f"ExpertWeights.format must be one of {FORMATS}, got {w.format!r}")
    for name in ("gate", "up", "down"):
        a = getattr(w, name)
        if not isinstance(a, (np.ndarray, ExpertMatrices)) or a.ndim != 3:
            raise ValueError(f"ExpertWeights.{name} must be a 3-D numpy array [experts, out, in]")
        if w.format == "bf16":
            if a.dtype not in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)):
                raise TypeError(f"ExpertWeights.{name} must be bfloat16 (or uint16 bits), got {a.dtype}")
        elif a.dtype not in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8)):
            raise TypeError(f"ExpertWeights.{name} must be float8_e4m3fn or uint8 codes, got {a.dtype}")
    E, inter, hidden = w.gate.shape
    if w.up.shape != (E, inter, hidden):
        raise ValueError(f"ExpertWeights.up has shape {w.up.shape}, expected {(E, inter, hidden)} like gate")
    if w.down.shape != (E, hidden, inter):
        raise ValueError(f"ExpertWeights.down has shape {w.down.shape}, expected {(E, hidden, inter)}")
    if min(E, inter, hidden) <= 0:
        raise ValueError(f"ExpertWeights sizes must be positive, got gate shape {w.gate.shape}")
    # a field the format does not read means the arrays were mixed up: refused, not ignored
    if w.format == "bf16":
        given = [name for name in ("gate_scale", "up_scale", "down_scale", "block") if getattr(w, name) is not None]
        if given:
            raise ValueError(f"ExpertWeights of format 'bf16' carry no scales or block; got {', '.join(given)}")
        return
    if w.format == "fp8_per_channel" and w.block is not None:
        raise ValueError(f"ExpertWeights of format 'fp8_per_channel' take no block (one scale per output row), "
                         f"got block={w.block!r}")
    if w.format == "fp8_block":
        if w.block is None:
            raise ValueError("fp8_block needs block=(block_n, block_k) > 0, got None")
        object.__setattr__(w, "block", as_block(w.block, "ExpertWeights.block"))
    for name, proj in (("gate_scale", w.gate), ("up_scale", w.up), ("down_scale", w.down)):
        s = getattr(w, name)
        _, out, inn = proj.shape
        if w.format == "fp8_per_channel":
            expected = (E, out, 1)
        else:
            bn, bk = w.block
            expected = (E, -(-out // bn), -(-inn // bk))
        if not isinstance(s, np.ndarray) or s.dtype != np.float32:
            raise TypeError(f"ExpertWeights.{name} must be a float32 numpy array of shape {expected}")
        if s.shape != expected and not (w.format == "fp8_per_channel" and s.shape == (E, out)):
            raise ValueError(f"ExpertWeights.{name} has shape {s.shape}, expected {expected}")
        too_large = np.abs(s) > MAX_SCALE            # NaN compares False: a NaN row stays NaN, as in the reference
        if too_large.any():
            index = tuple(int(i) for i in np.argwhere(too_large)[0])
            raise ValueError(f"ExpertWeights.{name} holds {s[index]!s} at {list(index)}; |scale| must be at most "
                             f"{MAX_SCALE:.4g} (FLT_MAX / 256)")


def _check_finite(w, name):
    """ValueError at the first NaN or Inf of weights `w`, as python -m ktfp8.convert refuses them: E4M3
    has no infinity (an Inf would become 448 x its row's scale, a finite wrong weight), and a NaN weight
    makes every output of its row NaN.  One expert at a time, so that a strided stack is copied one
    expert's worth at a time at most."""
    from . import fp8

    for e, matrix in enumerate(w if w.ndim == 3 else [w]):
        at = fp8.first_non_finite(matrix)
        if at is not None:
            where = [e, *at] if w.ndim == 3 else at
            raise ValueError(f"{name} holds {float(matrix[tuple(at)])} at {where}; {fp8.NON_FINITE_WEIGHTS}")


def _check_bf16_range(w, as_bf16, name, first_expert=0):
    """ValueError at the first finite weight of `w` that became Inf as bfloat16 `as_bf16`: a float32
    beyond bfloat16's largest finite value (and its half step), which rounds to Inf.  `w` holds the
    layer's experts from `first_expert` on: the message names the layer's index."""
    from . import fp8

    at = fp8.first_non_finite(as_bf16)
    if at is not None:
        value, at[0] = float(w[tuple(at)]), at[0] + first_expert
        raise ValueError(f"{name} holds {value} at {at}, beyond bfloat16's largest finite value "
                         f"{float(ml_dtypes.finfo(ml_dtypes.bfloat16).max):.5g}: as BF16 it would become Inf "
                         f"(method 'FP8' scales such weights into range)")


@accepts_tensors(main=None)
def quantize_experts(gate, up, down, quant_config, experts=None):
    """Quantizes float experts (float32 / bfloat16 / float16 arrays or CPU tensors, HF layout) as
    `quant_config` (a QuantConfig or a mapping of its fields) says: method "FP8" per-channel or
    block-wise (group_size = block edge), or "BF16".
    The result holds NumPy arrays whatever the input; with method "BF16", bfloat16 input is held as
    given (views of it, no copy).
    experts=range(a, b): quantize only that contiguous shard of the layer (see ExpertWeights.shard);
    every scale is per expert, so a shard's codes equal the same experts' codes of the whole layer."""
    from . import fp8

    quant_config = as_quant_config(quant_config, "quant_config")
    for name, a in (("gate", gate), ("up", up), ("down", down)):   # BF16 too: one rule for both methods
        fp8.check_float_array(a, name)
        _check_finite(a, name)
    shard = {}
    if experts is not None:
        total = {len(a) for a in (gate, up, down) if getattr(a, "ndim", 0) == 3}
        if len(total) != 1:
            raise ValueError("experts= needs gate, up and down as 3-D [experts, out, in] stacks of one "
                             "expert count")
        total = total.pop()
        check_expert_range(experts, total, "experts")
        gate, up, down = (a[experts.start:experts.stop] for a in (gate, up, down))
        shard = {"first_expert": experts.start, "total_experts": total}
    if quant_config.method == "BF16":
        # BF16 input is held as it is, views included (MoE packs its own copy): copying it here put a
        # third full-size copy of a model's experts beside its parameters and the packed layer
        as_bf16 = [a if a.dtype == ml_dtypes.bfloat16 else a.astype(ml_dtypes.bfloat16) for a in (gate, up, down)]
        for name, a, b in zip(("gate", "up", "down"), (gate, up, down), as_bf16):
            if b is not a:  # bfloat16 input, finite as checked above, is in range
                _check_bf16_range(a, b, name, shard.get("first_expert", 0))
        return ExpertWeights("bf16", *as_bf16, **shard)
    if quant_config.per_channel:
        q = [fp8.quantize(a, per_channel=True) for a in (gate, up, down)]
        return ExpertWeights("fp8_per_channel", q[0][0], q[1][0], q[2][0], q[0][1], q[1][1], q[2][1],
                             **shard)
    block = (quant_config.group_size, quant_config.group_size)
    q = [fp8.quantize(a, per_channel=False, block=block) for a in (gate, up, down)]
    return ExpertWeights("fp8_block", q[0][0], q[1][0], q[2][0], q[0][1], q[1][1], q[2][1], block=block,
                         **shard)
