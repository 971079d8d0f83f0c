/* The skeleton of a vector FP8 codec unit: the step loop, the tail, the dtype switch and the
 * exported ktfp8_codec_ops table.  fp8_codec_avx2.c and fp8_codec_avx512.c hold only their vector
 * steps and include this last.  Before including it a unit defines:
 *
 *   enum { CODEC_STEP = n };   values per step
 *   codec_scale                the scale in a vector: codec_scale codec_broadcast(float scale)
 *   codec_amax_acc             a running max of finite |v| over steps:
 *                                codec_amax_zero(codec_amax_acc *), codec_amax_step(codec_amax_acc *, src, dtype, i),
 *                                float codec_amax_value(const codec_amax_acc *)
 *   codec_quantize_step(src, dtype, i, codec_scale, int divide, uint8_t *codes)
 *                              codes[i .. i + n) from src[i .. i + n); divide: scale != 1
 *   codec_dequantize_step(codes, i, codec_scale, dst, dtype)
 *                              dst[i .. i + n) from codes[i .. i + n)
 * each `static inline __attribute__((always_inline))`, so that the dtype of each specialised loop
 * below is a constant in the vector code.
 *
 * A tail shorter than a step goes through the same vector step via a zero-padded stack buffer, so
 * every value takes the vector path (zero padding never raises a max).  Like the reference
 * (division, nearbyintf), the steps rely on the FPU's default round-to-nearest-even mode. */
#ifndef KTFP8_CODEC_SKELETON_H
#define KTFP8_CODEC_SKELETON_H

#include <string.h>

#include "ktfp8/abi.h"
#include "ktfp8/variant.h"

static inline size_t codec_elem_size(int dtype) { return dtype == KTFP8_F32 ? 4 : 2; }

static inline __attribute__((always_inline)) void codec_quantize_run(const void *src, int dtype, size_t n,
                                                                     float scale, uint8_t *codes) {
    const codec_scale s = codec_broadcast(scale);
    const int divide = scale != 1.0f; /* v / 1 == v, bit for bit */
    size_t i = 0;
    for (; i + CODEC_STEP <= n; i += CODEC_STEP) codec_quantize_step(src, dtype, i, s, divide, codes);
    if (i < n) {
        const size_t esize = codec_elem_size(dtype), rest = n - i;
        float in[CODEC_STEP] = {0}; /* room for CODEC_STEP values of any input dtype */
        uint8_t out[CODEC_STEP];
        memcpy(in, (const char *)src + i * esize, rest * esize);
        codec_quantize_step(in, dtype, 0, s, divide, out);
        memcpy(codes + i, out, rest);
    }
}

static inline __attribute__((always_inline)) float codec_amax_run(const void *src, int dtype, size_t n) {
    codec_amax_acc acc;
    codec_amax_zero(&acc);
    size_t i = 0;
    for (; i + CODEC_STEP <= n; i += CODEC_STEP) codec_amax_step(&acc, src, dtype, i);
    if (i < n) {
        const size_t esize = codec_elem_size(dtype);
        float in[CODEC_STEP] = {0};
        memcpy(in, (const char *)src + i * esize, (n - i) * esize);
        codec_amax_step(&acc, in, dtype, 0);
    }
    return codec_amax_value(&acc);
}

static inline __attribute__((always_inline)) void codec_dequantize_run(const uint8_t *codes, size_t n, float scale,
                                                                       void *dst, int dtype) {
    const codec_scale s = codec_broadcast(scale);
    size_t i = 0;
    for (; i + CODEC_STEP <= n; i += CODEC_STEP) codec_dequantize_step(codes, i, s, dst, dtype);
    if (i < n) {
        const size_t esize = codec_elem_size(dtype), rest = n - i;
        uint8_t in[CODEC_STEP] = {0};
        float out[CODEC_STEP];
        memcpy(in, codes + i, rest);
        codec_dequantize_step(in, 0, s, out, dtype);
        memcpy((char *)dst + i * esize, out, rest * esize);
    }
}

/* one specialised loop per element type */

static float codec_amax(const void *src, int dtype, size_t n) {
    switch (dtype) {
    case KTFP8_BF16: return codec_amax_run(src, KTFP8_BF16, n);
    case KTFP8_F16: return codec_amax_run(src, KTFP8_F16, n);
    default: return codec_amax_run(src, KTFP8_F32, n);
    }
}

static void codec_quantize(const void *src, int dtype, size_t n, float scale, uint8_t *codes) {
    switch (dtype) {
    case KTFP8_BF16: codec_quantize_run(src, KTFP8_BF16, n, scale, codes); break;
    case KTFP8_F16: codec_quantize_run(src, KTFP8_F16, n, scale, codes); break;
    default: codec_quantize_run(src, KTFP8_F32, n, scale, codes); break;
    }
}

static void codec_dequantize(const uint8_t *codes, size_t n, float scale, void *dst, int dtype) {
    if (dtype == KTFP8_BF16)
        codec_dequantize_run(codes, n, scale, dst, KTFP8_BF16);
    else
        codec_dequantize_run(codes, n, scale, dst, KTFP8_F32);
}

const ktfp8_codec_ops KTFP8_SYM(ktfp8_codec) = {codec_amax, codec_quantize, codec_dequantize};

#endif
