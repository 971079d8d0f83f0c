/* MoE micro-kernel for AVX2 + FMA (Haswell / Zen and later).
 *
 * One call: C[m][16] = (A[m][k] x W^T) * scale for one 16-row tile, A in fp32, FP32 FMA.
 * Weights [k][16]: the 16 codes (or bf16 words) of K step s are one tile row, converted to two ymm
 * of 8 fp32 rows each, so one broadcast activation a[s] updates all 16 outputs:
 *   acc[n] += a[s] * w[n][s]                                  (vfmadd231ps, lanes n)
 *
 * FP8 -> fp32 by placing the code's bits (pair_row below): value * 2^-120.  The driver hands over the
 * activations times 2^112 (layout.act_exp) and the packer folds 256 into the scales (scale_mul), so
 * each product is value * a / 256 exactly as the fp16 route of e4m3_f16.h gives it.  Rows holding a
 * NaN code (which this maps to 480 * 2^-120) get a NaN scale from the packer.
 * BF16 weights: their bits << 16 are the fp32 value, no scale, activations as they are.
 *
 * Decode (m <= DECODE_M): the codes stream once and are converted in registers, with software
 * prefetch and enough accumulators per token for the FMA latency (m = 6: twice, 3 tokens a pass).
 * Prefill: the first block of KEEP_M tokens streams the codes in the same way and also stores each
 * converted row into scratch (fp32 [k][16]); the later blocks of MR tokens sweep the scratch.  BF16
 * weights are converted per block (a shift per weight costs less than the scratch round trip).
 * Two tiles at once (tile_matmul2: gate and up, or two adjacent down tiles): one token streams both
 * tiles' weights in one K loop, each broadcast activation feeding both (dot_pair); more tokens run
 * the two tiles one after the other.  Each tile's sums are its one-tile path's, bit for bit
 * (tests/test_tile_pair.py).
 * Per-channel scale once after the K reduction; block-wise per K block.
 *
 * Why the first block converts: a separate conversion pass over the tile (load, convert, store, then
 * sweep) took a quarter of a T = 64 call on Zen 3 (benchmark layer, 2 threads, alternated in one
 * process: skipping it, wrong results but the same sweeps, 0.74-0.75x the time; converting codes
 * already in L1 0.87-0.92x; storing into an L1-sized window 0.81x), and prefetching the next tile's
 * codes during the sweep did not shorten it (1.01-1.04x).  Inside the first block's FMA loop the
 * conversion uses pipes the FMAs leave free and the codes arrive while the FMAs run: time against
 * the separate pass, the same sums bit for bit, T = 64 0.89x / 0.90x (2 threads, two runs) and
 * 0.91x (1 thread), T = 16 0.99x, T = 512 0.97x. */
#include <math.h>

#include "ktfp8/abi.h"
#include "ktfp8/moe_epilogue.h"
#include "ktfp8/prefetch_ahead.h"
#include "ktfp8/simd.h"
#include "ktfp8/token_count.h"
#include "ktfp8/variant.h"

#define NB 16       /* rows per tile: two ymm of fp32 outputs */
/* Tokens up to which the codes only stream, converted in registers; above, the first block (KEEP_M
 * tokens) also keeps the converted tile for the others.  Measured here against a separate conversion
 * pass into scratch followed by the sweep (Zen 3, 1 thread, E = 8 top-8 H = 2048 I = 768, every
 * token on every expert, the two paths interleaved in one process), streaming / scratch time:
 * m = 2: 0.67, 3: 0.70, 4: 0.77-0.80, 5: 0.94-1.06, 6: 0.86-0.93, 7: 0.87-1.02, 8..12: 0.95-1.04.
 * So one register block (MR = 6) streams; two blocks would read the codes twice for no gain. */
#define DECODE_M 6
#define MR 6        /* prefill register block: 6 tokens x 2 ymm = 12 accumulators of the 16 ymm */
/* Tokens of the prefill's first block, the one that converts the codes.  Its loop needs beside the
 * 2 KEEP_M accumulators the code pair, the mask, a converted row (2 ymm) and a broadcast: with 6
 * tokens that is 17 of the 16 ymm, and GCC 12 kept two accumulators on the stack, so that every K
 * step waited on a store-to-load round trip in their FMA chains.  With 5 the loop has no stack
 * access.  Measured as pair_row says, against the kernel before both changes (a first block of 6
 * tokens, the up-front conversion), K = 2048 / 768: m = 7 0.92x / 0.95x, 8 0.88x / 0.84x, 10 0.97x /
 * 0.90x, 12 1.01x / 1.01x, 14 0.90x / 0.87x; with the old conversion a block of 5 gained nothing
 * (0.94x-1.09x).  The same count rules out a 6-token streaming loop: see DECODE_HALVES_M. */
