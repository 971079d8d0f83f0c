"""ExpertWeights: the routed experts of one MoE layer, as codes + scales (or BF16), HF layout."""
from dataclasses import dataclass
from typing import Optional, Tuple

import ml_dtypes
import numpy as np

from ._torch import accepts_tensors, to_numpy

FORMATS = ("fp8_per_channel", "fp8_block", "bf16")


@dataclass(frozen=True)
class ExpertWeights:
    """gate, up: [E, intermediate, hidden]; down: [E, hidden, intermediate] (HF Linear [out, in]).

    fp8_per_channel: uint8 codes + float32 scales [E, out, 1];
    fp8_block:       uint8 codes + float32 scales [E, ceil(out/bn), ceil(in/bk)], block = (bn, bk);
    bf16:            ml_dtypes.bfloat16 weights, scales None.
    Arrays may be memory-mapped; nothing is copied until a MoE packs them.  CPU torch tensors are
    accepted and held as NumPy views of their memory (no copy)."""
    format: str
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    gate_scale: Optional[np.ndarray] = None
    up_scale: Optional[np.ndarray] = None
    down_scale: Optional[np.ndarray] = None
    block: Optional[Tuple[int, int]] = None

    def __post_init__(self):
        for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"):
            object.__setattr__(self, name, to_numpy(getattr(self, name), f"ExpertWeights.{name}"))
        _validate(self)

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
    def nbytes(self):
        arrays = (self.gate, self.up, self.down, self.gate_scale, self.up_scale, self.down_scale)
        return sum(a.nbytes for a in arrays if a is not None)


def _validate(w):
    if w.format not in FORMATS:
        raise ValueError(f"ExpertWeights.format must be one of {FORMATS}, got {w.format!r}")
    for name in ("gate", "up", "down"):
        a = getattr(w, name)
        if not isinstance(a, np.ndarray) or a.ndim != 3:
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
    if w.format == "bf16":
        return
    if w.format == "fp8_block":
        if w.block is None or len(w.block) != 2 or min(w.block) <= 0:
            raise ValueError(f"fp8_block needs block=(block_n, block_k) > 0, got {w.block!r}")
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


@accepts_tensors(main=None)
def quantize_experts(gate, up, down, quant_config):
    """Quantizes float experts (float32 / bfloat16 / float16 arrays or CPU tensors, HF layout) as
    `quant_config` says: method "FP8" per-channel or block-wise (group_size = block edge), or "BF16".
    The result holds NumPy arrays whatever the input."""
    from . import fp8

    method = getattr(quant_config, "method", None)
    if method == "BF16":
        as_bf16 = [np.ascontiguousarray(a).astype(ml_dtypes.bfloat16) for a in (gate, up, down)]
        return ExpertWeights("bf16", *as_bf16)
    if method != "FP8":
        raise ValueError(f"quant_config.method must be 'FP8' or 'BF16', got {method!r}")
    if quant_config.per_channel:
        q = [fp8.quantize(a, per_channel=True) for a in (gate, up, down)]
        return ExpertWeights("fp8_per_channel", q[0][0], q[1][0], q[2][0], q[0][1], q[1][1], q[2][1])
    block = (quant_config.group_size, quant_config.group_size)
    q = [fp8.quantize(a, per_channel=False, block=block) for a in (gate, up, down)]
    return ExpertWeights("fp8_block", q[0][0], q[1][0], q[2][0], q[0][1], q[1][1], q[2][1], block=block)
