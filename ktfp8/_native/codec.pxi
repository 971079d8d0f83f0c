# FP8 codec seam (fp8_codec.h).  Arguments arrive validated from ktfp8.fp8: C-contiguous arrays;
# float inputs as float32 or uint16 bit patterns with their enum ktfp8_dtype, codes as uint8,
# scales as float32.  Sizes are checked once more against the counts (c_buffer).

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


def codec_encode(Variant variant, src, int dtype, codes, int threads):
    """codes[...] = e4m3(src[...]); src (dtype) and codes (uint8) of the same element count."""
    cdef const ktfp8_codec_ops *ops = runnable(variant).codec
    cdef int64_t n = cnp.PyArray_SIZE(codes) if isinstance(codes, cnp.ndarray) else 0
    cdef const void *s = c_buffer(src, n * dtype_size(dtype), "src")
    cdef uint8_t *c = <uint8_t *>c_buffer(codes, n, "codes", True)
    with nogil:
        ktfp8_encode(ops, s, dtype, n, c, threads)


def codec_decode(Variant variant, codes, dst, int dtype, int threads):
    """dst[...] = decode(codes[...]); dst float32 (KTFP8_F32) or uint16 bf16 bits (KTFP8_BF16)."""
    cdef const ktfp8_codec_ops *ops = runnable(variant).codec
    cdef int64_t n = cnp.PyArray_SIZE(codes) if isinstance(codes, cnp.ndarray) else 0
    cdef const uint8_t *c = <const uint8_t *>c_buffer(codes, n, "codes")
    cdef void *d = c_buffer(dst, n * dtype_size(dtype), "dst", True)
    with nogil:
        ktfp8_decode(ops, c, n, d, dtype, threads)


cdef int64_t blocks(int64_t n, int64_t edge):
    return (n + edge - 1) // edge


def codec_quantize_blocks(Variant variant, src, int dtype, tuple dims, codes, scale, int threads):
    """dims = (mats, rows, cols, bn, bk); fills codes [mats, rows, cols] and scale
    [mats, ceil(rows / bn), ceil(cols / bk)]."""
    cdef const ktfp8_codec_ops *ops = runnable(variant).codec
    cdef int64_t mats, rows, cols, bn, bk
    mats, rows, cols, bn, bk = dims
    cdef int64_t n = mats * rows * cols
    cdef const void *s = c_buffer(src, n * dtype_size(dtype), "src")
    cdef uint8_t *c = <uint8_t *>c_buffer(codes, n, "codes", True)
    cdef float *sc = <float *>c_buffer(scale, 4 * mats * blocks(rows, bn) * blocks(cols, bk), "scale", True)
    with nogil:
        ktfp8_quantize_blocks(ops, s, dtype, mats, rows, cols, bn, bk, c, sc, threads)


def codec_dequantize_blocks(Variant variant, codes, scale, tuple dims, dst, int dtype, int threads):
    """dims = (mats, rows, cols, bn, bk); dst [mats, rows, cols] float32 (KTFP8_F32) or uint16 bf16
    bits (KTFP8_BF16) = decode(codes) * scale of the block."""
    cdef const ktfp8_codec_ops *ops = runnable(variant).codec
    cdef int64_t mats, rows, cols, bn, bk
    mats, rows, cols, bn, bk = dims
    cdef int64_t n = mats * rows * cols
    cdef const uint8_t *c = <const uint8_t *>c_buffer(codes, n, "codes")
    cdef const float *sc = <const float *>c_buffer(scale, 4 * mats * blocks(rows, bn) * blocks(cols, bk), "scale")
    cdef void *d = c_buffer(dst, n * dtype_size(dtype), "dst", True)
    with nogil:
        ktfp8_dequantize_blocks(ops, c, mats, rows, cols, bn, bk, sc, d, dtype, threads)