#define KEEP_M 5
/* m = 6 streams the codes in two passes of 3 tokens, the second reading the tile again from L2:
 * the one-pass 6-token loop needs the 17 ymm KEEP_M's comment counts, and GCC 12 kept five of its
 * accumulators on the stack (a store and a reload in their FMA chains every two K steps).  The
 * 3-token loop has no stack access.  Zen 3, every token on every expert (E = 16, H = 2048, I = 768,
 * tools/ab_builds.py --layer 16,16,2048,768 --tokens 6), time against the one 6-token pass:
 * 0.88x-0.91x on 2 threads, 0.88x-0.90x on 1 (docs/tuning-notes.md); a first block of 5 and a sweep
 * of 1 had taken 1.04x-1.09x. */
#define DECODE_HALVES_M 6
_Static_assert(KEEP_M < DECODE_M && DECODE_M <= MR, "prefill (m > DECODE_M) starts with a whole first block");
/* Software prefetch distance of the FP8 code stream.  Zen 3, benchmark layer, distances alternated
 * in one process, time against 2 KiB: T = 1 on 2 threads 4 KiB 0.94x / 0.96x (two runs), 8 KiB
 * 0.98x, 1 KiB 1.05x; 1 thread 4 KiB 0.98x; T = 64 4 KiB 0.97x.  (2 KiB and 4 KiB measured alike while
 * the driver handed out single tiles, whose ends ran into other threads' tiles; see
 * KTFP8_AVX512_PREFETCH_BYTES.)  BF16 weights (twice the bytes per FMA) measured faster without it. */
#define PREFETCH_BYTES 4096
/* The same for each of dot_pair's two code streams.  Against 4 KiB, T = 1, alternated in one
 * process: 8 KiB 0.95x-1.00x on 2 threads (four runs, median 0.97x) and 0.95x-0.99x on 1 (four,
 * median 0.96x); 16 KiB 0.94x-0.98x (two runs each); 2 KiB 1.00x-1.09x; none 1.04x-1.12x.  8 KiB
 * stays within a down tile (12 KiB at K = 768 here). */
#define PAIR_PREFETCH_BYTES 8192

#define INLINE static inline __attribute__((always_inline))

/* What w points at.  SRC_FP8_KEEP: FP8 codes, whose converted rows are also stored, row s at
 * keep + 16 s, for the blocks of tokens that follow. */
enum wsrc { SRC_FP8, SRC_FP8_KEEP, SRC_BF16, SRC_F32 };

/* Tile row s (16 weights) as r[h] = tile rows 8h .. 8h + 7: the BF16 and scratch sources. */
INLINE void row16(const enum wsrc src, const void *w, int64_t s, __m256 r[2]) {
    if (src == SRC_BF16) {
        const __m128i *p = (const __m128i *)((const uint16_t *)w + s * NB);
        r[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
        r[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1)), 16));
    } else {
        const float *p = (const float *)w + s * NB;
        r[0] = _mm256_load_ps(p);
        r[1] = _mm256_load_ps(p + 8);
    }
}

/* The 32 codes of FP8 tile rows s and s + 1 (s even), for pair_row. */
INLINE __m256i code_pair(const void *codes, int64_t s) {
    return _mm256_loadu_si256((const __m256i *)((const uint8_t *)codes + s * NB));
}

