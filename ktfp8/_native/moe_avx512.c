/* MoE micro-kernel for AVX-512 F/BW/VL without BF16 or VBMI (Skylake-X, Cascade Lake class).
 *
 * One call: C[m][16] = (A[m][k] x W^T) * scale for one 16-row tile, A in fp32, FP32 FMA.
 * Weights [k][16]: the 16 bytes (or bf16 words) of K step s are one tile row, so one broadcast
 * activation a[s] times that row, converted to fp32, updates all 16 outputs:
 *   acc[n] += a[s] * w[n][s]                                  (vfmadd231ps, lane n)
 *
 * FP8 -> fp32 without a byte table, exact: code -> fp16 bits -> vcvtph2ps, the E4M3 value / 256
 * (e4m3_f16.h).  The factor 256 is folded into the packed scales (layout.scale_mul); NaN codes
 * become finite, but their rows carry a NaN scale (moe_pack.c), so outputs are NaN exactly as the
 * reference's.  BF16 weights have no scale: their bits << 16 are the fp32 value.
 *
 * Decode (m <= DECODE_M): codes stream once (prefetched into L2 and L1, PREFETCH_L2_BYTES and
 * PREFETCH_L1_BYTES ahead), converted in registers, four accumulators per token for the FMA
 * latency.  Prefill: MR tokens per pass; the first pass streams the weights in the same way and,
 * when more passes follow, stores each converted row into scratch (fp32 [k][16]), which the later
 * passes reuse.  (The avx2 kernel measured a separate conversion pass at a quarter of a T = 64 call
 * on Zen 3 and this form 0.89-0.91x the time.  Here llvm-mca-16 -mcpu=skylake-avx512 on the
 * compiled loops, cycles per two K steps of a tile with 8 tokens: 4.17 (conversion pass) + 9.61
 * (pass over the scratch) before, 13.81 for the first pass now: the same port time, with the codes
 * arriving while the FMAs run.  Not yet timed on AVX-512 hardware.)
 * Per-channel scale once after the K reduction; block-wise per K block; K ranges are always an
 * even number of steps (k % 32 == 0, block_k even). */
#include <string.h>

#include "ktfp8/abi.h"
#include "ktfp8/moe_epilogue.h"
#include "ktfp8/e4m3_f16.h"
#include "ktfp8/prefetch_ahead.h"
#include "ktfp8/simd.h"
#include "ktfp8/token_count.h"
#include "ktfp8/variant.h"

#define NB 16       /* rows per tile: one zmm of fp32 outputs */
#define DECODE_M 4  /* tokens up to which weights are converted in registers on the fly */
#define MR 8        /* prefill register block: tokens per pass over the converted tile */
/* Software prefetch distances of the FP8 code stream: into L2 8 KiB ahead, into L1 1 KiB ahead
 * (ktfp8_prefetch_two says why both).  Against one prefetcht0 4 KiB ahead
 * (KTFP8_AVX512_PREFETCH_BYTES), tools/ab_builds.py with KTFP8_BACKEND=avx512 on the Emerald Rapids
 * VM (no AVX-512 CPU without BF16 was at hand, so the kernel forced there; benchmark layer, FP8
 * per-channel, 2 threads): T = 1 0.967x and 0.969x (1 thread 0.966x), T = 64 1.000x, T = 512
 * 0.971x; 4 KiB / 1 KiB T = 1 0.989x (1 thread 0.972x), 16 KiB / 1 KiB 0.981x (1 thread 0.974x). */
#define PREFETCH_L2_BYTES 8192
#define PREFETCH_L1_BYTES 1024

#define INLINE static inline __attribute__((always_inline))
_Static_assert(DECODE_M == 4 && MR == 8, "the first prefill pass dispatches with KTFP8_FOR_M5_TO_8");

enum wsrc { SRC_FP8, SRC_BF16, SRC_F32 }; /* what w points at */

