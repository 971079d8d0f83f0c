/* MoE micro-kernel for AVX-512 F/BW/VL + BF16 + VBMI (Cooper Lake, Sapphire Rapids, Zen 4/5).
 *
 * One call: C[m][16] = (A[m][k] x W^T) * scale for one 16-row tile, A in bf16, FP32 accumulation
 * with vdpbf16ps.  Weights [k/2][16][2]: one zmm holds K pair p of all 16 rows, so one
 * activation pair (a[2p], a[2p+1]) broadcast as a 32-bit lane multiplies a whole tile row:
 *   acc[n] += a[2p] * w[n][2p] + a[2p+1] * w[n][2p+1]      (vdpbf16ps, lane n)
 * FP8 codes are stored permuted inside 64-byte groups (shuffle64) so that e4m3_bf16_vbmi.h turns
 * 64 codes into the two bf16 zmm of pairs 2g and 2g+1 in natural order.
 *
 * Decode (m <= DECODE_M): memory-bound, so the codes stream once and are converted in registers;
 * four independent accumulators per token hide the vdpbf16ps latency.  Prefill (m > DECODE_M):
 * the tile is converted once into scratch (bf16 [k/2][16][2]) and reused by every token, MR tokens
 * per pass so that each loaded weight vector feeds MR vdpbf16ps.
 *
 * Scales: per-channel once after the whole K reduction; block-wise per K block (block b covers
 * pairs [b * block_k / 2, (b + 1) * block_k / 2), the last one runs on to k); BF16 weights none. */
#include <string.h>

#include "ktfp8/abi.h"
#include "ktfp8/moe_epilogue.h"
#include "ktfp8/e4m3_bf16_vbmi.h"
#include "ktfp8/simd.h"
#include "ktfp8/token_count.h"
#include "ktfp8/variant.h"

#define NB 16       /* rows per tile: one zmm of fp32 outputs */
#define DECODE_M 4  /* tokens up to which codes are converted in registers on the fly */
#define MR 8        /* prefill register block: tokens per pass over the converted tile */
/* Software prefetch distance of the FP8 code stream.  Measured on the AMX Xeon with a stand-alone
 * FP8 GEMV (2 threads, from DRAM): no prefetch 11.3 GB/s, 1 KiB ahead 13.8, 2 KiB 16.8, 4 KiB 18.4
 * (read bandwidth 23.4): the hardware prefetchers alone leave the bus half idle.  2 KiB rather
 * than 4: a down-projection tile is only 12 KiB (K = 768), and what runs past a tile's end is
 * wasted. */
#define PREFETCH_BYTES 2048

#define INLINE static inline __attribute__((always_inline))

/* bf16 pair (a[2p], a[2p+1]) of one activation row, in every 32-bit lane (vpbroadcastd m32). */
INLINE __m512i bcast_pair(const uint16_t *row, int64_t p) {
    uint32_t v;
    memcpy(&v, row + 2 * p, sizeof(v));
    return _mm512_set1_epi32((int)v);
}

#ifdef KTFP8_EMULATE_SIMD
/* SIMDe's vdpbf16ps is a 32-step scalar loop; kept out of line so the emulated build compiles in
 * seconds rather than minutes.  Same operation. */
static __attribute__((noinline)) void dpbf16_emulated(__m512 *acc, const __m512i *w, const __m512i *a) {
    *acc = _mm512_dpbf16_ps(*acc, (__m512bh)*w, (__m512bh)*a);
}
INLINE __m512 dpbf16(__m512 acc, __m512i w, __m512i a) {
    dpbf16_emulated(&acc, &w, &a);
    return acc;
}
#define DPBF16(acc, w, a) dpbf16((acc), (w), (a))
#else
#define DPBF16(acc, w, a) _mm512_dpbf16_ps((acc), (__m512bh)(w), (__m512bh)(a))
#endif