/* FP8 tile row s + v of the 32-byte pair c of rows s, s + 1 (s even: the KTFP8_CODES_PAIRS32
 * packing) as r[h] = tile rows 8h .. 8h + 7, each weight times 2^-120.
 *
 * The code S.EEEE.MMM placed as the float S.0000EEEE.MMM0...0 is its value times 2^-120, exactly:
 * the biases differ by 120 (127 and 7), and the e4m3 subnormals m * 2^-9 land on the float
 * subnormals m * 2^-129.  One 16-bit shift builds the upper halves of two such floats: a code in the
 * high byte of a word, >> 4 arithmetic, puts S in bit 15 (and copies it into 14..11) and EEEE.MMM in
 * 10..4.  Each dword holds 4 codes (the packing: byte 3 - v - 2h of dword i is row s + v, tile row
 * 8h + i): row s is the words' high bytes (3 and 1), shifted as loaded, row s + 1 the low bytes (2
 * and 0), shifted after << 8.  Then the AND with 0x87F00000 keeps S and EEEE.MMM of the dword's
 * upper word and clears the rest (the sign copies, the 4 bits shifted in from the low byte, the lower
 * word): the float of byte 3 (or 2); after << 16 the same AND makes the lower word the float of byte
 * 1 (or 0).  Per 32 codes 5 shifts and 4 ANDs with one constant.
 * A row at a time, just before its FMAs, so that two converted vectors and the code pair are live
 * beside the accumulators.  Converting the pair up front, with a second mask (0xFFFF0000) for the
 * upper floats, GCC 12 kept accumulators of the 3-, 4- and 5-token loops on the stack, each K step
 * then waiting on a store-to-load round trip in their FMA chains; now those loops have no stack
 * access.  Measured on Zen 3 (one thread, tiles streamed from DRAM as the driver hands them out,
 * both forms alternated in one process, time against the up-front form, K = 2048 / 768): m = 3
 * 0.84x / 0.85x, m = 4 0.95x / 0.94x, m = 5 0.73x / 0.90x; m = 1 1.01x / 0.88x, m = 2 1.02x /
 * 1.02x, m = 6 1.02x / 0.98x.
 * Loading row s + 1 from one byte before the pair instead (its bytes then sit in the words' high
 * bytes: 4 shifts per 32 codes instead of 5, and 4 vector stack accesses per iteration of the
 * 6-token loop instead of 10; the packed buffer needs a readable byte before its first tile) measured
 * no better, benchmark layer, alternated in one process: T = 64 0.99x-1.02x, T = 1 1.05x-1.11x on 1
 * thread.
 *
 * Why not the fp16 route (vcvtph2ps) of e4m3_f16.h: on Zen 3 the decode loop is bound by the two FP
 * pipes that shift and shuffle, and this takes fewer of their slots per code.  Measured there, m = 1,
 * codes in L2, one thread, in one run: 18.6-20.7 codes per ns against 11.6-12.6 (and 15.1-17.6 for a
 * first version with a vpshufb, a 32-bit shift and an AND per 8 codes); on Zen 1 the gap is wider,
 * 7.5-7.6 against 4.4-4.5 (docs/tuning-notes.md).  Zen 3, benchmark layer, weights from DRAM,
 * the conversions alternated in one process, time against the fp16 route: T = 1 0.88x on 1
 * thread, 0.95x on 2 (nearer the bus), T = 64 0.97x; the first version, in its own build, T = 512
 * 0.95-1.01x (the driver's scaling passes cost about 1 % there).  Subnormal weights cost nothing as
 * FMA inputs there (the same rate with none of them); a vmulps by 2^112 instead of scaled
 * activations did: 5.1-7.0 codes per ns, 10.5 without subnormals.  (Real weights hold few subnormal
 * codes: a per-channel scale puts the row's largest at 448, 2^15 above them; about 1e-4 of a
 * quantized Gaussian.)  Intel cores take a microcode assist for each: on an Intel Xeon VM (AMX,
 * family 6 model 167 as reported; 1 thread, 8 experts, H = 2048, I = 768, weights in cache), against
 * the same codes with the subnormal ones zeroed, a per-channel quantized Gaussian's codes (9e-5 of
 * them subnormal) took 1.03x the time at T = 1 and 1.15x at T = 16, uniform codes (5.6 %) 30x and
 * 78x.  The avx512 backend's fp16 route took the same time either way there.  Not changed: an Intel
 * CPU without AVX-512 would want the fp16 route here (a layout of its own), measured on such a CPU. */
