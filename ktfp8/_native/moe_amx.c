/* MoE micro-kernel on AMX tiles (AMX-TILE + AMX-BF16, Sapphire Rapids and later) for prefill.
 *
 * One call: C[m][16] = (A[m][k] x W^T) * scale for one 16-row weight tile, A in bf16.  Same
 * packing as the avx512_bf16 kernel ({NB 16, KP 2, shuffle64}): converted to bf16, a weight tile
 * is [k/2][16][2], so each 32-K slab is exactly one AMX B tile (16 K pairs x 16 columns x 2 bf16 =
 * 16 rows of 64 bytes) and needs no further reordering.
 *
 * Small m goes to the avx512_bf16 micro-kernel.  Threshold AMX_MIN_M = 8, from static analysis
 * (no AMX machine to measure on; re-measure on hardware).  Core cycles per 32-K slab of one 16-row
 * weight tile, llvm-mca-16 -mcpu=sapphirerapids on the compiled loops where it models them:
 *   - avx512_bf16 above DECODE_M (tile converted once, then MR-token passes of vdpbf16ps): 12
 *     cycles per 2 K pairs at m = 8, i.e. ~96 per slab, plus ~32 for the conversion: ~128;
 *     ~12 * m + 32 in general;
 *   - AMX: one TDPBF16PS (16 cycles on the TMUL, whatever the rows hold) + one A and one B tile
 *     load per 16 tokens, and the same ~32-cycle conversion (port 5) beside it: ~32-40;
 *   - the slab's 512 codes from DRAM at the Xeon's per-core share (22.3 GB/s / 2 cores, ~4
 *     bytes/cycle): ~128 cycles.
 * So from m = 8 the register kernel alone needs as long as the memory bus, and AMX keeps 3x slack;
 * below, both hide under the stream.  (llvm-mca has no AMX model: the TDP and tile-load figures
 * are Intel's published throughputs.)
 *
 * Weight conversion overlaps the tile products: the first pass converts slab s + 1 into scratch
 * while the TDPBF16PS of slab s run (the profile on the Xeon had 25 % of the kernel in the
 * conversion, stalled on DRAM, before any TDP could start); later passes reuse the scratch.
 *
 * Blocking: each converted B tile (one 32-K slab of the 16-row weight tile) feeds up to 4 C tiles
 * (4 x 16 tokens), i.e. 5 tile loads per 4 TDPBF16PS.  kt-kernel's 2 A x 2 B -> 4 C (4 loads per 4
 * TDPs) needs two B tiles of different output columns, i.e. 32-row weight tiles: a layout change
 * (rows_per_tile 32) with its own small-m kernel, not done here.
 *
 * Tiles (palette 1, configured at the start of every call and released at its end, so a thread
 * never holds AMX state between calls):
 *   tmm0..3  C: FP32 [16][16] sums of up to 4 chunks of 16 tokens (a pass); the last chunk of the
 *            last pass is configured with fewer rows when m is not a multiple of 16
 *   tmm4     A: bf16 [16][32] of a full chunk, one 32-K slab (row stride a_stride * 2 bytes)
 *   tmm5     A of the short last chunk (rows = m % 16)
 *   tmm6     B: bf16 pairs [16][16][2], one 32-K slab of the weight tile, reused by every chunk
 * Per-channel scale: once on the FP32 result.  Block-wise: each K block accumulates in freshly
 * zeroed C tiles, which are then scaled and added into the FP32 output.  A block size that is not
 * a multiple of the 32-K slab (never the case for DeepSeek-V3's 128) goes to avx512_bf16. */
#include <string.h>

#include "ktfp8/abi.h"
#include "ktfp8/amx_tilecfg.h"
#include "ktfp8/simd.h"
#include "ktfp8/variant.h"
#ifdef KTFP8_EMULATE_AMX
#include "ktfp8/amx_emulation.h"
#endif
#include "ktfp8/e4m3_bf16_vbmi.h"

