/* AVX2 + FMA + F16C MoE micro-kernel (Haswell / Zen and later).
 *
 * Layout: tiles of 16 output rows, K unpacked: [k][16] codes (or bf16), i.e. one 16-byte run of
 * codes per K step, converted to two ymm of 8 FP32 rows each.  FP32 FMA accumulation.
 *
 * FP8 -> FP32 without a table: code -> IEEE half bits -> vcvtph2ps, value / 256 (e4m3_f16.h); the
 * packer folds the 256 into the scales (scale_mul) and gives rows holding a NaN code a NaN scale.
 *
 * Decode (few tokens): stream the codes once, convert in registers, K unrolled so enough
 * independent accumulators hide the FMA latency.  Prefill (many tokens): convert the tile once into
 * scratch as FP32 and sweep it for every block of 6 tokens (12 accumulators). */
#include "ktfp8/abi.h"
#include "ktfp8/e4m3_f16.h"
#include "ktfp8/simd.h"
#include "ktfp8/variant.h"

#define NB 16
#define MT_MAX 6          /* tokens per register block in the prefill sweep */
#define PREFETCH_K 128    /* codes prefetched 128 K steps (2 KiB) ahead: best of 16..512 here */
#define SCRATCH_MIN_M 5   /* from this many tokens on, converting the tile once pays off */

enum wsrc { W_FP8, W_BF16, W_F32 };

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* 16 weights of one K step as two vectors of 8 rows. */
ALWAYS_INLINE void load_w(enum wsrc src, const void *w, int64_t k, __m256 *lo, __m256 *hi) {
    if (src == W_FP8) {
        __m128i c = _mm_loadu_si128((const __m128i *)((const uint8_t *)w + k * NB));
        __m256i h = ktfp8_e4m3x16_to_f16(c);
        *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else if (src == W_BF16) {
        const __m128i *p = (const __m128i *)((const uint16_t *)w + k * NB);
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
        *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1)), 16));
    } else {
        const float *p = (const float *)w + k * NB;
        *lo = _mm256_load_ps(p);
        *hi = _mm256_load_ps(p + 8);
    }
}

/* C rows m0 .. m0+MT-1 of the tile.  U independent accumulator sets per token run over
 * interleaved K steps (U > 1 only where MT is too small to hide the FMA latency). */