INLINE void pair_row(const __m256i c, const int v, __m256 r[2]) {
    const __m256i float_bits = _mm256_set1_epi32((int)0x87F00000); /* S and EEEE.MMM of an upper word */
    const __m256i words = _mm256_srai_epi16(v == 0 ? c : _mm256_slli_epi16(c, 8), 4);
    r[0] = _mm256_castsi256_ps(_mm256_and_si256(words, float_bits));                        /* byte 3 - v */
    r[1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(words, 16), float_bits)); /* byte 1 - v */
}

/* Converted tile row s into keep[s][16] (SRC_FP8_KEEP; a no-op for the other sources). */
INLINE void keep_row(const enum wsrc src, float *keep, int64_t s, const __m256 r[2]) {
    if (src != SRC_FP8_KEEP) return;
    _mm256_store_ps(keep + s * NB, r[0]);
    _mm256_store_ps(keep + s * NB + 8, r[1]);
}

/* Token t's row is (t < 3 ? a03 : a36) + (t % 3) * stride: two pointers and one index register give
 * base + index * {0, 4, 8} addressing, so no broadcast needs its own lea (t is a constant here). */
INLINE const float *token_row(const float *a03, const float *a36, int64_t stride, int t) {
    return t < 3 ? a03 + (t % 3) * stride : a36 + (t % 3) * stride;
}