#define NB 16        /* weight rows per tile = C tile columns */
#define AMX_MIN_M 8  /* tokens from which the tile path runs (see above) */
#define CHUNK 16     /* tokens per A / C tile */
#define CHUNKS 4     /* C tiles per pass */
#define SLAB 32      /* K per TDPBF16PS */
#define SLAB_BYTES (SLAB * NB * 2) /* one converted B tile */

/* Tile register numbers: literals, as the tile instructions take them as immediates (GCC's
 * intrinsics paste them into the asm text). */
#define TILE_A 4
#define TILE_A_TAIL 5
#define TILE_B 6

#define INLINE static inline __attribute__((always_inline))

/* The small-m kernel of the same backend: the build always compiles avx512bf16 with amx, in the
 * same (native or emulated) mode. */
#ifdef KTFP8_EMULATE_SIMD
#define SMALL_M_KERNEL ktfp8_moe_avx512bf16_emulated
#else
#define SMALL_M_KERNEL ktfp8_moe_avx512bf16
#endif
extern const ktfp8_moe_kernel SMALL_M_KERNEL;

/* GCC's tile intrinsics are asm statements that tell the compiler nothing about the memory they
 * read (LDTILECFG: only 8 of its 64 bytes; TILELOADD: none): a compiler barrier makes sure the
 * config and the converted weights are in memory first. */
INLINE void compiler_barrier(void) { __asm__ __volatile__("" ::: "memory"); }

static void configure(int chunks, int tail_rows) {
    ktfp8_amx_tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int c = 0; c < chunks; c++) {
        cfg.rows[c] = (uint8_t)(c == chunks - 1 && tail_rows ? tail_rows : CHUNK);
        cfg.colsb[c] = NB * 4;
    }
    cfg.rows[TILE_A] = CHUNK;
    cfg.colsb[TILE_A] = SLAB * 2;
    if (tail_rows) {
        cfg.rows[TILE_A_TAIL] = (uint8_t)tail_rows;
        cfg.colsb[TILE_A_TAIL] = SLAB * 2;
    }
    cfg.rows[TILE_B] = SLAB / 2;
    cfg.colsb[TILE_B] = NB * 4;
    compiler_barrier();
    _tile_loadconfig(&cfg);
}

/* The per-tile steps of one pass, for C tile c = 0..3 (a literal): with chunks and tail_rows
 * constants the conditions fold away. */
#define ZERO_C(c) \
    if (c < chunks) _tile_zero(c)
#define DOT_CHUNK(c)                                                          \
    if (c < chunks) {                                                         \
        const uint16_t *a_slab = a + (m0 + (c) * CHUNK) * a_stride + s * SLAB; \
        if (c == chunks - 1 && tail_rows) {                                   \
            _tile_loadd(TILE_A_TAIL, a_slab, a_bytes);                        \
            _tile_dpbf16ps(c, TILE_A_TAIL, TILE_B);                           \
        } else {                                                              \
            _tile_loadd(TILE_A, a_slab, a_bytes);                             \
            _tile_dpbf16ps(c, TILE_A, TILE_B);                                \
        }                                                                     \
    }
#define STORE_C(c) \
    if (c < chunks) _tile_stored(c, cbuf[c], NB * sizeof(float))

/* Tokens m0 .. m0 + rows - 1 (chunks C tiles, the last one tail_rows high when non-zero): the K
 * reduction slab by slab, block by block, scaled into the FP32 output.  codes != NULL: w is the
 * scratch, still to be filled slab by slab from codes (the first pass). */
