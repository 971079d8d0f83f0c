# The kernel ABI (abi.h): the types and enums every seam below shares with C.

from libc.stdint cimport int32_t, int64_t, uint8_t
cimport numpy as cnp

cnp.import_array()

cdef extern from "ktfp8/abi.h":
    cpdef enum ktfp8_dtype:
        KTFP8_F32
        KTFP8_BF16
        KTFP8_F16
    cpdef enum ktfp8_wformat:
        KTFP8_FMT_FP8_CHANNEL
        KTFP8_FMT_FP8_BLOCK
        KTFP8_FMT_BF16
    ctypedef struct ktfp8_codec_ops:
        pass
    ctypedef struct ktfp8_layout:
        int rows_per_tile
        int k_pack
        float scale_mul
        int code_order
        int act_exp
    ctypedef struct ktfp8_moe_kernel:
        ktfp8_layout layout
        int act_dtype
    ctypedef struct ktfp8_variant:
        const char *name
        const ktfp8_codec_ops *codec
        const ktfp8_moe_kernel *moe


cdef inline size_t dtype_size(int dtype):
    return 4 if dtype == KTFP8_F32 else 2


cdef void *c_buffer(object a, Py_ssize_t nbytes, str name, bint writeable=False) except NULL:
    """The data of array `a`, checked to be a C-contiguous ndarray of exactly nbytes bytes (and
    writeable when asked): the callers validated it already; this keeps a mistake from reading or
    writing past its end."""
    if not isinstance(a, cnp.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        raise ValueError(f"{name} must be C-contiguous")
    if cnp.PyArray_NBYTES(arr) != nbytes:
        raise ValueError(f"{name} holds {cnp.PyArray_NBYTES(arr)} bytes, expected {nbytes}")
    if writeable and not cnp.PyArray_ISWRITEABLE(arr):
        raise ValueError(f"{name} must be writeable")
    return cnp.PyArray_DATA(arr)