/* Codes of K steps s and s+1 (32 bytes) -> two fp32 tile rows holding value / 256. */
KTFP8_INLINE_UNLESS_EMULATED void fp8_rows2(const uint8_t *codes, __m512 *w0, __m512 *w1) {
    const __m512i h = ktfp8_e4m3x32_to_f16(_mm256_loadu_si256((const __m256i *)codes));
    *w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

INLINE __m512 bf16_row(const uint16_t *w) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

/* Tile rows of K steps s and s+1 in fp32. */
INLINE void rows2(const enum wsrc src, const void *w, int64_t s, __m512 *w0, __m512 *w1) {
    if (src == SRC_FP8) {
        fp8_rows2((const uint8_t *)w + NB * s, w0, w1);
    } else if (src == SRC_BF16) {
        *w0 = bf16_row((const uint16_t *)w + NB * s);
        *w1 = bf16_row((const uint16_t *)w + NB * (s + 1));
    } else {
        *w0 = _mm512_loadu_ps((const float *)w + NB * s);
        *w1 = _mm512_loadu_ps((const float *)w + NB * (s + 1));
    }
}

/* sum[i] = sum over K steps [s0, s1) (an even count) of a_i[s] * row s, for M tokens.
 * U independent accumulators per token: 4 for few tokens (FMA latency), 2 for a full MR block
 * (registers: MR * 2 accumulators + MR block-wise results must fit in 32 zmm).  keep: NULL, or
 * where the prefill's first pass (M > DECODE_M, so the U = 2 loop) stores the converted rows, row
 * s at keep + 16 s.  ahead: the FP8 codes' software prefetch. */
INLINE void dot(const enum wsrc src, const void *w, const float *a, int64_t a_stride, const int M,
                int64_t s0, int64_t s1, __m512 *sum, float *keep, const ktfp8_prefetch_two *ahead) {
    enum { UMAX = 4 };
    const int U = M <= DECODE_M ? 4 : 2;
    __m512 acc[MR][UMAX];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
        for (int q = 0; q < UMAX; q++) acc[i][q] = _mm512_setzero_ps();
    __m512 w0, w1, w2, w3;
    int64_t s = s0;
    while (s < s1) { /* in up to three runs, one per pair of prefetch bases of the codes (prefetch_ahead.h) */
        int64_t until;
        uintptr_t far_base, near_base;
        ktfp8_prefetch_two_run(ahead, NB * s, &far_base, &near_base, &until);
        const int64_t stop = ktfp8_prefetch_bound(until, NB, 1, s1);  /* this run's K steps: s < stop */
        const int64_t stop4 = ktfp8_prefetch_bound(until, NB, 4, s1); /* its 4-step groups: s + 4 <= stop4 */
        if (U == 4) {
            for (; s + 4 <= stop4; s += 4) {
                if (src == SRC_FP8) /* 4 K steps = one 64-byte line of codes */
                    ktfp8_prefetch_two_line(far_base, near_base, NB * s);
                rows2(src, w, s, &w0, &w1);
                rows2(src, w, s + 2, &w2, &w3);
#pragma GCC unroll 8
                for (int i = 0; i < M; i++) {
                    const float *row = a + i * a_stride + s;
                    acc[i][0] = _mm512_fmadd_ps(w0, _mm512_set1_ps(row[0]), acc[i][0]);
                    acc[i][1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(row[1]), acc[i][1]);
                    acc[i][2] = _mm512_fmadd_ps(w2, _mm512_set1_ps(row[2]), acc[i][2]);
                    acc[i][3] = _mm512_fmadd_ps(w3, _mm512_set1_ps(row[3]), acc[i][3]);
                }
            }
        }
        for (; s < stop; s += 2) { /* U = 2, or the steps after U = 4's groups */
            if (src == SRC_FP8 && (s & 3) == 0) /* the prefill's first pass streams the codes */
                ktfp8_prefetch_two_line(far_base, near_base, NB * s);
            rows2(src, w, s, &w0, &w1);
            if (keep) {
                _mm512_storeu_ps(keep + NB * s, w0);
                _mm512_storeu_ps(keep + NB * (s + 1), w1);
            }
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                const float *row = a + i * a_stride + s;
                acc[i][0] = _mm512_fmadd_ps(w0, _mm512_set1_ps(row[0]), acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(row[1]), acc[i][1]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
        __m512 t = _mm512_add_ps(acc[i][0], acc[i][1]);
        if (U > 2) t = _mm512_add_ps(t, _mm512_add_ps(acc[i][2], acc[i][3]));
        sum[i] = t;
    }
}

/* M tokens starting at row a: the K reduction block by block, scaled, stored to c (keep: see dot). */
INLINE void tile_rows(const ktfp8_tile_job *j, const enum wsrc src, const void *w, const float *a, float *c,
                      const int M, float *keep) {
    const int blockwise = j->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t nkb = blockwise ? j->n_kblocks : 1, block = blockwise ? j->block_k : j->k;
    const ktfp8_prefetch_two ahead =
        ktfp8_prefetch_two_of(w, j->w_next, j->k * NB, PREFETCH_L2_BYTES, PREFETCH_L1_BYTES);
    __m512 res[MR], sum[MR];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) res[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nkb; b++) {
        const int64_t s0 = b * block, s1 = b == nkb - 1 ? j->k : s0 + block;
        dot(src, w, a, j->a_stride, M, s0, s1, sum, keep, &ahead);
        if (j->format == KTFP8_FMT_BF16) {
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) res[i] = sum[i];
        } else {
            const __m512 scale = _mm512_loadu_ps(j->scale + b * NB);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) res[i] = _mm512_fmadd_ps(sum[i], scale, res[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) _mm512_storeu_ps(c + i * j->c_stride, res[i]);
}

static void tile_matmul(const ktfp8_tile_job *j) {
    const float *a = (const float *)j->a;
    const enum wsrc src = j->format == KTFP8_FMT_BF16 ? SRC_BF16 : SRC_FP8;
    if (j->m <= 0) return;
    if (j->m <= DECODE_M) {
#define DECODE_FP8(M_) tile_rows(j, SRC_FP8, j->w, a, j->c, M_, NULL)
#define DECODE_BF16(M_) tile_rows(j, SRC_BF16, j->w, a, j->c, M_, NULL)
        if (src == SRC_BF16) {
            KTFP8_FOR_M4(j->m, DECODE_BF16)
        } else {
            KTFP8_FOR_M4(j->m, DECODE_FP8)
        }
#undef DECODE_FP8
#undef DECODE_BF16
        return;
    }
    /* first pass from the packed weights (keeping them converted when another pass follows), then
     * from scratch */
    float *keep = j->m > MR ? (float *)j->scratch : NULL;
    for (int64_t i0 = 0; i0 < j->m; i0 += MR) {
        const int64_t rows = j->m - i0 < MR ? j->m - i0 : MR;
        const float *ai = a + i0 * j->a_stride;
        float *ci = j->c + i0 * j->c_stride;
#define FIRST_FP8(M_) tile_rows(j, SRC_FP8, j->w, ai, ci, M_, keep)
#define FIRST_BF16(M_) tile_rows(j, SRC_BF16, j->w, ai, ci, M_, keep)
#define LATER(M_) tile_rows(j, SRC_F32, j->scratch, ai, ci, M_, NULL)
        if (i0 > 0) {
            KTFP8_FOR_M8(rows, LATER)
        } else if (src == SRC_BF16) {
            KTFP8_FOR_M5_TO_8(rows, FIRST_BF16)
        } else {
            KTFP8_FOR_M5_TO_8(rows, FIRST_FP8)
        }
#undef FIRST_FP8
#undef FIRST_BF16
#undef LATER
    }
}

/* fp32 [k][16] copy of one tile, for the prefill path. */
static size_t tile_scratch_bytes(int64_t k) { return (size_t)k * NB * sizeof(float); }

KTFP8_EPILOGUE_OPS(epilogue);

const ktfp8_moe_kernel KTFP8_SYM(ktfp8_moe) = {
    .layout = {.rows_per_tile = NB, .k_pack = 1, .scale_mul = 256.0f, .code_order = KTFP8_CODES_NATURAL},
    .act_dtype = KTFP8_F32,
    .tile_scratch_bytes = tile_scratch_bytes,
    .tile_matmul = tile_matmul,
    .epilogue = &epilogue,
};