ALWAYS_INLINE void block(const ktfp8_tile_job *j, enum wsrc src, const void *w, int64_t m0, int MT, int U) {
    /* Token t's row is (t < 3 ? a03 : a36)[(t % 3) * stride + k]: two pointers and one index
     * register give base + index * {0, 4, 8} addressing, so no broadcast needs its own lea. */
    const int64_t stride = j->a_stride;
    const float *a03 = (const float *)j->a + m0 * stride, *a36 = a03 + 3 * stride;
#define ROW(t) ((t) < 3 ? a03 + ((t) % 3) * stride : a36 + ((t) % 3) * stride)
    const int blockwise = j->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t nkb = blockwise ? j->n_kblocks : 1;
    __m256 total[MT_MAX][2];
    for (int t = 0; t < MT; t++) total[t][0] = total[t][1] = _mm256_setzero_ps();

    for (int64_t kb = 0; kb < nkb; kb++) {
        const int64_t k0 = blockwise ? kb * j->block_k : 0;
        const int64_t k1 = kb == nkb - 1 ? j->k : k0 + j->block_k;
        __m256 acc[4][MT_MAX][2];
        for (int u = 0; u < U; u++)
            for (int t = 0; t < MT; t++) acc[u][t][0] = acc[u][t][1] = _mm256_setzero_ps();
        int64_t k = k0;
        for (; k + U <= k1; k += U) {
            /* FP8 codes stream from DRAM; the hardware prefetcher alone left decode at ~50 % of the
             * bus here.  (BF16, twice the bytes per FMA, measured faster without.) */
            if (src == W_FP8)
                _mm_prefetch((const char *)w + (k + PREFETCH_K) * NB, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int u = 0; u < U; u++) {
                __m256 wl, wh;
                load_w(src, w, k + u, &wl, &wh);
#pragma GCC unroll 6
                for (int t = 0; t < MT; t++) {
                    __m256 x = _mm256_broadcast_ss(ROW(t) + k + u);
                    acc[u][t][0] = _mm256_fmadd_ps(x, wl, acc[u][t][0]);
                    acc[u][t][1] = _mm256_fmadd_ps(x, wh, acc[u][t][1]);
                }
            }
        }
        for (; k < k1; k++) { /* block edges that are not a multiple of U */
            __m256 wl, wh;
            load_w(src, w, k, &wl, &wh);
            for (int t = 0; t < MT; t++) {
                __m256 x = _mm256_broadcast_ss(ROW(t) + k);
                acc[0][t][0] = _mm256_fmadd_ps(x, wl, acc[0][t][0]);
                acc[0][t][1] = _mm256_fmadd_ps(x, wh, acc[0][t][1]);
            }
        }
        for (int u = 1; u < U; u++)
            for (int t = 0; t < MT; t++) {
                acc[0][t][0] = _mm256_add_ps(acc[0][t][0], acc[u][t][0]);
                acc[0][t][1] = _mm256_add_ps(acc[0][t][1], acc[u][t][1]);
            }
        if (j->format == KTFP8_FMT_BF16) {
            for (int t = 0; t < MT; t++) {
                total[t][0] = acc[0][t][0];
                total[t][1] = acc[0][t][1];
            }
        } else { /* the scale factors out of the K sum: applied once per block (per-channel: once) */
            const __m256 s_lo = _mm256_loadu_ps(j->scale + kb * NB), s_hi = _mm256_loadu_ps(j->scale + kb * NB + 8);
            for (int t = 0; t < MT; t++) {
                total[t][0] = _mm256_fmadd_ps(acc[0][t][0], s_lo, total[t][0]);
                total[t][1] = _mm256_fmadd_ps(acc[0][t][1], s_hi, total[t][1]);
            }
        }
    }
    for (int t = 0; t < MT; t++) {
        float *c = j->c + (m0 + t) * j->c_stride;
        _mm256_storeu_ps(c, total[t][0]);
        _mm256_storeu_ps(c + 8, total[t][1]);
    }
}

/* Rows m0.. of C, in blocks of up to MT_MAX tokens; constant MT/U let the compiler keep the
 * accumulators in registers. */
ALWAYS_INLINE void sweep(const ktfp8_tile_job *j, enum wsrc src, const void *w) {
    int64_t m = 0;
    for (; m + MT_MAX <= j->m; m += MT_MAX) block(j, src, w, m, MT_MAX, 1);
    switch (j->m - m) {
    case 5: block(j, src, w, m, 5, 1); break;
    case 4: block(j, src, w, m, 4, 1); break;
    case 3: block(j, src, w, m, 3, 2); break;
    case 2: block(j, src, w, m, 2, 2); break;
    case 1: block(j, src, w, m, 1, 4); break;
    default: break;
    }
}

static void fp8_tile_to_f32(const uint8_t *codes, int64_t k, float *out) {
    for (int64_t i = 0; i < k; i++) {
        __m256 lo, hi;
        _mm_prefetch((const char *)codes + (i + PREFETCH_K) * NB, _MM_HINT_T0);
        load_w(W_FP8, codes, i, &lo, &hi);
        _mm256_store_ps(out + i * NB, lo);
        _mm256_store_ps(out + i * NB + 8, hi);
    }
}

static void tile_matmul(const ktfp8_tile_job *j) {
    if (j->format == KTFP8_FMT_BF16) {
        sweep(j, W_BF16, j->w); /* a shift per weight: cheap enough to redo per token block */
    } else if (j->m >= SCRATCH_MIN_M) {
        fp8_tile_to_f32((const uint8_t *)j->w, j->k, (float *)j->scratch);
        sweep(j, W_F32, j->scratch);
    } else {
        sweep(j, W_FP8, j->w);
    }
}

static size_t scratch_bytes(int64_t k) { return (size_t)k * NB * sizeof(float); }

const ktfp8_moe_kernel KTFP8_SYM(ktfp8_moe) = {
    .layout = {.rows_per_tile = NB, .k_pack = 1, .scale_mul = 256.0f, .shuffle64 = 0},
    .act_dtype = KTFP8_F32,
    .tile_scratch_bytes = scratch_bytes,
    .tile_matmul = tile_matmul,
};
