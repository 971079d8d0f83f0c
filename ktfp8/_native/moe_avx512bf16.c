/* MoE micro-kernel for AVX-512 F/BW/VL + BF16 + VBMI (Sapphire Rapids and later, Zen 4/5).
 *
 * One call: C[m][16] = (A[m][k] x W^T) * scale for one 16-row tile, A in bf16, FP32 accumulation
 * with vdpbf16ps.  Weights [k/2][16][2]: one zmm holds K pair p of all 16 rows, so one
 * activation pair (a[2p], a[2p+1]) broadcast as a 32-bit lane multiplies a whole tile row:
 *   acc[n] += a[2p] * w[n][2p] + a[2p+1] * w[n][2p+1]      (vdpbf16ps, lane n)
 * FP8 codes are stored permuted inside 64-byte groups (KTFP8_CODES_VBMI64) so that e4m3_bf16_vbmi.h turns
 * 64 codes into the two bf16 zmm of pairs 2g and 2g+1 in natural order.
 *
 * Every pass takes up to MR tokens (the fewest passes, as even as they go: run_jobs says why) and
 * converts the codes in registers as they stream: the first pass reads them from DRAM, the later
 * ones (m > MR) from L2, where the first left them (64 KiB per tile pair at k = 2048); BF16 weights
 * are read as they are.  Accumulators per token by the height of the pass (CHAINS).  One token against
 * FP8 (decode) reads each tile as two streams instead, its K halves (decode_halves, decode_blocks).
 * Why no converted copy of the tile for the later passes (what this kernel kept in scratch until
 * it was measured): the bf16 copy has twice the bytes of the codes, so a later pass over it moved
 * twice as much from L2, and the first pass stored every converted vector, while on the Zen 5 VM
 * the conversion runs beside vdpbf16ps (an 8-token pass over codes in L2: 439 GFLOP/s, the
 * one-core peak).  Measured there (tools/kernel_ab, one thread, k = 2048, codes from DRAM), time
 * against the kept-copy kernel (a first pass of 4 tokens x 2 tiles keeping both, then 4-token
 * passes over the copies): m = 5 0.58x, 8 0.62x, 9 0.68x, 12 0.78x, 16 0.76x, 32 0.87x, 64 0.96x;
 * hot in L2, m = 64 1.00x.  The benchmark layer on 2 threads: T = 64 0.77x-0.83x, T = 512
 * 0.98x-1.00x.  On Sapphire Rapids vpermi2b shares port 5 with the second 512-bit FMA; m >= AMX_MIN_M
 * goes to moe_amx.c there, and for m = 5..7 llvm-mca-14 -mcpu=sapphirerapids gives the compiled
 * 8-token loop 44 cycles per 4 K pairs of both tiles (1.38 per token and K pair; 0.69 per
 * vdpbf16ps, no spill) against 1.81 per token in the 4-token loop.
 *
 * Two tiles at once (tile_matmul2: gate and up, or two down tiles): each pass streams both tiles'
 * codes in one K loop, each broadcast activation pair feeding both weight vectors.  Same code as
 * one tile (NW = 1 or 2, a constant after inlining) and the same sums bit for bit
 * (tests/test_tile_pair.py).
 * Why: llvm-mca-16 -mcpu=sapphirerapids on the compiled decode loops, core cycles per 64 codes
 * of each tile, one stream -> two streams:
 *     m = 1: 4.02 -> 4.01    m = 2: 5.57 -> 5.26    m = 3: 7.06 -> 6.26    m = 4: 8.77 -> 7.67
 * At m = 1 the loop is bound by port 5 (2 vpermi2b + 2 vpunpck*bw per 64 codes, p5 only), from
 * m = 2 by ports 0 and 5 together (vdpbf16ps, and a broadcast load that LLVM 16's model,
 * Skylake-server's for this CPU, gives an ALU uop too: that is what sharing the broadcast saves).
 * 4 cycles per 64 codes is 16 bytes per cycle, ~4x a core's share of the Xeon's bus: the loop
 * does not wait on its ports but on memory (the Xeon profile: 4.5 codes per cycle at m = 1 from
 * L3), which llvm-mca does not model; what two streams add there is a second prefetched stream in
 * flight per core.  Measured on the Zen 5 VM (tools/kernel_ab, one thread, codes from DRAM): one
 * stream per tile instead takes 1.17x-1.37x the time at m = 1..4, K = 2048 and 768.  At m = 4
 * with two streams GCC spills a few accumulators (2 tiles x 4 tokens x 2 + 4 tables + weights,
 * over 32 zmm); the figure above includes the spills.  From L2 one stream per tile is then 0.94x
 * the time on Zen 5, from DRAM still 1.20x.
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
#ifdef KTFP8_EMULATE_SIMD
#include "ktfp8/bf16_dot_emulation.h"
#endif

#define NB 16       /* rows per tile: one zmm of fp32 outputs */
#define DECODE_M 4  /* tokens per pass up to which each token has more than one accumulator (CHAINS) */
#define MR 8        /* tokens per pass: each converted weight vector feeds up to MR vdpbf16ps */
/* Software prefetch distances of the FP8 code stream: into L2 4 KiB ahead (prefetch_ahead.h says
 * why 4 KiB), into L1 1 KiB ahead (ktfp8_prefetch_two says why both). */
