"""One input tensor of a conversion and what becomes of it (an Item of the plan), and the rules every
Item follows: which dtypes may be quantized, the shape of a weight's scale, the bytes read."""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

from .safetensors_io import tensor_nbytes

INPUT_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32", "fp8": "F8_E4M3"}
FLOAT_DTYPES = ("BF16", "F16", "F32")


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
    check_codes: bool = False                # a copied FP8 weight: refused if it holds the NaN code

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


def scale_shape(shape, spec):
    out, inn = shape
    if spec.per_channel:
        return (out, 1)
    return (math.ceil(out / spec.block[0]), math.ceil(inn / spec.block[1]))


def quantizable_dtype(dtype, input_type):
    """Whether a weight of `dtype` may be quantized under --input-type: the float type it names, or under
    --input-type fp8 any float type."""
    return dtype in FLOAT_DTYPES and (input_type == "fp8" or dtype == INPUT_DTYPES[input_type])