/* One K step s of one accumulator set: acc[t] += a_t[s] * r for the M tokens. */
INLINE void fma_step(__m256 acc[MR][2], const __m256 r[2], const float *a03, const float *a36, int64_t stride,
                     const int M, int64_t s) {
#pragma GCC unroll 6
    for (int t = 0; t < M; t++) {
        const __m256 x = _mm256_broadcast_ss(token_row(a03, a36, stride, t) + s);
        acc[t][0] = _mm256_fmadd_ps(x, r[0], acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(x, r[1], acc[t][1]);
    }
}

/* sum[t] = sum over K steps [s0, s1) of a_t[s] * row s, for M tokens starting at row a.  U
 * independent accumulator sets per token run over interleaved K steps: U > 1 only where M is too
 * small to hide the FMA latency (2 FMA pipes x 4 cycles wants ~8 chains).  One token gets 2 sets (4
 * chains), not 4: dot_pair must sum each of its two tiles as this does, and 2 tiles x 4 sets would
 * not fit the 16 ymm.  One tile with one token runs where a down projection has an odd number of
 * tiles and for the last token of a prefill sweep (m = 7, 13, ...; BF16 weights or the scratch);
 * 4 sets for that last token measured no faster (docs/tuning-notes.md).  keep: see SRC_FP8_KEEP.
 * ahead: the FP8 sources' software prefetch. */
INLINE void dot(const enum wsrc src, const void *w, const float *a, int64_t stride, const int M,
                int64_t s0, int64_t s1, __m256 sum[MR][2], float *keep, const ktfp8_prefetch_ahead *ahead) {
    const int U = M <= 3 ? 2 : 1;
    const float *a03 = a, *a36 = a + 3 * stride;
    __m256 acc[2][MR][2];
    for (int u = 0; u < U; u++)
        for (int t = 0; t < M; t++) acc[u][t][0] = acc[u][t][1] = _mm256_setzero_ps();
    int64_t s = s0;
    if (src == SRC_FP8 || src == SRC_FP8_KEEP) { /* a code pair (2 K steps) per iteration: s0, s1 even */
        while (s < s1) { /* in two runs, one per prefetch base (prefetch_ahead.h) */
            int64_t until;
            const uintptr_t ahead_base = ktfp8_prefetch_run(ahead, s * NB, &until);
            const int64_t stop = ktfp8_prefetch_bound(until, NB, 2, s1);
            for (; s + 2 <= stop; s += 2) {
                if (((s * NB) & 63) < 2 * NB) /* once per 64-byte line (4 K steps) */
                    _mm_prefetch((const char *)(ahead_base + (uintptr_t)(s * NB)), _MM_HINT_T0);
                __m256 r[2][2];
                const __m256i c = code_pair(w, s);
#pragma GCC unroll 2
                for (int v = 0; v < 2; v++) {
                    pair_row(c, v, r[v]);
                    keep_row(src, keep, s + v, r[v]);
                    fma_step(acc[v % U], r[v], a03, a36, stride, M, s + v);
                }
            }
        }
    } else {
        /* Two iterations per loop pass (the same FMAs in the same order: the same sums).  Zen 3,
         * benchmark layer, alternated in one process, both builds at two placements
         * (docs/tuning-notes.md), time against one iteration per pass at the same placement: BF16
         * weights T = 512 0.84x-0.96x (five pairings, median 0.94x), 0.92x / 0.97x on 1 thread, T = 64
         * 0.94x / 0.98x; FP8 (the scratch sweeps) T = 512 0.92x-1.01x (median 0.99x), T = 64
         * 0.94x-1.03x. */
#pragma GCC unroll 2
        for (; s + U <= s1; s += U) {
#pragma GCC unroll 4
            for (int u = 0; u < U; u++) {
                __m256 r[2];
                row16(src, w, s + u, r);
                fma_step(acc[u], r, a03, a36, stride, M, s + u);
            }
        }
        for (; s < s1; s++) { /* block edges that are not a multiple of U */
            __m256 r[2];
            row16(src, w, s, r);
            fma_step(acc[0], r, a03, a36, stride, M, s);
        }
    }
    for (int t = 0; t < M; t++) {
        sum[t][0] = acc[0][t][0];
        sum[t][1] = acc[0][t][1];
        for (int u = 1; u < U; u++) {
            sum[t][0] = _mm256_add_ps(sum[t][0], acc[u][t][0]);
            sum[t][1] = _mm256_add_ps(sum[t][1], acc[u][t][1]);
        }
    }
}

/* dot's sums of one token (M = 1) against two tiles w[0], w[1] in one K loop: both tiles' weights
 * stream side by side and each broadcast activation feeds both.  The same accumulator for each K
 * step as dot's (U = 2, by the step's parity), so each tile's sums are dot's bit for bit.
 * Measured on Zen 3 against two tile_matmul calls (benchmark layer, weights from DRAM, both builds
 * alternated in one process), time at T = 1, each stream prefetched PREFETCH_BYTES ahead: FP8
 * per-channel 0.95x-1.01x on 2 threads (six runs, median 0.98x), 0.99x-1.04x on 1 (three);
 * block-wise 1.01x-1.02x (two); BF16 weights, which have no software prefetch, 0.85x-0.90x (three).
 * With PAIR_PREFETCH_BYTES, against the kernel before the pairing: FP8 per-channel 0.94x / 0.95x on
 * 2 threads, 0.97x / 0.92x on 1, BF16 weights 0.84x.  More tokens, the two tiles one after the
 * other: T = 4 0.97x, T = 16 1.00x, T = 64 0.94x-1.03x, FP8 T = 512 0.96x-1.02x; BF16 weights at
 * T = 512 1.01x-1.19x (21 runs, median 1.10x), which is code placement: the same code moved 6 or 22
 * bytes read 1.00x-1.05x (docs/tuning-notes.md). */
INLINE void dot_pair(const enum wsrc src, const void *const w[2], const float *a, int64_t s0, int64_t s1,
                     __m256 sum[2][1][2], const ktfp8_prefetch_ahead ahead[2]) {
    const void *w0 = w[0], *w1 = w[1];
    __m256 acc[2][2][2]; /* [K step parity][tile][half] */
    for (int u = 0; u < 2; u++)
        for (int i = 0; i < 2; i++) acc[u][i][0] = acc[u][i][1] = _mm256_setzero_ps();
    int64_t s = s0;
    while (s < s1) { /* FP8 in two runs, as dot's (the two tiles have the same cut); BF16 in one */
        int64_t until;
        const uintptr_t base0 = ktfp8_prefetch_run(&ahead[0], s * NB, &until);
        const uintptr_t base1 = ktfp8_prefetch_run(&ahead[1], s * NB, &until);
        const int64_t stop = src == SRC_FP8 ? ktfp8_prefetch_bound(until, NB, 2, s1) : s1;
        for (; s + 2 <= stop; s += 2) {
            if (src == SRC_FP8 && ((s * NB) & 63) < 2 * NB) { /* BF16 weights: none (PREFETCH_BYTES) */
                _mm_prefetch((const char *)(base0 + (uintptr_t)(s * NB)), _MM_HINT_T0);
                _mm_prefetch((const char *)(base1 + (uintptr_t)(s * NB)), _MM_HINT_T0);
            }
            const __m256i c0 = src == SRC_FP8 ? code_pair(w0, s) : _mm256_setzero_si256();
            const __m256i c1 = src == SRC_FP8 ? code_pair(w1, s) : _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int v = 0; v < 2; v++) {
                const __m256 x = _mm256_broadcast_ss(a + s + v);
                __m256 r[2][2];
                if (src == SRC_FP8) {
                    pair_row(c0, v, r[0]);
                    pair_row(c1, v, r[1]);
                } else {
                    row16(src, w0, s + v, r[0]);
                    row16(src, w1, s + v, r[1]);
                }
                for (int i = 0; i < 2; i++) {
                    acc[v][i][0] = _mm256_fmadd_ps(x, r[i][0], acc[v][i][0]);
                    acc[v][i][1] = _mm256_fmadd_ps(x, r[i][1], acc[v][i][1]);
                }
            }
        }
    }
    for (int i = 0; i < 2; i++) {
        sum[i][0][0] = _mm256_add_ps(acc[0][i][0], acc[1][i][0]);
        sum[i][0][1] = _mm256_add_ps(acc[0][i][1], acc[1][i][1]);
    }
}