#define PREFETCH_BYTES KTFP8_AVX512_PREFETCH_BYTES
#define PREFETCH_L1_BYTES 1024

#define INLINE static inline __attribute__((always_inline))

/* bf16 pair (a[2p], a[2p+1]) of one activation row, in every 32-bit lane (vpbroadcastd m32). */
INLINE __m512i bcast_pair(const uint16_t *row, int64_t p) {
    uint32_t v;
    memcpy(&v, row + 2 * p, sizeof(v));
    return _mm512_set1_epi32((int)v);
}

#ifdef KTFP8_EMULATE_SIMD
/* vdpbf16ps as the SDM defines it (bf16_dot_emulation.h), not SIMDe's: that one adds the even
 * product first and keeps denormals, so the emulated twin lost the native bits, and clang lowers
 * its __m512bh operands through __truncsfbf2, which libgcc before GCC 13 lacks.  Out of line so
 * that the emulated build compiles in seconds rather than minutes. */
static __attribute__((noinline)) void dpbf16_emulated(__m512 *acc, const __m512i *w, const __m512i *a) {
    float sum[16];
    uint16_t w_bf16[32], a_bf16[32];
    memcpy(sum, acc, sizeof(sum));
    memcpy(w_bf16, w, sizeof(w_bf16));
    memcpy(a_bf16, a, sizeof(a_bf16));
    ktfp8_emu_vdpbf16ps(sum, w_bf16, a_bf16);
    memcpy(acc, sum, sizeof(sum));
}
INLINE __m512 dpbf16(__m512 acc, __m512i w, __m512i a) {
    dpbf16_emulated(&acc, &w, &a);
    return acc;
}
#define DPBF16(acc, w, a) dpbf16((acc), (w), (a))
#else
#define DPBF16(acc, w, a) _mm512_dpbf16_ps((acc), (__m512bh)(w), (__m512bh)(a))
#endif

/* Independent accumulators per token and tile in a pass of M tokens: 4 up to DECODE_WIDE_M tokens
 * (the vdpbf16ps latency needs them), 2 up to DECODE_M (6 or 8 chains per weight tile still cover
 * it, and with two tiles 4 tokens x 2 tiles x 4 would not fit in 32 zmm beside the tables and the
 * weights), 1 above (5 to 8 tokens x 2 tiles: 10 to 16 chains; 16 accumulators, 4 tables and 4
 * weight vectors fit).  The count depends on the height of a pass only, and tile_matmul and
 * tile_matmul2 cut a job into the same passes, so a tile's sums do not depend on NW.
 * The kernel harness's token counts (tests/kernel_tester.py) do not straddle DECODE_WIDE_M: m = 1
 * (BF16 weights, and block-wise ones whose K halves are not whole blocks, as at the harness's usual
 * shape; other FP8 takes decode_halves / decode_blocks) and m = DECODE_M run the 4- and the
 * 2-accumulator loops against the oracle; m = 2, 3 differ from them only in the token count. */
