# FP8 codec seam (fp8_codec.h).  Arguments arrive validated from ktfp8.fp8: C-contiguous, non-empty
# arrays; float inputs as float32 or uint16 bit patterns with their dtype code (0 f32, 1 bf16,
# 2 f16), codes as uint8, scales as float32.

from libc.stdint cimport int64_t, uint8_t
import numpy as np

cdef extern from "ktfp8/fp8_codec.h":
    void ktfp8_encode(const ktfp8_codec_ops *ops, const void *src, int dtype, int64_t n, uint8_t *codes,
                      int threads) nogil
    void ktfp8_decode(const ktfp8_codec_ops *ops, const uint8_t *codes, int64_t n, void *dst, int dtype,
                      int threads) nogil
    void ktfp8_quantize_blocks(const ktfp8_codec_ops *ops, const void *src, int dtype, int64_t mats,
                               int64_t rows, int64_t cols, int64_t bn, int64_t bk, uint8_t *codes,
                               float *scale, int threads) nogil
    void ktfp8_dequantize_blocks(const ktfp8_codec_ops *ops, const uint8_t *codes, int64_t mats,
                                 int64_t rows, int64_t cols, int64_t bn, int64_t bk, const float *scale,
                                 void *dst, int dtype, int threads) nogil


def codec_encode(str backend, src, int dtype, codes, int threads):
    """codes[...] = e4m3(src[...]); src and codes of the same size."""
    cdef const ktfp8_codec_ops *ops = variant_by_name(backend).codec
    cdef const uint8_t[::1] s = src.reshape(-1).view(np.uint8)
    cdef uint8_t[::1] c = codes.reshape(-1)
    with nogil:
        ktfp8_encode(ops, &s[0], dtype, c.shape[0], &c[0], threads)


def codec_decode(str backend, codes, dst, int dtype, int threads):
    """dst[...] = decode(codes[...]); dst float32 (dtype 0) or uint16 bf16 bits (dtype 1)."""
    cdef const ktfp8_codec_ops *ops = variant_by_name(backend).codec
    cdef const uint8_t[::1] c = codes.reshape(-1)
    cdef uint8_t[::1] d = dst.reshape(-1).view(np.uint8)
    with nogil:
        ktfp8_decode(ops, &c[0], c.shape[0], &d[0], dtype, threads)


def codec_quantize_blocks(str backend, src, int dtype, tuple dims, codes, scale, int threads):
    """dims = (mats, rows, cols, bn, bk); fills codes [mats, rows, cols] and scale
    [mats, ceil(rows / bn), ceil(cols / bk)]."""
    cdef const ktfp8_codec_ops *ops = variant_by_name(backend).codec
    cdef int64_t mats, rows, cols, bn, bk
    mats, rows, cols, bn, bk = dims
    cdef const uint8_t[::1] s = src.reshape(-1).view(np.uint8)
    cdef uint8_t[::1] c = codes.reshape(-1)
    cdef float[::1] sc = scale.reshape(-1)
    with nogil:
        ktfp8_quantize_blocks(ops, &s[0], dtype, mats, rows, cols, bn, bk, &c[0], &sc[0], threads)


def codec_dequantize_blocks(str backend, codes, scale, tuple dims, dst, int dtype, int threads):
    """dims = (mats, rows, cols, bn, bk); dst [mats, rows, cols] float32 (dtype 0) or uint16 bf16
    bits (dtype 1) = decode(codes) * scale of the block."""
    cdef const ktfp8_codec_ops *ops = variant_by_name(backend).codec
    cdef int64_t mats, rows, cols, bn, bk
    mats, rows, cols, bn, bk = dims
    cdef const uint8_t[::1] c = codes.reshape(-1)
    cdef const float[::1] sc = scale.reshape(-1)
    cdef uint8_t[::1] d = dst.reshape(-1).view(np.uint8)
    with nogil:
        ktfp8_dequantize_blocks(ops, &c[0], mats, rows, cols, bn, bk, &sc[0], &d[0], dtype, threads)