INLINE void pass(const ktfp8_tile_job *j, const uint8_t *codes, const uint8_t *w, int64_t m0, const int chunks,
                 const int tail_rows) {
    const uint16_t *a = (const uint16_t *)j->a;
    const int64_t a_stride = j->a_stride, a_bytes = a_stride * 2;
    const int blockwise = j->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t slabs = j->k / SLAB, nkb = blockwise ? j->n_kblocks : 1;
    const int64_t block_slabs = blockwise ? j->block_k / SLAB : slabs;
    const int64_t rows = (chunks - (tail_rows != 0)) * CHUNK + tail_rows;
    float cbuf[CHUNKS][CHUNK][NB] __attribute__((aligned(64)));

    if (codes) { /* slab 0 now; slab s + 1 while slab s's products run */
        ktfp8_e4m3_tile_to_bf16(codes, SLAB, (uint16_t *)w);
        compiler_barrier();
    }
    for (int64_t kb = 0; kb < nkb; kb++) {
        const int64_t s0 = kb * block_slabs, s1 = kb == nkb - 1 ? slabs : s0 + block_slabs;
        ZERO_C(0);
        ZERO_C(1);
        ZERO_C(2);
        ZERO_C(3);
        for (int64_t s = s0; s < s1; s++) {
            _tile_loadd(TILE_B, w + s * SLAB_BYTES, NB * 4);
            if (codes && s + 1 < slabs) {
                ktfp8_e4m3_tile_to_bf16(codes + (s + 1) * SLAB * NB, SLAB, (uint16_t *)(w + (s + 1) * SLAB_BYTES));
                compiler_barrier();
            }
            DOT_CHUNK(0);
            DOT_CHUNK(1);
            DOT_CHUNK(2);
            DOT_CHUNK(3);
        }
        STORE_C(0);
        STORE_C(1);
        STORE_C(2);
        STORE_C(3);

        /* C rows to the FP32 output: per-channel and block 0 write, later blocks add */
        const __m512 scale = j->format == KTFP8_FMT_BF16 ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(j->scale + kb * NB);
        for (int64_t i = 0; i < rows; i++) {
            float *out = j->c + (m0 + i) * j->c_stride;
            __m512 v = _mm512_mul_ps(_mm512_load_ps(cbuf[i / CHUNK][i % CHUNK]), scale);
            if (kb > 0) v = _mm512_add_ps(v, _mm512_loadu_ps(out));
            _mm512_storeu_ps(out, v);
        }
    }
}
#undef ZERO_C
#undef DOT_CHUNK
#undef STORE_C

static void tile_matmul(const ktfp8_tile_job *j) {
    const int blockwise = j->format == KTFP8_FMT_FP8_BLOCK;
    if (j->m < AMX_MIN_M || (blockwise && j->block_k % SLAB)) {
        SMALL_M_KERNEL.tile_matmul(j);
        return;
    }
    /* weights as bf16 [k/2][16][2]: BF16 weights are already packed that way; FP8 codes are
     * converted into scratch during the first pass and reused by the later ones */
    const uint8_t *codes = j->format == KTFP8_FMT_BF16 ? NULL : (const uint8_t *)j->w;
    const uint8_t *w = codes ? (const uint8_t *)j->scratch : (const uint8_t *)j->w;
    const int64_t full = j->m / (CHUNKS * CHUNK) * (CHUNKS * CHUNK), left = j->m - full;
    if (full) {
        configure(CHUNKS, 0);
        for (int64_t m0 = 0; m0 < full; m0 += CHUNKS * CHUNK) {
            pass(j, m0 == 0 ? codes : NULL, w, m0, CHUNKS, 0);
        }
    }
    if (left) { /* the last pass: fewer chunks, maybe a short one */
        const int chunks = (int)((left + CHUNK - 1) / CHUNK), tail_rows = (int)(left % CHUNK);
        configure(chunks, tail_rows);
        pass(j, full == 0 ? codes : NULL, w, full, chunks, tail_rows);
    }
    _tile_release();
}

static size_t tile_scratch_bytes(int64_t k) {
    const size_t own = (size_t)k * NB * 2; /* the converted weight tile */
    const size_t small = SMALL_M_KERNEL.tile_scratch_bytes ? SMALL_M_KERNEL.tile_scratch_bytes(k) : 0;
    return own > small ? own : small;
}

const ktfp8_moe_kernel KTFP8_SYM(ktfp8_moe) = {
    .layout = {.rows_per_tile = NB, .k_pack = 2, .scale_mul = 1.0f, .shuffle64 = 1},
    .act_dtype = KTFP8_BF16,
    .tile_scratch_bytes = tile_scratch_bytes,
    .tile_matmul = tile_matmul,
};