#define DECODE_WIDE_M 2
#define CHAINS(M) ((M) <= DECODE_WIDE_M ? 4 : (M) <= DECODE_M ? 2 : 1)

/* sum[w][i] = sum over pairs [p0, p1) of token i against weight tile w < NW (1, or 2 for
 * tile_matmul2: both code streams in one loop, each broadcast activation pair feeding both),
 * weights converted from FP8 codes on the fly.  Which accumulator of its tile and token a pair
 * goes to depends on p, p0 and U only, never on NW: a tile's sums are bit-identical with NW = 1, 2.
 * A block may start or end in the middle of a 64-byte group (block_k = 2 mod 4).
 * ahead[t]: stream t's software prefetch. */
INLINE void dot_fp8_stream(const void *const *w, const int NW, const uint16_t *a, int64_t a_stride, const int M,
                           const int U, int64_t p0, int64_t p1, const ktfp8_e4m3_bf16_lut *lut,
                           __m512 sum[][MR], const ktfp8_prefetch_two *ahead) {
    const int Q = U - 1; /* slot q of a step uses accumulator q & Q */
    const uint8_t *codes[2] = {(const uint8_t *)w[0], (const uint8_t *)w[NW - 1]};
    __m512 acc[2][MR][4];
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++)
            for (int q = 0; q < 4; q++) acc[t][i][q] = _mm512_setzero_ps();
    int64_t p = p0;
    __m512i w0[2], w1[2];
    if (p & 1) { /* second pair of a group */
#pragma GCC unroll 2
        for (int t = 0; t < NW; t++) ktfp8_e4m3x64_to_bf16(lut, codes[t] + 32 * (p - 1), &w0[t], &w1[t]);
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const __m512i x = bcast_pair(a + i * a_stride, p);
#pragma GCC unroll 2
            for (int t = 0; t < NW; t++) acc[t][i][1 & Q] = DPBF16(acc[t][i][1 & Q], w1[t], x);
        }
        p++;
    }
    /* two groups = four pairs = two cache lines of each stream per step, a group of every stream
     * converted at a time (NW x 2 weight vectors live); in runs of fixed prefetch bases (the tiles
     * have one k, so the streams share their cuts: prefetch_ahead.h) */
    while (p + 4 <= p1) {
        int64_t until;
        uintptr_t far_base[2], near_base[2];
#pragma GCC unroll 2
        for (int t = 0; t < NW; t++) ktfp8_prefetch_two_run(&ahead[t], 32 * p, &far_base[t], &near_base[t], &until);
        const int64_t stop = ktfp8_prefetch_bound(until, 32, 4, p1);
        for (; p + 4 <= stop; p += 4) {
#pragma GCC unroll 2
            for (int t = 0; t < NW; t++) {
                _mm_prefetch((const char *)(far_base[t] + (uintptr_t)(32 * p)), _MM_HINT_T1);
                _mm_prefetch((const char *)(far_base[t] + (uintptr_t)(32 * p + 64)), _MM_HINT_T1);
                _mm_prefetch((const char *)(near_base[t] + (uintptr_t)(32 * p)), _MM_HINT_T0);
                _mm_prefetch((const char *)(near_base[t] + (uintptr_t)(32 * p + 64)), _MM_HINT_T0);
            }
#pragma GCC unroll 2
            for (int g = 0; g < 4; g += 2) {
#pragma GCC unroll 2
                for (int t = 0; t < NW; t++) ktfp8_e4m3x64_to_bf16(lut, codes[t] + 32 * (p + g), &w0[t], &w1[t]);
#pragma GCC unroll 8
                for (int i = 0; i < M; i++) {
                    const __m512i x0 = bcast_pair(a + i * a_stride, p + g);
                    const __m512i x1 = bcast_pair(a + i * a_stride, p + g + 1);
#pragma GCC unroll 2
                    for (int t = 0; t < NW; t++) {
                        acc[t][i][g & Q] = DPBF16(acc[t][i][g & Q], w0[t], x0);
                        acc[t][i][(g + 1) & Q] = DPBF16(acc[t][i][(g + 1) & Q], w1[t], x1);
                    }
                }
            }
        }
    }
    for (; p < p1; p += 2) { /* 1 to 3 pairs left, p at the start of a group */
#pragma GCC unroll 2
        for (int t = 0; t < NW; t++) ktfp8_e4m3x64_to_bf16(lut, codes[t] + 32 * p, &w0[t], &w1[t]);
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const __m512i x0 = bcast_pair(a + i * a_stride, p);
#pragma GCC unroll 2
            for (int t = 0; t < NW; t++) acc[t][i][0] = DPBF16(acc[t][i][0], w0[t], x0);
            if (p + 1 < p1) {
                const __m512i x1 = bcast_pair(a + i * a_stride, p + 1);
#pragma GCC unroll 2
                for (int t = 0; t < NW; t++) acc[t][i][1 & Q] = DPBF16(acc[t][i][1 & Q], w1[t], x1);
            }
        }
    }
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            /* U = 1: nothing to add.  Adding the never-written zero accumulator, once per token, tile
             * and scale block, took 1.05x the time of an 8-token block-wise pass (block_k 128; Zen 4 VM,
             * tools/kernel_ab, hot and from DRAM), more than its share of the instructions. */
            __m512 s = U > 1 ? _mm512_add_ps(acc[t][i][0], acc[t][i][1]) : acc[t][i][0];
            if (U > 2) s = _mm512_add_ps(s, _mm512_add_ps(acc[t][i][2], acc[t][i][3]));
            sum[t][i] = s;
        }
}

