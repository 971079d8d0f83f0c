/* FP8 E4M3 codec over whole arrays (fp8_codec.c, baseline flags).
 *
 * These functions walk arrays, rows and blocks, spread the work over OpenMP threads and call one
 * variant's ktfp8_codec_ops (abi.h) for every contiguous run, so every variant inherits the same
 * scale rule and the same block geometry.  Arrays are C-contiguous; element counts and sizes are
 * positive except where noted.  Results do not depend on the thread count. */
#ifndef KTFP8_FP8_CODEC_H
#define KTFP8_FP8_CODEC_H

#include "ktfp8/abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The scale of a row or block whose largest finite |w| is amax: amax / 448; 1 when amax is 0
 * (nothing finite and nonzero to scale).  When amax / 448 underflows to 0 (amax < 448 * 2^-150)
 * the smallest positive float is used instead, so w / scale stays finite and within +-448. */
float ktfp8_scale_from_amax(float amax);

/* codes[i] = e4m3(src[i]), no scaling.  src: n values of dtype (enum ktfp8_dtype); n may be 0. */
void ktfp8_encode(const ktfp8_codec_ops *ops, const void *src, int dtype, int64_t n, uint8_t *codes,
                  int threads);

/* dst[i] = decode(codes[i]) stored as dtype (KTFP8_F32 or KTFP8_BF16, exact); n may be 0. */
void ktfp8_decode(const ktfp8_codec_ops *ops, const uint8_t *codes, int64_t n, void *dst, int dtype,
                  int threads);

/* Block-wise quantization of `mats` matrices [rows, cols] (src and codes: [mats][rows][cols]).
 * Block (i, j) covers rows [i*bn, (i+1)*bn) and columns [j*bk, (j+1)*bk), cut at the matrix edge.
 * scale: [mats][ceil(rows/bn)][ceil(cols/bk)], scale = ktfp8_scale_from_amax(block amax), and
 * codes = e4m3(clip(w / scale, -448, 448)) (DeepSeek-V3 weight_scale_inv: w ~ code * scale).
 * Per-channel quantization is the case bn = 1, bk = cols. */
void ktfp8_quantize_blocks(const ktfp8_codec_ops *ops, const void *src, int dtype, int64_t mats,
                           int64_t rows, int64_t cols, int64_t bn, int64_t bk, uint8_t *codes,
                           float *scale, int threads);

/* dst = decode(codes) * scale of the block, the inverse walk of ktfp8_quantize_blocks; dst in
 * dtype KTFP8_F32 or KTFP8_BF16 (the FP32 product rounded to nearest even). */
void ktfp8_dequantize_blocks(const ktfp8_codec_ops *ops, const uint8_t *codes, int64_t mats,
                             int64_t rows, int64_t cols, int64_t bn, int64_t bk, const float *scale,
                             void *dst, int dtype, int threads);

#ifdef __cplusplus
}
#endif
#endif
