"""FP8 E4M3 codec: encode / decode and per-channel or block-wise quantize / dequantize.

E4M3 here is "e4m3fn" (bias 7, max 448, no infinities, NaN = S.1111.111).  Rounding is
round-to-nearest-even with saturation to +-448; +-Inf saturates to +-448; NaN stays NaN with its
sign (0x7F / 0xFF).  Codes are returned as ``uint8``; ``ml_dtypes.float8_e4m3fn`` codes are accepted
wherever codes are read.  Every function is bit-identical across backends and thread counts.

Float inputs are ``float32``, ``ml_dtypes.bfloat16`` or ``float16`` NumPy arrays or CPU torch
tensors (read in place; the results are then tensors, and torch dtypes are accepted as dtypes).
Non-contiguous inputs are copied to C order first (the result is the same; only the copy costs).
Every function takes the keyword arguments ``backend`` (a name from ``ktfp8.available_backends()``;
default: the ``KTFP8_BACKEND`` environment variable, else the best one) and ``threads`` (default:
``KTFP8_NUM_THREADS``, else all cores); the GIL is released while the C code runs.

Scales follow DeepSeek-V3's ``weight_scale_inv``: ``w ~= decode(code) * scale`` with
``scale = amax / 448`` over the finite values of the row or block; a row or block with no finite
nonzero value gets ``scale = 1``.  (When ``amax / 448`` underflows to zero, i.e. amax < 3.2e-43,
the smallest positive float32 is used instead so that ``w / scale`` stays finite.)
"""
import ml_dtypes
import numpy as np

from ._native import _ext
from ._torch import accepts_tensors
from .backends import default_threads, variant
from .config import as_block

# dtype -> code understood by the C side (enum ktfp8_dtype)
_C = _ext.ktfp8_dtype
_FLOAT_INPUTS = {np.dtype(np.float32): _C.KTFP8_F32, np.dtype(ml_dtypes.bfloat16): _C.KTFP8_BF16,
                 np.dtype(np.float16): _C.KTFP8_F16}
_FLOAT_OUTPUTS = {np.dtype(np.float32): _C.KTFP8_F32, np.dtype(ml_dtypes.bfloat16): _C.KTFP8_BF16}
_CODE_DTYPES = (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn))
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


@accepts_tensors("x")
def encode(x, *, backend=None, threads=None):
    """E4M3 codes (uint8, shape of `x`) of a float32 / bfloat16 / float16 array, without scaling.
    Equal to ``np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)``."""
    x, dtype_code = _float_array(x, "x")
    backend, threads = variant(backend), default_threads(threads)
    codes = np.empty(x.shape, np.uint8)
    if codes.size:
        _ext.codec_encode(backend, x, dtype_code, codes, threads)
    return codes


@accepts_tensors("codes")
def decode(codes, dtype=np.float32, *, backend=None, threads=None):
    """The values of E4M3 `codes` (uint8 or float8_e4m3fn, any shape) as float32 or bfloat16,
    exact for every code; NaN codes give NaN."""
    codes = _codes_array(codes, "codes")
    out_dtype = _output_dtype(dtype, "dtype")
    backend, threads = variant(backend), default_threads(threads)
    out = np.empty(codes.shape, out_dtype)
    if out.size:
        _ext.codec_decode(backend, codes, _as_bits(out), _FLOAT_OUTPUTS[out_dtype], threads)
    return out