/* Same over BF16 weights [pairs][16][2] as they are in memory, U accumulators per token and tile,
 * each loaded weight vector fed M broadcasts. */
INLINE void dot_bf16(const void *const *w, const int NW, const uint16_t *a, int64_t a_stride, const int M,
                     const int U, int64_t p0, int64_t p1, __m512 sum[][MR]) {
    enum { UMAX = 4 };
    const uint16_t *wt[2] = {(const uint16_t *)w[0], (const uint16_t *)w[NW - 1]};
    __m512 acc[2][MR][UMAX];
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++)
            for (int q = 0; q < UMAX; q++) acc[t][i][q] = _mm512_setzero_ps();
    __m512i wq[2];
    int64_t p = p0;
    for (; p + U <= p1; p += U) {
#pragma GCC unroll 4
        for (int q = 0; q < U; q++) {
#pragma GCC unroll 2
            for (int t = 0; t < NW; t++) wq[t] = _mm512_loadu_si512((const void *)(wt[t] + 32 * (p + q)));
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                const __m512i x = bcast_pair(a + i * a_stride, p + q);
#pragma GCC unroll 2
                for (int t = 0; t < NW; t++) acc[t][i][q] = DPBF16(acc[t][i][q], wq[t], x);
            }
        }
    }
    for (; p < p1; p++) {
#pragma GCC unroll 2
        for (int t = 0; t < NW; t++) wq[t] = _mm512_loadu_si512((const void *)(wt[t] + 32 * p));
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const __m512i x = bcast_pair(a + i * a_stride, p);
#pragma GCC unroll 2
            for (int t = 0; t < NW; t++) acc[t][i][0] = DPBF16(acc[t][i][0], wq[t], x);
        }
    }
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            __m512 s = U > 1 ? _mm512_add_ps(acc[t][i][0], acc[t][i][1]) : acc[t][i][0];
            if (U > 2) s = _mm512_add_ps(s, _mm512_add_ps(acc[t][i][2], acc[t][i][3]));
            sum[t][i] = s;
        }
}

/* Tokens i0 .. i0 + M - 1 of NW jobs sharing their activations: the K reduction block by block,
 * scaled, stored to each job's c.  w[t]: FP8 codes when fp8_stream, else bf16 pairs. */