/* res[t] += sum[t] * the scales of K block b (BF16 weights: res[t] = sum[t], no scale; the scale
 * factors out of the K sum, so it is applied once per block, per-channel once). */
INLINE void scale_block(const ktfp8_tile_job *j, int64_t b, const __m256 sum[][2], __m256 res[][2], const int M) {
    if (j->format == KTFP8_FMT_BF16) {
        for (int t = 0; t < M; t++) {
            res[t][0] = sum[t][0];
            res[t][1] = sum[t][1];
        }
    } else {
        const __m256 s_lo = _mm256_loadu_ps(j->scale + b * NB), s_hi = _mm256_loadu_ps(j->scale + b * NB + 8);
        for (int t = 0; t < M; t++) {
            res[t][0] = _mm256_fmadd_ps(sum[t][0], s_lo, res[t][0]);
            res[t][1] = _mm256_fmadd_ps(sum[t][1], s_hi, res[t][1]);
        }
    }
}

/* res[t] times 2^rescale_exp (the part of 2^act_exp the driver left out of a), stored to c row t. */
INLINE void store_rows(const ktfp8_tile_job *j, __m256 res[][2], float *c, const int M) {
    if (j->rescale_exp) {
        const __m256 f = _mm256_set1_ps(ldexpf(1.0f, j->rescale_exp));
        for (int t = 0; t < M; t++) {
            res[t][0] = _mm256_mul_ps(res[t][0], f);
            res[t][1] = _mm256_mul_ps(res[t][1], f);
        }
    }
    for (int t = 0; t < M; t++) {
        _mm256_storeu_ps(c + t * j->c_stride, res[t][0]);
        _mm256_storeu_ps(c + t * j->c_stride + 8, res[t][1]);
    }
}

/* M tokens starting at row a: the K reduction block by block, scaled, stored to c. */
INLINE void tile_rows(const ktfp8_tile_job *j, const enum wsrc src, const void *w, const float *a, float *c,
                      const int M) {
    const int blockwise = j->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t nkb = blockwise ? j->n_kblocks : 1, block = blockwise ? j->block_k : j->k;
    const ktfp8_prefetch_ahead ahead = ktfp8_prefetch_ahead_of(w, j->w_next, j->k * NB, PREFETCH_BYTES);
    __m256 res[MR][2], sum[MR][2];
    for (int t = 0; t < M; t++) res[t][0] = res[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nkb; b++) {
        const int64_t s0 = b * block, s1 = b == nkb - 1 ? j->k : s0 + block;
        dot(src, w, a, j->a_stride, M, s0, s1, sum, (float *)j->scratch, &ahead);
        scale_block(j, b, sum, res, M);
    }
    store_rows(j, res, c, M);
}