/* sum[i] = sum over pairs [p0, p1) of token i, weights converted from FP8 codes on the fly.
 * A block may start or end in the middle of a 64-byte group (block_k = 2 mod 4).
 * Four accumulators per token (one per pair slot of a step) up to 3 tokens; at 4 tokens two
 * each (8 chains still cover the latency, 16 would not fit beside the tables and weights). */
INLINE void dot_fp8_stream(const uint8_t *codes, const uint16_t *a, int64_t a_stride, const int M,
                           int64_t p0, int64_t p1, const ktfp8_e4m3_bf16_lut *lut, __m512 *sum) {
    const int Q = M <= 3 ? 3 : 1; /* slot q uses accumulator q & Q */
    __m512 acc[DECODE_M][4];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        for (int q = 0; q < 4; q++) acc[i][q] = _mm512_setzero_ps();
    int64_t p = p0;
    __m512i w0, w1, w2, w3;
    if (p & 1) { /* second pair of a group */
        ktfp8_e4m3x64_to_bf16(lut, codes + 32 * (p - 1), &w0, &w1);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) acc[i][1] = DPBF16(acc[i][1], w1, bcast_pair(a + i * a_stride, p));
        p++;
    }
    /* two groups = four pairs = two cache lines per step */
    for (; p + 4 <= p1; p += 4) {
        _mm_prefetch((const char *)codes + 32 * p + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)codes + 32 * p + 64 + PREFETCH_BYTES, _MM_HINT_T0);
        ktfp8_e4m3x64_to_bf16(lut, codes + 32 * p, &w0, &w1);
        ktfp8_e4m3x64_to_bf16(lut, codes + 32 * p + 64, &w2, &w3);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const uint16_t *row = a + i * a_stride;
            acc[i][0] = DPBF16(acc[i][0], w0, bcast_pair(row, p));
            acc[i][1] = DPBF16(acc[i][1], w1, bcast_pair(row, p + 1));
            acc[i][2 & Q] = DPBF16(acc[i][2 & Q], w2, bcast_pair(row, p + 2));
            acc[i][3 & Q] = DPBF16(acc[i][3 & Q], w3, bcast_pair(row, p + 3));
        }
    }
    for (; p < p1; p += 2) { /* 1 to 3 pairs left, p at the start of a group */
        ktfp8_e4m3x64_to_bf16(lut, codes + 32 * p, &w0, &w1);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            acc[i][0] = DPBF16(acc[i][0], w0, bcast_pair(a + i * a_stride, p));
            if (p + 1 < p1) acc[i][1] = DPBF16(acc[i][1], w1, bcast_pair(a + i * a_stride, p + 1));
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        __m512 t = _mm512_add_ps(acc[i][0], acc[i][1]);
        if (Q == 3) t = _mm512_add_ps(t, _mm512_add_ps(acc[i][2], acc[i][3]));
        sum[i] = t;
    }
}

/* Same over bf16 weights [pairs][16][2] already in memory (BF16 weights, or the prefill scratch).
 * U independent accumulators per token: 4 for few tokens (latency), 2 for a full MR block
 * (registers: MR * 2 accumulators + MR block-wise results must fit in 32 zmm). */
INLINE void dot_bf16(const uint16_t *w, const uint16_t *a, int64_t a_stride, const int M, int64_t p0,
                     int64_t p1, __m512 *sum) {
    enum { UMAX = 4 };
    const int U = M <= DECODE_M ? 4 : 2;
    __m512 acc[MR][UMAX];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
        for (int q = 0; q < UMAX; q++) acc[i][q] = _mm512_setzero_ps();
    int64_t p = p0;
    for (; p + U <= p1; p += U) {
#pragma GCC unroll 4
        for (int q = 0; q < U; q++) {
            const __m512i wq = _mm512_loadu_si512((const void *)(w + 32 * (p + q)));
#pragma GCC unroll 8
            for (int i = 0; i < M; i++)
                acc[i][q] = DPBF16(acc[i][q], wq, bcast_pair(a + i * a_stride, p + q));
        }
    }
    for (; p < p1; p++) {
        const __m512i wq = _mm512_loadu_si512((const void *)(w + 32 * p));
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[i][0] = DPBF16(acc[i][0], wq, bcast_pair(a + i * a_stride, p));
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
        __m512 s = _mm512_add_ps(acc[i][0], acc[i][1]);
        if (U > 2) s = _mm512_add_ps(s, _mm512_add_ps(acc[i][2], acc[i][3]));
        sum[i] = s;
    }
}