INLINE void tile_rows(const ktfp8_tile_job *const *jobs, const void *const *w, const int NW, int fp8_stream,
                      int64_t i0, const int M, const int U, const ktfp8_e4m3_bf16_lut *lut) {
    const ktfp8_tile_job *j = jobs[0];
    const uint16_t *a = (const uint16_t *)j->a + i0 * j->a_stride;
    const int64_t pairs = j->k / 2;
    const int blockwise = j->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t nkb = blockwise ? j->n_kblocks : 1, block_pairs = blockwise ? j->block_k / 2 : pairs;
    ktfp8_prefetch_two ahead[2];
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++)
        ahead[t] = ktfp8_prefetch_two_of(w[t], jobs[t]->w_next, j->k * NB, PREFETCH_BYTES, PREFETCH_L1_BYTES);
    __m512 res[2][MR], sum[2][MR];
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) res[t][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nkb; b++) {
        const int64_t p0 = b * block_pairs, p1 = b == nkb - 1 ? pairs : p0 + block_pairs;
        if (fp8_stream)
            dot_fp8_stream(w, NW, a, j->a_stride, M, U, p0, p1, lut, sum, ahead);
        else
            dot_bf16(w, NW, a, j->a_stride, M, U, p0, p1, sum);
#pragma GCC unroll 2
        for (int t = 0; t < NW; t++) {
            if (j->format == KTFP8_FMT_BF16) {
#pragma GCC unroll 8
                for (int i = 0; i < M; i++) res[t][i] = sum[t][i];
            } else {
                const __m512 s = _mm512_loadu_ps(jobs[t]->scale + b * NB);
#pragma GCC unroll 8
                for (int i = 0; i < M; i++) res[t][i] = _mm512_fmadd_ps(sum[t][i], s, res[t][i]);
            }
        }
    }
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) _mm512_storeu_ps(jobs[t]->c + (i0 + i) * jobs[t]->c_stride, res[t][i]);
}

/* One token against FP8 tiles (decode), each tile read as two code streams: its K halves side by side,
 * so that a tile pair streams four.  Why: one core's stream from DRAM, not its
 * conversion, bounds decode on the Zen 4 VM (the two-stream loop converts a tile pair in 1.5 us hot,
 * 2.2-2.6 us from DRAM), and more streams in flight read more of the bus.  Measured there
 * (tools/kernel_ab, one thread, codes from DRAM, against the two-stream loop): K = 2048 0.89x-0.92x,
 * K = 768 0.89x-0.93x; hot in L2 1.03x (with a prefetch base and a code pointer per stream instead
 * of per tile, GCC kept a vector and pointers on the stack: 1.22x).  The benchmark layer
 * (tools/ab_builds.py): T = 1 0.904x on 1 thread, 0.930x, 0.956x and 1.018x on 2 (three runs, the
 * bus near its limit there), T = 4 0.958x / 0.933x.  Block-wise scales through the same steps
 * (decode_blocks, where each half is whole scale blocks): 0.87x-0.91x from DRAM at K = 768, 2048 and
 * 7168, T = 1 0.931x on 1 thread.  BF16 weights keep tile_rows (no conversion to hide).
 * Two accumulators per stream; a tile adds its halves' four in one order whatever NW, so tile_matmul
 * and tile_matmul2 give the same sums bit for bit. */
_Static_assert(KTFP8_K_ALIGN % 16 == 0, "k / 4 pairs per half: whole 4-pair steps (k_pad, moe_pack.c)");

/* Nothing is moved across it by the compiler: the decode step's order below. */
#define STEP_ORDER() __asm__ volatile("" ::: "memory")

/* The two lines of step p (4 pairs) of every stream into L1 (to_l1) or L2, `base` being a tile's
 * prefetch base (its first half's; the second half's is `second` bytes on).  (The hint is spelled
 * out at each call: _mm_prefetch needs a constant, which some compilers check before inlining.) */
INLINE void prefetch_step(const uintptr_t *base, const int NW, uintptr_t second, int64_t p, const int to_l1) {
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++)
        for (int h = 0; h < 2; h++) {
            const uintptr_t line = base[t] + h * second + (uintptr_t)(32 * p);
            if (to_l1) {
                _mm_prefetch((const char *)line, _MM_HINT_T0);
                _mm_prefetch((const char *)(line + 64), _MM_HINT_T0);
            } else {
                _mm_prefetch((const char *)line, _MM_HINT_T1);
                _mm_prefetch((const char *)(line + 64), _MM_HINT_T1);
            }
        }
}