@accepts_tensors("w")
def quantize(w, per_channel=True, block=(128, 128), *, backend=None, threads=None):
    """Quantizes a 2-D ``[out, in]`` matrix or a 3-D ``[experts, out, in]`` stack to E4M3.

    Returns ``(codes, scale)``: codes uint8 of the shape of `w`; scale float32 of shape
    ``[..., out, 1]`` (per-channel) or ``[..., ceil(out / block[0]), ceil(in / block[1])]``
    (block-wise; blocks at the right and bottom edges are cut short).  The codes equal
    ``ml_dtypes.float8_e4m3fn(clip(float32(w) / scale, -448, 448))`` with the division in float32."""
    dtype_code = check_float_array(w, "w")
    _check_matrix_shape(w, "w")
    per_channel = _check_bool(per_channel, "per_channel")
    bn, bk = as_block(block)
    backend, threads = variant(backend), default_threads(threads)
    mats, rows, cols = _as_3d(w.shape)
    if per_channel:
        bn, bk = 1, cols
    codes = np.empty(w.shape, np.uint8)
    scale = np.empty(w.shape[:-2] + (-(-rows // bn), -(-cols // bk)), np.float32)
    if w.ndim == 3 and not w.flags.c_contiguous and all(e.flags.c_contiguous for e in w):
        # experts each in C order but not one after another (transformers' fused gate_up_proj cut in
        # halves): one at a time, where a C-order copy would hold the whole stack again
        for e in range(mats):
            _ext.codec_quantize_blocks(backend, w[e], dtype_code, (1, rows, cols, bn, bk), codes[e], scale[e],
                                       threads)
    else:
        _ext.codec_quantize_blocks(backend, _c_order(w), dtype_code, (mats, rows, cols, bn, bk), codes, scale,
                                   threads)
    return codes, scale


@accepts_tensors("codes")
def dequantize(codes, scale, out_dtype=np.float32, block=(128, 128), *, backend=None, threads=None):
    """``decode(codes) * scale`` for codes from `quantize` (2-D or 3-D), computed in float32 and
    returned as `out_dtype` (float32 or bfloat16, rounded to nearest even).  A `scale` of shape
    ``[..., out, 1]`` is per-channel; any other shape must be the block-wise
    ``[..., ceil(out / block[0]), ceil(in / block[1])]``."""
    codes = _codes_array(codes, "codes")
    _check_matrix_shape(codes, "codes")
    out_dtype = _output_dtype(out_dtype, "out_dtype")
    bn, bk = as_block(block)
    scale = _scale_array(scale, "scale")
    backend, threads = variant(backend), default_threads(threads)
    mats, rows, cols = _as_3d(codes.shape)
    lead = codes.shape[:-2]
    blockwise_shape = lead + (-(-rows // bn), -(-cols // bk))
    if scale.shape == lead + (rows, 1):
        bn, bk = 1, cols
    elif scale.shape != blockwise_shape:
        raise ValueError(f"scale has shape {scale.shape}; for codes of shape {codes.shape} expected "
                         f"{lead + (rows, 1)} (per-channel) or {blockwise_shape} (block-wise, block={(bn, bk)})")
    out = np.empty(codes.shape, out_dtype)
    _ext.codec_dequantize_blocks(backend, codes, scale, (mats, rows, cols, bn, bk), _as_bits(out),
                                 _FLOAT_OUTPUTS[out_dtype], threads)
    return out


# ---------------------------------------------------------------------------- validation helpers

def _c_order(a):
    # np.ascontiguousarray would turn a 0-d array into 1-d; 0-d arrays are contiguous anyway.
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


# (signed view, unsigned view, bits of +inf) of each float input dtype: NaN and Inf are the values whose
# exponent bits are all ones, i.e. whose bits with the sign cleared are >= those of +inf
_INF_BITS = {np.dtype(ml_dtypes.bfloat16): (np.int16, np.uint16, 0x7F80),
             np.dtype(np.float16): (np.int16, np.uint16, 0x7C00),
             np.dtype(np.float32): (np.int32, np.uint32, 0x7F800000)}


def all_finite(values):
    """Whether a BF16 / F16 / F32 array holds no NaN or Inf.  Two max reductions over its bits, no
    temporary array for a contiguous one: a positive NaN or Inf is the largest as a signed integer, a
    negative one as an unsigned integer (sign bit set)."""
    if values.ndim == 3 and not values.flags.c_contiguous:     # a sliced stack: no copy of all of it
        return all(all_finite(matrix) for matrix in values)
    signed, unsigned, inf = _INF_BITS[values.dtype]
    bits = np.ascontiguousarray(values).reshape(-1)
    if not bits.size:
        return True
    sign = 1 << (8 * values.dtype.itemsize - 1)
    return bits.view(signed).max() < inf and bits.view(unsigned).max() < (sign | inf)


def first_non_finite(values):
    """The index (a list of ints) of the first NaN or Inf of a BF16 / F16 / F32 array in C order, or
    None where all_finite: the quick test first, the search only where it fails."""
    if all_finite(values):
        return None
    return [int(i) for i in np.argwhere(~np.isfinite(values.astype(np.float32)))[0]]


# Why quantize_experts and python -m ktfp8.convert refuse a NaN or Inf weight: the end of their message.
NON_FINITE_WEIGHTS = ("only finite weights can be quantized (FP8 E4M3 has no infinity, and a NaN weight makes "
                      "every output of its row NaN)")


def check_float_array(a, name):
    """The C side's code for a's dtype; TypeError naming `name` unless `a` is a float32, bfloat16 or
    float16 array (what encode and quantize take)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array or a torch tensor (float32, bfloat16 or float16), got {type(a).__name__}")
    if a.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {a.dtype}")
    return _FLOAT_INPUTS[a.dtype]


def _float_array(a, name):
    code = check_float_array(a, name)
    return _c_order(a), code


def _codes_array(a, name):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array or a torch tensor of uint8 or float8_e4m3fn codes, got {type(a).__name__}")
    if a.dtype not in _CODE_DTYPES:
        raise TypeError(f"{name} must have dtype uint8 or float8_e4m3fn, got {a.dtype}")
    return _c_order(a).view(np.uint8)


def _scale_array(a, name):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a float32 numpy array, got {type(a).__name__}")
    if a.dtype not in _SCALE_DTYPES:
        raise TypeError(f"{name} must have dtype float32 (or bfloat16 / float16), got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _output_dtype(dtype, name):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be np.float32 or ml_dtypes.bfloat16, got {dtype!r}") from None
    if dtype is None or any(dtype is t for t in (float, int, bool, complex)):   # NumPy: float64, int64, ...
        raise TypeError(f"{name} must be np.float32 or ml_dtypes.bfloat16, got {dtype!r}")
    if dt not in _FLOAT_OUTPUTS:
        raise ValueError(f"{name} must be np.float32 or ml_dtypes.bfloat16, got {dt}")
    return dt


def _as_bits(out):
    """The float32 array itself, or a bfloat16 array viewed as its uint16 bit patterns."""
    return out.view(np.uint16) if out.dtype == np.dtype(ml_dtypes.bfloat16) else out


def _check_matrix_shape(a, name):
    if a.ndim not in (2, 3):
        raise ValueError(f"{name} must be 2-D [out, in] or 3-D [experts, out, in], got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {a.shape}")


def _as_3d(shape):
    return (shape[0] if len(shape) == 3 else 1), shape[-2], shape[-1]


def _check_bool(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)