/* tile_rows of one token for two jobs j[0], j[1] that differ only in w, scale and c, through dot_pair. */
INLINE void pair_rows(const ktfp8_tile_job *const j[2], const enum wsrc src) {
    const int blockwise = j[0]->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t nkb = blockwise ? j[0]->n_kblocks : 1, block = blockwise ? j[0]->block_k : j[0]->k;
    const void *w[2] = {j[0]->w, j[1]->w};
    const ktfp8_prefetch_ahead ahead[2] = {
        ktfp8_prefetch_ahead_of(w[0], j[0]->w_next, j[0]->k * NB, PAIR_PREFETCH_BYTES),
        ktfp8_prefetch_ahead_of(w[1], j[1]->w_next, j[1]->k * NB, PAIR_PREFETCH_BYTES)};
    __m256 res[2][1][2], sum[2][1][2];
    for (int i = 0; i < 2; i++) res[i][0][0] = res[i][0][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nkb; b++) {
        const int64_t s0 = b * block, s1 = b == nkb - 1 ? j[0]->k : s0 + block;
        dot_pair(src, w, (const float *)j[0]->a, s0, s1, sum, ahead);
        for (int i = 0; i < 2; i++) scale_block(j[i], b, sum[i], res[i], 1);
    }
    for (int i = 0; i < 2; i++) store_rows(j[i], res[i], j[i]->c, 1);
}

/* Tokens [from, m) in blocks of MR over weights w (constant MR-or-fewer M: accumulators in registers). */
INLINE void sweep(const ktfp8_tile_job *j, const enum wsrc src, const void *w, int64_t from) {
    const float *a = (const float *)j->a;
    for (int64_t i0 = from; i0 < j->m; i0 += MR) {
        const int64_t rows = j->m - i0 < MR ? j->m - i0 : MR;
        const float *ai = a + i0 * j->a_stride;
        float *ci = j->c + i0 * j->c_stride;
#define PREFILL(M_) tile_rows(j, src, w, ai, ci, M_)
        KTFP8_FOR_M6(rows, PREFILL)
#undef PREFILL
    }
}

static void tile_matmul(const ktfp8_tile_job *j) {
    if (j->m <= 0) return;
    if (j->format == KTFP8_FMT_BF16) {
        sweep(j, SRC_BF16, j->w, 0);
    } else if (j->m == DECODE_HALVES_M) {
        const int half = DECODE_HALVES_M / 2;
        tile_rows(j, SRC_FP8, j->w, (const float *)j->a, j->c, half);
        tile_rows(j, SRC_FP8, j->w, (const float *)j->a + half * j->a_stride, j->c + half * j->c_stride, half);
    } else if (j->m <= DECODE_M) {
#define DECODE(M_) tile_rows(j, SRC_FP8, j->w, (const float *)j->a, j->c, M_)
        KTFP8_FOR_M6(j->m, DECODE)
#undef DECODE
    } else { /* the first KEEP_M tokens convert the tile into scratch, the others reuse it */
        tile_rows(j, SRC_FP8_KEEP, j->w, (const float *)j->a, j->c, KEEP_M);
        sweep(j, SRC_F32, j->scratch, KEEP_M);
    }
}

/* Two jobs over the same tokens: gate and up, or two adjacent down tiles.  One token: pair_rows
 * (dot_pair says why).  More: one tile after the other, each one's prefetch running on into the
 * tile its thread reads next (the second's, then where the first's stream went on). */
static void tile_matmul2(const ktfp8_tile_job *j0, const ktfp8_tile_job *j1) {
    if (j0->m == 1) {
        const ktfp8_tile_job *const j[2] = {j0, j1};
        if (j0->format == KTFP8_FMT_BF16) /* src a constant in each copy of the loop */
            pair_rows(j, SRC_BF16);
        else
            pair_rows(j, SRC_FP8);
        return;
    }
    ktfp8_tile_job first = *j0, second = *j1;
    first.w_next = j1->w;
    second.w_next = j0->w_next;
    tile_matmul(&first);
    tile_matmul(&second);
}

/* fp32 [k][16] copy of one FP8 tile (value * 2^-120, like the streaming path), for the prefill path. */
static size_t tile_scratch_bytes(int64_t k) { return (size_t)k * NB * sizeof(float); }

KTFP8_EPILOGUE_OPS(epilogue);

const ktfp8_moe_kernel KTFP8_SYM(ktfp8_moe) = {
    .layout = {.rows_per_tile = NB, .k_pack = 1, .scale_mul = 256.0f, .code_order = KTFP8_CODES_PAIRS32,
               .act_exp = 112},
    .act_dtype = KTFP8_F32,
    .tile_scratch_bytes = tile_scratch_bytes,
    .tile_matmul = tile_matmul,
    .tile_matmul2 = tile_matmul2,
    .epilogue = &epilogue,
};