/* Pairs p and p + 1 (one 64-code group) of every stream into its two accumulators. */
INLINE void group_step(const uint8_t *const *codes, const int NW, const uint16_t *a, int64_t half, uintptr_t second,
                       int64_t p, const ktfp8_e4m3_bf16_lut *lut, __m512 acc[2][2][2]) {
    for (int h = 0; h < 2; h++) {
        const __m512i x0 = bcast_pair(a, h * half + p), x1 = bcast_pair(a, h * half + p + 1);
#pragma GCC unroll 2
        for (int t = 0; t < NW; t++) {
            __m512i w0, w1;
            ktfp8_e4m3x64_to_bf16(lut, codes[t] + h * second + 32 * p, &w0, &w1);
            acc[h][t][0] = DPBF16(acc[h][t][0], w0, x0);
            acc[h][t][1] = DPBF16(acc[h][t][1], w1, x1);
        }
    }
}

/* One step of 4 pairs: its L1 prefetches, its first group, its L2 prefetches, its second group, in
 * that order.  Why pinned: from DRAM this loop's speed followed the order GCC happened to give these
 * instructions, and any change elsewhere in tile_matmul2 reshuffled it.  Zen 4 VM (tools/kernel_ab,
 * one thread, m = 1, codes from DRAM, against GCC's order in HEAD at the time): all 16 prefetches
 * first, L1 ones first 1.08x-1.10x at K = 2048 and 1.23x at K = 768; L2 ones first 1.01x-1.03x and
 * 1.06x-1.09x; after the first group 1.02x-1.07x and 1.00x-1.02x; split around the first group, L2
 * ones first 0.99x-1.01x and 0.98x-1.01x, L1 ones first (kept) 0.99x-1.01x and 0.97x-0.99x (five
 * runs).  Hot in L2 the kept order takes 1.045x. */
INLINE void decode_step(const uint8_t *const *codes, const int NW, const uint16_t *a, int64_t half,
                        uintptr_t second, const uintptr_t *far_base, const uintptr_t *near_base, int64_t p,
                        const ktfp8_e4m3_bf16_lut *lut, __m512 acc[2][2][2]) {
    prefetch_step(near_base, NW, second, p, 1);
    STEP_ORDER();
    group_step(codes, NW, a, half, second, p, lut, acc);
    STEP_ORDER();
    prefetch_step(far_base, NW, second, p, 0);
    STEP_ORDER();
    group_step(codes, NW, a, half, second, p + 2, lut, acc);
}

/* Steps [p, p1) of both halves of every tile into acc, in runs of fixed prefetch bases
 * (prefetch_ahead.h). */
INLINE void halves_run(const uint8_t *const *codes, const int NW, const uint16_t *a, int64_t half,
                       const ktfp8_prefetch_two *ahead, int64_t p, int64_t p1, const ktfp8_e4m3_bf16_lut *lut,
                       __m512 acc[2][2][2]) {
    const uintptr_t second = 32 * half; /* bytes from a tile's first half to its second */
    while (p < p1) {
        int64_t until;
        uintptr_t far_base[2], near_base[2];
#pragma GCC unroll 2
        for (int t = 0; t < NW; t++) ktfp8_prefetch_two_run(&ahead[t], 32 * p, &far_base[t], &near_base[t], &until);
        const int64_t stop = ktfp8_prefetch_bound(until, 32, 4, p1);
        for (; p + 4 <= stop; p += 4) decode_step(codes, NW, a, half, second, far_base, near_base, p, lut, acc);
    }
}

/* Job j's codes, and their software prefetch as a tile of one half (32 * half bytes).  Each half's
 * stream runs on into the same half of the next tile (its tiles have this k), so the second half's
 * prefetch bases are always the first half's plus 32 * half bytes: one base per tile and kind, and
 * fewer registers live in the loop. */
INLINE const uint8_t *half_stream(const ktfp8_tile_job *j, int64_t half, ktfp8_prefetch_two *ahead) {
    const uint8_t *codes = (const uint8_t *)j->w;
    *ahead = ktfp8_prefetch_two_of(codes, j->w_next, 32 * half, PREFETCH_BYTES, PREFETCH_L1_BYTES);
    return codes;
}