/* M tokens starting at row a: the K reduction block by block, scaled, stored to c.
 * w points at FP8 codes when fp8_stream, else at bf16 pairs. */
INLINE void tile_rows(const ktfp8_tile_job *j, const void *w, int fp8_stream, const uint16_t *a, float *c,
                      const int M, const ktfp8_e4m3_bf16_lut *lut) {
    const int64_t pairs = j->k / 2;
    const int blockwise = j->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t nkb = blockwise ? j->n_kblocks : 1, block_pairs = blockwise ? j->block_k / 2 : pairs;
    __m512 res[MR], sum[MR];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) res[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nkb; b++) {
        const int64_t p0 = b * block_pairs, p1 = b == nkb - 1 ? pairs : p0 + block_pairs;
        if (fp8_stream)
            dot_fp8_stream((const uint8_t *)w, a, j->a_stride, M, p0, p1, lut, sum);
        else
            dot_bf16((const uint16_t *)w, a, j->a_stride, M, p0, p1, sum);
        if (j->format == KTFP8_FMT_BF16) {
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) res[i] = sum[i];
        } else {
            const __m512 s = _mm512_loadu_ps(j->scale + b * NB);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) res[i] = _mm512_fmadd_ps(sum[i], s, res[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) _mm512_storeu_ps(c + i * j->c_stride, res[i]);
}

static void tile_matmul(const ktfp8_tile_job *j) {
    const uint16_t *a = (const uint16_t *)j->a;
    ktfp8_e4m3_bf16_lut lut;
    ktfp8_e4m3_bf16_lut_load(&lut);
    if (j->m <= 0) return;
    if (j->m <= DECODE_M) {
        const int fp8_stream = j->format != KTFP8_FMT_BF16;
#define DECODE(M_) tile_rows(j, j->w, fp8_stream, a, j->c, M_, &lut)
        KTFP8_FOR_M4(j->m, DECODE)
#undef DECODE
        return;
    }
    const void *w = j->w;
    if (j->format != KTFP8_FMT_BF16) { /* convert once, reuse for all m tokens */
        ktfp8_e4m3_tile_to_bf16((const uint8_t *)j->w, j->k, (uint16_t *)j->scratch);
        w = j->scratch;
    }
    for (int64_t i0 = 0; i0 < j->m; i0 += MR) {
        const int64_t rows = j->m - i0 < MR ? j->m - i0 : MR;
        const uint16_t *ai = a + i0 * j->a_stride;
        float *ci = j->c + i0 * j->c_stride;
#define PREFILL(M_) tile_rows(j, w, 0, ai, ci, M_, &lut)
        KTFP8_FOR_M8(rows, PREFILL)
#undef PREFILL
    }
}

/* bf16 [k/2][16][2] copy of one FP8 tile, for the prefill path. */
static size_t tile_scratch_bytes(int64_t k) { return (size_t)k * NB * sizeof(uint16_t); }

KTFP8_EPILOGUE_OPS(epilogue);

const ktfp8_moe_kernel KTFP8_SYM(ktfp8_moe) = {
    .layout = {.rows_per_tile = NB, .k_pack = 2, .scale_mul = 1.0f, .shuffle64 = 1},
    .act_dtype = KTFP8_BF16,
    .tile_scratch_bytes = tile_scratch_bytes,
    .tile_matmul = tile_matmul,
    .epilogue = &epilogue,
};