INLINE void decode_halves(const ktfp8_tile_job *const *jobs, const int NW, const ktfp8_e4m3_bf16_lut *lut) {
    const int64_t half = jobs[0]->k / 4; /* pairs per half: [0, half) and [half, 2 half) */
    const uint16_t *a = (const uint16_t *)jobs[0]->a;
    const uint8_t *codes[2];
    ktfp8_prefetch_two ahead[2];
    __m512 acc[2][2][2]; /* [half][tile][chain] */
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++) {
        codes[t] = half_stream(jobs[t], half, &ahead[t]);
        for (int h = 0; h < 2; h++) acc[h][t][0] = acc[h][t][1] = _mm512_setzero_ps();
    }
    halves_run(codes, NW, a, half, ahead, 0, half, lut, acc);
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++) {
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0][t][0], acc[0][t][1]),
                                         _mm512_add_ps(acc[1][t][0], acc[1][t][1]));
        _mm512_storeu_ps(jobs[t]->c, _mm512_mul_ps(sum, _mm512_loadu_ps(jobs[t]->scale)));
    }
}

/* Whether decode_blocks takes job j: one token against block-wise FP8 whose K halves are whole scale
 * blocks of whole 4-pair steps (block_k 128 and k a multiple of 256, as DeepSeek's checkpoints
 * have it); other block shapes take tile_rows' two streams. */
static inline int blocks_fit_halves(const ktfp8_tile_job *j) {
    const int64_t span = j->block_k / 2, half = j->k / 4;
    return j->m == 1 && j->format == KTFP8_FMT_FP8_BLOCK && span % 4 == 0 && half % span == 0 &&
           j->n_kblocks == 2 * (half / span);
}

/* decode_halves with block-wise scales: block b of both halves in one run, each half's block scaled as
 * it ends (the first half's before the second's). */
INLINE void decode_blocks(const ktfp8_tile_job *const *jobs, const int NW, const ktfp8_e4m3_bf16_lut *lut) {
    const int64_t half = jobs[0]->k / 4, span = jobs[0]->block_k / 2, blocks = half / span; /* per half */
    const uint16_t *a = (const uint16_t *)jobs[0]->a;
    const uint8_t *codes[2];
    ktfp8_prefetch_two ahead[2];
    __m512 res[2];
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++) {
        codes[t] = half_stream(jobs[t], half, &ahead[t]);
        res[t] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; b++) {
        __m512 acc[2][2][2]; /* [half][tile][chain] */
#pragma GCC unroll 2
        for (int t = 0; t < NW; t++)
            for (int h = 0; h < 2; h++) acc[h][t][0] = acc[h][t][1] = _mm512_setzero_ps();
        halves_run(codes, NW, a, half, ahead, b * span, (b + 1) * span, lut, acc);
#pragma GCC unroll 2
        for (int t = 0; t < NW; t++)
            for (int h = 0; h < 2; h++)
                res[t] = _mm512_fmadd_ps(_mm512_add_ps(acc[h][t][0], acc[h][t][1]),
                                         _mm512_loadu_ps(jobs[t]->scale + (h * blocks + b) * NB), res[t]);
    }
#pragma GCC unroll 2
    for (int t = 0; t < NW; t++) _mm512_storeu_ps(jobs[t]->c, res[t]);
}

/* Out of line, one per NW, so that their code does not depend on the rest of tile_matmul2: inlined
 * there, a change to the passes of several tokens changed this loop's registers and order and cost
 * decode 1.02x-1.09x from DRAM (tools/kernel_ab, Zen 4 VM), the change itself untouched.  (Before the
 * step order was pinned and the loop taken out of line, block-wise decode through these steps made
 * per-channel decode 1.06x-1.14x slower from DRAM and itself gained only 0.94x-1.02x.) */
static __attribute__((noinline)) void decode_halves1(const ktfp8_tile_job *const *jobs, const ktfp8_e4m3_bf16_lut *lut) {
    decode_halves(jobs, 1, lut);
}

static __attribute__((noinline)) void decode_halves2(const ktfp8_tile_job *const *jobs, const ktfp8_e4m3_bf16_lut *lut) {
    decode_halves(jobs, 2, lut);
}

/* GCC 11 (11.3) miscompiles decode_blocks in the SIMDe-emulated twin: its post-reload GCSE
 * (-fgcse-after-reload, on at -O3) stores a stale register as res[0]'s low 4 lanes after the block
 * loop (tests/test_tile_pair.py, test_kernels.py: block48 on avx512_bf16_emulated and amx_emulated).
 * GCC 12 compiles it right; the native build's decode_blocks is the same code with or without it. */
#if defined(KTFP8_EMULATE_SIMD) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12
#define DECODE_BLOCKS_OPTS __attribute__((optimize("no-gcse-after-reload")))
#else
#define DECODE_BLOCKS_OPTS
#endif

static __attribute__((noinline)) DECODE_BLOCKS_OPTS void decode_blocks1(const ktfp8_tile_job *const *jobs, const ktfp8_e4m3_bf16_lut *lut) {
    decode_blocks(jobs, 1, lut);
}

static __attribute__((noinline)) DECODE_BLOCKS_OPTS void decode_blocks2(const ktfp8_tile_job *const *jobs, const ktfp8_e4m3_bf16_lut *lut) {
    decode_blocks(jobs, 2, lut);
}

/* NW jobs (1, or the 2 of tile_matmul2) over the same activations, m tokens in the fewest passes of
 * at most MR, as even as they go (heights differ by one at most, the taller first).
 * Why even: every pass converts the whole tile again, so a pass of a few tokens costs nearly what a
 * pass of 4 does.  Zen 4 VM, one tile pair hot in L2, K = 2048: m = 1 1.54 us, 2 2.35, 3 2.36, 4 2.47,
 * 5 3.03, 8 4.70; so 9 tokens as 5 + 4 take about 5.5 us against 6.23 as 8 + 1.  The heights depend
 * on m alone, so tile_matmul and tile_matmul2 still cut a job alike. */
INLINE void run_jobs(const ktfp8_tile_job *const *jobs, const int NW) {
    const ktfp8_tile_job *j = jobs[0];
    ktfp8_e4m3_bf16_lut lut;
    ktfp8_e4m3_bf16_lut_load(&lut);
    if (j->m <= 0) return;
    const void *w[2] = {jobs[0]->w, jobs[NW - 1]->w};
    const int fp8_stream = j->format != KTFP8_FMT_BF16;
    if (j->m == 1 && j->format == KTFP8_FMT_FP8_CHANNEL) {
        (NW == 1 ? decode_halves1 : decode_halves2)(jobs, &lut);
        return;
    }
    if (blocks_fit_halves(j)) {
        (NW == 1 ? decode_blocks1 : decode_blocks2)(jobs, &lut);
        return;
    }
    const int64_t passes = (j->m + MR - 1) / MR;
    for (int64_t pass = 0, i0 = 0; pass < passes; pass++) {
        const int64_t left = passes - pass, rows = (j->m - i0 + left - 1) / left;
#define PASS(M_) tile_rows(jobs, w, NW, fp8_stream, i0, M_, CHAINS(M_), &lut)
        KTFP8_FOR_M8(rows, PASS)
#undef PASS
        i0 += rows;
    }
}

static void tile_matmul(const ktfp8_tile_job *j) {
    const ktfp8_tile_job *jobs[1] = {j};
    run_jobs(jobs, 1);
}

/* Gate and up (or two down tiles): one pass over the activations feeds both weight tiles; each
 * tile's results are bit-identical to its own tile_matmul. */
static void tile_matmul2(const ktfp8_tile_job *j0, const ktfp8_tile_job *j1) {
    const ktfp8_tile_job *jobs[2] = {j0, j1};
    run_jobs(jobs, 2);
}

KTFP8_EPILOGUE_OPS(epilogue);

const ktfp8_moe_kernel KTFP8_SYM(ktfp8_moe) = {
    .layout = {.rows_per_tile = NB, .k_pack = 2, .scale_mul = 1.0f, .code_order = KTFP8_CODES_VBMI64},
    .act_dtype = KTFP8_BF16,
    .tile_matmul = tile_matmul,
    .tile_matmul2 = tile_matmul2,
    .epilogue = &epilogue,
};
