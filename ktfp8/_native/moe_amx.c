/* MoE micro-kernel on AMX tiles (AMX-TILE + AMX-BF16, Sapphire Rapids and later) for prefill.
 *
 * One call: C[m][16] = (A[m][k] x W^T) * scale for one 16-row weight tile, A in bf16.  Same
 * packing as the avx512_bf16 kernel ({NB 16, KP 2, KTFP8_CODES_VBMI64}): converted to bf16, a weight tile
 * is [k/2][16][2], so each 32-K slab is exactly one AMX B tile (16 K pairs x 16 columns x 2 bf16 =
 * 16 rows of 64 bytes) and needs no further reordering.
 *
 * Small m goes to the avx512_bf16 micro-kernel: only m = 1, where streaming the codes once is all
 * there is to do.  Threshold AMX_MIN_M = 2, measured on an Intel Xeon VM with AMX (family 6 model
 * 167 as its hypervisor reports it, 2 vCPUs, L2 2 MiB per core, L3 105 MiB; `vdpbf16ps` runs there
 * at half the rate of an FP32 FMA, 68-79 against 134-158 GFLOP/s per core; AMX 1.0-2.2 TFLOP/s per
 * core, the VM's speed changing from minute to minute): tile_matmul2 of both kernels alternated in
 * one process (tools/kernel_ab, amx against avx512_bf16), time per tile pair from DRAM, amx /
 * avx512_bf16:
 *   K = 2048: m = 1 1.02x-1.09x, 2 0.79x-0.92x, 3 0.70x-0.73x, 4 0.57x-0.61x, 8 0.38x, 16 0.21x;
 *   K = 768:  m = 1 1.10x, 2 0.95x, 3 0.79x, 4 0.63x, 8 0.38x.
 * From m = 4 the register kernel is bound by its conversion and vdpbf16ps (about 50 GFLOP/s,
 * whatever m), the tiles by the memory bus (in one run m = 16 took 1.24x the time of m = 2).
 * Benchmark layer, 2 threads, AMX_MIN_M 2 against 8 (tools/ab_builds.py): T = 4 0.94x, T = 16
 * 0.78x, T = 64 0.63x (1 thread 0.66x; block-wise 0.71x; BF16 weights 0.90x).
 *
 * Weight conversion overlaps the tile products: the first pass converts slab s + 1 into scratch
 * while the TDPBF16PS of slab s run (the profile on the Xeon had 25 % of the kernel in the
 * conversion, stalled on DRAM, before any TDP could start); later passes reuse the scratch.
 *
 * Blocking.  Two weight tiles over the same tokens (tile_matmul2: gate and up, or two adjacent down
 * tiles): 3 A x 2 B -> 6 C through one A and one B register, 7 tile loads per 6 TDPBF16PS (see pass
 * and PAIR_CHUNKS), 48 tokens per pass; FP8 weights and 49..256 tokens in one pass that parks the C
 * tiles of the chunks after the third between K blocks (parked_pass).  One weight tile (tile_matmul):
 * 5 A x 1 B -> 5 C, 6 loads per 5 TDPs, 80 tokens per pass (see CHUNKS).  Either way each converted B
 * tile feeds every chunk of a pass.
 *
 * Tiles (palette 1, configured by a call unless this thread's last call left the same
 * configuration, and released by the driver after the thread's last call of a forward: release):
 *   tmm0..4  C: FP32 [16][16]; C tile ch * NW + w = chunk ch (16 tokens) x weight tile w
 *   tmm5     A: bf16 [16][32] of a chunk, one 32-K slab (row stride a_stride * 2 bytes)
 *   tmm6     B: bf16 pairs [16][16][2], one 32-K slab of a weight tile
 *   tmm7     C tile 5 (chunk 2 x weight tile 1) in a pass of three chunks; B of weight tile 1 where
 *            a single chunk converts its weights (see pass).  Whole chunks give every tile but the
 *            C and A tiles of one short chunk the same [16][64 bytes] shape, so one configuration
 *            serves both uses.
 * From 16 tokens on every chunk is 16 rows, the last one running on into the rows the driver keeps
 * readable past m (layout.row_pad); only the m rows are written out.  Fewer than 16 tokens make one
 * short chunk (tmm5 and the C tiles configured with m rows).  Why not a short last chunk after full
 * ones, with an A tile of its own: timed inside the MoE at T = 512 (rdtsc around each tile_matmul2),
 * experts of 56..60 tokens took 1.09x-1.11x the time per tile pair of experts of 64, those of 48
 * 0.75x.  Whole chunks against that (tools/ab_builds.py, benchmark layer, 2 threads): T = 512
 * 0.86x-0.97x (three runs; 1 thread 0.99x; BF16 weights 0.97x, block-wise 0.85x), T = 256 1.01x,
 * T = 128 0.88x and 0.97x, T = 64 0.97x (two), T = 16 0.99x.  Whole chunks below 16 tokens too:
 * T = 16 1.16x, T = 64 1.20x, T = 128 1.25x (their few tokens padded to twice the rows, or more).
 * Per-channel scale: once on the FP32 result.  Block-wise: each K block accumulates in freshly
 * zeroed C tiles, which are then scaled and added into the FP32 output.  A block size that is not
 * a multiple of the 32-K slab (never the case for DeepSeek-V3's 128) goes to avx512_bf16.
 *
 * The figures below "from DRAM" of tools/kernel_ab on the Emerald Rapids VM came from a walk of 256
 * MiB, which lay partly in that VM's 300 MiB L3 (the walk is 4x the L3 since; docs/tuning-notes.md,
 * "Fourth session on the Emerald Rapids VM"); the benchmark-layer figures (tools/ab_builds.py) walk
 * 4x the L3 and are from DRAM. */
#include <string.h>

#include "ktfp8/abi.h"
#include "ktfp8/moe_epilogue.h"
#include "ktfp8/amx_tilecfg.h"
#include "ktfp8/simd.h"
#include "ktfp8/variant.h"
#ifdef KTFP8_EMULATE_AMX
#include "ktfp8/amx_emulation.h"
#endif
#include "ktfp8/e4m3_bf16_vbmi.h"

#define NB 16        /* weight rows per tile = C tile columns */
#define AMX_MIN_M 2  /* tokens from which the tile path runs (see above) */
#define CHUNK 16     /* tokens per A / C tile */
/* Chunks per pass of one weight tile (tile_matmul).  Five, not four, chosen while FP8 experts of
 * 65..80 tokens (about half of them at T = 512 on the benchmark layer) ran one weight tile at a time
 * (parked_pass takes them since): tools/kernel_ab on the Emerald Rapids VM (family 6 model 207), five
 * against four, per tile pair, m = 72 / 80 0.79x-0.88x, m = 48 / 64 0.99x-1.02x; in the VM's slow
 * AMX mode (the peak loop at 0.9-1.0 TFLOP/s, minutes at a time, from outside the VM: perhaps
 * another tenant's AMX work on the same core) 1.08x-1.20x, as every blocking with more tile
 * registers took there.  Kept for the fast mode, a core of one's own. */
#define CHUNKS 5
/* Chunks per pass of two weight tiles: three (six C tiles, the sixth in tmm7), not two.  An expert of
 * 33..48 tokens then takes one pass that converts both tiles into L1 rings, where with two it took 2
 * A x 2 B passes or one tile at a time (5 A loads from L2 per 5 products at best, against 3 per 6
 * here); past 80 tokens a pass of three chunks leaves fewer passes, each reading the converted tiles
 * back from L2.  tools/kernel_ab on the Emerald Rapids VM (family 6 model 207), three against two,
 * per tile pair, from DRAM unless said: K = 2048 m = 40 0.71x-0.82x, m = 48 0.72x-0.77x (hot 0.85x),
 * m = 88..128 0.86x-0.92x (hot 0.91x); K = 768 m = 40 / 48 0.80x-0.82x, m = 96 0.91x; block-wise
 * (128) m = 40 / 48 0.87x, m = 96 0.93x; m = 20 / 32, whose path did not change, 0.99x-1.01x.
 * Benchmark layer (tools/ab_builds.py, 2 threads, 16 rounds, two builds of the same flags): T = 256
 * 0.932x, 0.897x (1 thread 0.897x; block-wise 0.965x; BF16 weights 0.966x), T = 1024 0.921x,
 * 0.929x, T = 512 (97 % of its experts 49..80 tokens, whose path did not change) 0.992x-1.031x in
 * five runs (median 1.006x; BF16 weights 0.970x), T = 128 0.992x and 1.050x.  In the VM's fast AMX
 * mode; the previous session's prototype (A in tmm7) read 1.19x-1.31x in the slow one (K = 768), as
 * every blocking with more tile registers did there (see CHUNKS). */
#define PAIR_CHUNKS 3
#define C_TILES (2 * PAIR_CHUNKS > CHUNKS ? 2 * PAIR_CHUNKS : CHUNKS) /* the most C tiles a pass uses */
#define SLAB 32      /* K per TDPBF16PS */
#define SLAB_BYTES (SLAB * NB * 2) /* one converted B tile */

/* Tile register numbers: literals, as the tile instructions take them as immediates (GCC's
 * intrinsics paste them into the asm text). */
#define TILE_A 5
#define TILE_B 6
#define TILE_B2 7 /* the second weight tile of a single chunk that converts its weights (see pass) */
#define TILE_C5 7 /* C tile 5 (chunk 2 x weight tile 1), where a pass has three chunks and no TILE_B2 */

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

/* The `rows` of the configuration this thread's calls last loaded (0: none loaded, or released).
 * One configuration for all the passes of a call: the 5 C tiles, A and both B tiles, with `rows`
 * rows in the C and A tiles (16, or m for one short chunk), whether a pass uses every tile or not;
 * and it stays from one call to the next, as long as the rows do, until release().  LDTILECFG and
 * TILERELEASE once per call, not per run of passes (two runs for one weight tile at a time, two
 * configurations for whole passes and the last one), measured on the Xeon VM with AMX, per tile
 * pair, K = 768: m = 64 0.90x-0.93x hot and 0.95x from DRAM, m = 48 0.97x-1.00x, m = 72 and 80
 * 0.97x-0.98x, m = 8 1.00x; K = 2048 m = 64 0.98x-0.99x, K = 256 m = 64 0.90x.  Once per thread and
 * forward rather than per call, against once per call, on the Emerald Rapids VM: tools/kernel_ab
 * over DRAM K = 768 m = 64 0.934x (0.16 us a call), K = 2048 m = 8 / 64 / 80 0.985x / 0.976x /
 * 0.979x; benchmark layer (tools/ab_builds.py, 2 threads) T = 512 0.982x (1 thread 0.981x), T = 64
 * 0.979x. */
static _Thread_local int configured_rows;

static void configure(int rows) {
    if (configured_rows == rows) return;
    configured_rows = rows;
    ktfp8_amx_tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < CHUNKS; t++) {
        cfg.rows[t] = (uint8_t)rows;
        cfg.colsb[t] = NB * 4;
    }
    cfg.rows[TILE_A] = (uint8_t)rows;
    cfg.colsb[TILE_A] = SLAB * 2;
    for (int t = TILE_B; t <= TILE_B2; t++) {
        cfg.rows[t] = SLAB / 2;
        cfg.colsb[t] = NB * 4;
    }
    compiler_barrier();
    _tile_loadconfig(&cfg);
}

/* The tiles configured by this thread's calls, let go (kernel.release: the driver calls it on every
 * thread of a forward after its last kernel call, so no thread holds AMX state between forwards). */
static void release(void) {
    if (!configured_rows) return;
    _tile_release();
    configured_rows = 0;
}

/* The C and A tiles' rows for m tokens: whole chunks from 16 tokens on, else one short chunk. */
static int chunk_rows(int64_t m) { return m < CHUNK ? (int)m : CHUNK; }

/* The per-tile steps of one pass (NW = 1; NW = 2 is spelled out in pass).  Tile numbers are
 * literals (see TILE_A); with NW and chunks constants the conditions fold away.  Chunk c into C
 * tile c, up to 5 chunks, each A tile used once, the B tile by all of them (6 loads per 5 TDPBF16PS).
 * ZERO_C / STORE_C: C tile t of a pass, held in tile register reg (t, but TILE_C5 for C tile 5). */
#define ZERO_C(t, reg) \
    if (t < chunks * NW) _tile_zero(reg)
#define STORE_C(t, reg) \
    if (t < chunks * NW) _tile_stored(reg, cbuf[t], NB * sizeof(float))
/* A tiles load with the non-temporal hint (TILELOADDT1): each is read once per pass, and again by the
 * next weight tile from L2 (an expert's rows, m x K, outgrow L1), so keeping them out of L1 leaves it
 * to the converted B slabs, the codes and the C rows.  tools/kernel_ab on the Emerald Rapids VM, per
 * tile pair against TILELOADD: K = 2048 m = 48..96 0.94x-0.98x from DRAM and 0.92x-0.94x hot, K = 768
 * m = 48..96 0.93x-0.97x, m = 8..24 0.98x-1.03x; benchmark layer (tools/ab_builds.py, 2 threads) T =
 * 512 0.970x, 0.968x, 0.937x (1 thread 0.946x, block-wise 0.948x, BF16 weights 0.984x), T = 1024
 * 0.994x, T = 256 1.002x, T = 128 1.002x, T = 64 1.012x and 1.006x, T = 16 1.017x and 1.000x, T = 4
 * 0.998x.  The same hint on the B tiles read back from L2 in later passes: 0.93x-1.04x, not kept. */
#define LOAD_A(ch, tile) _tile_stream_loadd(tile, a + (m0 + (ch) * CHUNK) * a_stride + s * SLAB, a_bytes)
#define DOT1(c)                            \
    if (c < chunks) {                      \
        LOAD_A(c, TILE_A);                 \
        _tile_dpbf16ps(c, TILE_A, TILE_B); \
    }

/* Software prefetch of FP8 codes: into L2 KTFP8_AMX_PREFETCH_L2_BYTES (16 KiB) ahead of the slab
 * converted, into L1 KTFP8_AMX_PREFETCH_L1_BYTES (1 KiB) ahead (ktfp8_prefetch_two: a prefetcht0
 * holds an L1 miss buffer until its line arrives, a prefetcht1 waits in L2's larger queue).  Against
 * one prefetcht0 4 KiB ahead (KTFP8_AVX512_PREFETCH_BYTES), tools/ab_builds.py on the Emerald Rapids
 * VM (benchmark layer, FP8 per-channel, 2 threads, 10 rounds): T = 512 0.953x, 0.968x, 0.962x,
 * 0.952x (1 thread 0.965x; block-wise 0.982x), T = 2048 0.983x, T = 128 0.970x, T = 64 0.940x, T =
 * 16 0.978x.  Other distances at T = 512 (L2 / L1): 8 / 1 KiB 0.970x, 8 / 2 KiB 0.966x, 16 KiB / 512
 * B 0.959x, 16 / 2 KiB 0.978x, 24 / 1 KiB 0.985x, 32 / 1 KiB 0.975x, 4 / 1 KiB 0.993x; one
 * prefetcht0 8 KiB ahead 1.002x.  (Where the distance passes a whole tile, as for the 12 KiB down
 * tiles of K = 768, the prefetch runs on past w_next's end into the down tile after it in memory,
 * which a later item reads.) */
/* BF16 weights: one prefetcht0 stream 4 KiB ahead (prefetch_bf16_slab) */
#define BF16_PREFETCH_BYTES KTFP8_AVX512_PREFETCH_BYTES

/* The software prefetch of a job's weights, running on into w_next (prefetch_ahead.h): FP8 codes
 * at two distances; BF16 weights at one, as `near`. */
static ktfp8_prefetch_two weight_prefetch(const ktfp8_tile_job *j) {
    if (j->format == KTFP8_FMT_BF16)
        return ktfp8_prefetch_two_of(j->w, j->w_next, j->k * NB * 2, BF16_PREFETCH_BYTES, BF16_PREFETCH_BYTES);
    return ktfp8_prefetch_two_of(j->w, j->w_next, j->k * NB, KTFP8_AMX_PREFETCH_L2_BYTES, KTFP8_AMX_PREFETCH_L1_BYTES);
}

/* BF16 weights need no conversion, so the first pass's B tile loads read them straight from DRAM,
 * and no conversion loop prefetches them as it does FP8 codes.  This asks for the 16 lines of the
 * slab 4 KiB ahead of slab s (the stream `ahead`, prefetch_ahead.h, which runs on into the next
 * tile).  Against none, tools/ab_builds.py on the Xeon VM with AMX (benchmark layer, BF16 weights, 2
 * threads): T = 512 0.936x, 0.945x, 0.981x (1 thread 0.917x), T = 128 0.926x, T = 64 0.928x, T = 16
 * 0.923x, T = 4 0.917x; FP8 per-channel T = 512 0.991x, T = 64 0.980x (unchanged code).  8 KiB
 * ahead against 4: T = 512 1.024x, T = 64 0.979x. */
INLINE void prefetch_bf16_slab(const ktfp8_prefetch_ahead *ahead, int64_t s) {
    int64_t until;
    const int64_t offset = s * SLAB_BYTES;
    const uintptr_t base = ktfp8_prefetch_run(ahead, offset, &until);
    for (int line = 0; line < SLAB_BYTES / 64; line++)
        _mm_prefetch((const char *)(base + (uintptr_t)(offset + 64 * line)), _MM_HINT_T0);
}

/* Rows row0 .. row0 + rows - 1 of a job's output from its C tile c (stored), K block kb: per-channel
 * and block 0 write C x scale, later blocks add it in one rounding.  The FMA is spelled out: GCC
 * contracts a multiply and an add of vectors as it sees fit (-ffp-contract=fast), which gave the
 * first row of each C tile other bits in one caller's inlined copy than in another's. */
INLINE void c_rows_out(const ktfp8_tile_job *j, const float (*c)[NB], int64_t row0, int64_t rows, int64_t kb) {
    const __m512 scale = j->format == KTFP8_FMT_BF16 ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(j->scale + kb * NB);
    for (int64_t i = 0; i < rows; i++) {
        float *out = j->c + (row0 + i) * j->c_stride;
        const __m512 ci = _mm512_load_ps(c[i]);
        _mm512_storeu_ps(out, kb > 0 ? _mm512_fmadd_ps(ci, scale, _mm512_loadu_ps(out)) : _mm512_mul_ps(ci, scale));
    }
}

/* Tokens m0 .. m0 + 16 * chunks - 1 of NW jobs sharing their activations and K (those before m
 * written out): the K reduction slab by slab, block by block, scaled into each job's FP32
 * output.  codes[w] != NULL: w_bf16[w] is scratch still to be filled slab by slab from those codes
 * (the first pass); the conversion of slab s + 1 runs beside the products of slab s.  ring: this is
 * the only pass, so no slab is read twice and the scratch is a ring of two slabs per weight tile
 * (2 KiB, in L1) instead of the whole converted tile (64 KiB at K = 2048, written to L2 and read
 * back); slab s + 1 overwrites slab s - 1, whose tile loads came before in program order.
 * ahead[w]: the software prefetch of codes[w] (weight_prefetch), or with fetch_bf16 (the first pass
 * over BF16 weights) of w_bf16[w]. */
INLINE void pass(const ktfp8_tile_job *const *jobs, const uint8_t *const *codes, const uint8_t *const *w_bf16,
                 const ktfp8_prefetch_two *ahead, const int NW, int64_t m0, const int chunks, const int ring,
                 const int fetch_bf16) {
    const ktfp8_tile_job *j = jobs[0];
    const uint16_t *a = (const uint16_t *)j->a;
    const int64_t a_stride = j->a_stride, a_bytes = a_stride * 2;
    const int blockwise = j->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t slabs = j->k / SLAB, nkb = blockwise ? j->n_kblocks : 1;
    const int64_t block_slabs = blockwise ? j->block_k / SLAB : slabs;
    const int64_t rows = chunks * CHUNK < j->m - m0 ? chunks * CHUNK : j->m - m0;
    float cbuf[C_TILES][CHUNK][NB] __attribute__((aligned(64)));
    /* a single chunk that converts (m <= 16 on FP8 weights) loads both B tiles before the conversion,
     * into registers of their own: against one B register, benchmark layer T = 128 0.97x and 0.99x,
     * T = 16 0.98x; where a single chunk follows full passes (B from the converted tiles in L2; then
     * 65..80 tokens, now 97..112, 145..160 and so on), one register: T = 512 0.98x */
    const int two_b = NW == 2 && chunks == 1 && codes[0];

    for (int w = 0; w < NW; w++)
        if (codes[w]) ktfp8_e4m3_tile_to_bf16(codes[w], SLAB, (uint16_t *)w_bf16[w], &ahead[w], 0);
    compiler_barrier();
    for (int64_t kb = 0; kb < nkb; kb++) {
        const int64_t s0 = kb * block_slabs, s1 = kb == nkb - 1 ? slabs : s0 + block_slabs;
        ZERO_C(0, 0);
        ZERO_C(1, 1);
        ZERO_C(2, 2);
        ZERO_C(3, 3);
        ZERO_C(4, 4);
        ZERO_C(5, TILE_C5);
        for (int64_t s = s0; s < s1; s++) {
#define SLAB_AT(w, s_) (w_bf16[w] + (ring ? (s_) & 1 : (s_)) * SLAB_BYTES)
            if (fetch_bf16)
                for (int w = 0; w < NW; w++) prefetch_bf16_slab(&ahead[w].near, s);
            if (NW == 1 || two_b) _tile_loadd(TILE_B, SLAB_AT(0, s), NB * 4);
            if (two_b) _tile_loadd(TILE_B2, SLAB_AT(1, s), NB * 4);
            /* slab s + 1 of weight tile w into its slot; slab s's tile loads read the other one */
#define CONVERT(w)                                                                                          \
    if (s + 1 < slabs && codes[w]) {                                                                        \
        compiler_barrier();                                                                                 \
        ktfp8_e4m3_tile_to_bf16(codes[w] + (s + 1) * SLAB * NB, SLAB, (uint16_t *)SLAB_AT(w, s + 1),        \
                                &ahead[w], (s + 1) * SLAB * NB);                                            \
        compiler_barrier();                                                                                 \
    }
            if (NW == 1) {
                CONVERT(0);
                DOT1(0);
                DOT1(1);
                DOT1(2);
                DOT1(3);
                DOT1(4);
            } else {
                /* chunk ch x weight tile w into C tile 2 ch + w, in the order A0 B0, A0 B1, A1 B1,
                 * A1 B0, A2 B0, A2 B1: one A and one B register, each product sharing an operand with
                 * the one before it, 5 tile loads per 4 products (7 per 6).  Two chunks against 4
                 * loads through two B registers (tmm6, tmm7; A0 B0, A0 B1, A1 B0, A1 B1),
                 * tools/kernel_ab on the Xeon VM with AMX, per tile pair: m = 72..128 0.90x-0.93x hot
                 * (K = 768 and 2048) and 0.92x-0.94x from DRAM, one chunk 0.98x-1.01x; a second A
                 * register besides (tmm5 for chunk 1) measured 1.18x-1.29x.  Here a product's tile
                 * registers seem to cost more than a load of B, which comes from L1 or L2.  Weight
                 * tile 1's conversion goes between the two chunks' products: 0.91x-0.97x the time of
                 * converting both first at m = 72..128 (K = 768, 2048 and 7168, hot and from DRAM);
                 * with one chunk (m <= 16) both come first, where going between measured no faster
                 * (0.96x-1.10x hot, 0.96x-1.03x from DRAM). */
                CONVERT(0);
                if (chunks == 1) CONVERT(1);
                LOAD_A(0, TILE_A);
                if (two_b) {
                    _tile_dpbf16ps(0, TILE_A, TILE_B);
                    _tile_dpbf16ps(1, TILE_A, TILE_B2);
                } else {
                    _tile_loadd(TILE_B, SLAB_AT(0, s), NB * 4);
                    _tile_dpbf16ps(0, TILE_A, TILE_B);
                    _tile_loadd(TILE_B, SLAB_AT(1, s), NB * 4);
                    _tile_dpbf16ps(1, TILE_A, TILE_B);
                }
                if (chunks > 1) {
                    CONVERT(1);
                    LOAD_A(1, TILE_A);
                    _tile_dpbf16ps(3, TILE_A, TILE_B);
                    _tile_loadd(TILE_B, SLAB_AT(0, s), NB * 4);
                    _tile_dpbf16ps(2, TILE_A, TILE_B);
                }
                if (chunks > 2) {
                    LOAD_A(2, TILE_A);
                    _tile_dpbf16ps(4, TILE_A, TILE_B);
                    _tile_loadd(TILE_B, SLAB_AT(1, s), NB * 4);
                    _tile_dpbf16ps(TILE_C5, TILE_A, TILE_B);
                }
            }
#undef CONVERT
#undef SLAB_AT
        }
        STORE_C(0, 0);
        STORE_C(1, 1);
        STORE_C(2, 2);
        STORE_C(3, 3);
        STORE_C(4, 4);
        STORE_C(5, TILE_C5);

        compiler_barrier();
        for (int w = 0; w < NW; w++)
            for (int64_t i = 0; i < rows; i += CHUNK)
                c_rows_out(jobs[w], cbuf[(i / CHUNK) * NW + w], m0 + i, rows - i < CHUNK ? rows - i : CHUNK, kb);
    }
}
#undef ZERO_C
#undef STORE_C
#undef LOAD_A
#undef DOT1

/* Two FP8 weight tiles over 49..256 tokens (4 to 16 chunks) in one pass over K that converts each
 * slab once: chunks 0..2 x both tiles in C tiles 0..5 for the whole K (as a pass of PAIR_CHUNKS),
 * and after every PARK_K_BLOCK slabs the other chunks x both tiles over the same slabs, each chunk's
 * two C tiles parked in L1 between blocks (in tmm4 and tmm7 while they run, C tiles 4 and 5 parked
 * meanwhile; block-wise weights run one scale block's slabs at a time, or a divisor of them).  The B
 * slabs come from a ring of PARK_K_BLOCK + 1 slabs a weight tile (18 KiB for both), so those of a
 * block are still there for the parked chunks while the next block's first slab is converted.
 * Why: the 8 tile registers hold the C tiles of 3 chunks x 2 tiles, and every other way to run more
 * tokens either streamed the codes one tile at a time, 4 or 5 A loads (from L2) a slab for each
 * tile's products (49..80 tokens), or made more passes over K, reading the converted tiles back from
 * L2 (81 on).  One tile at a time took 1.43x the time of a 48-token pass of both tiles at m = 64
 * (K = 2048, from DRAM: 7.3 against 5.1 us a tile pair); passes of 3 + 1 chunks 1.02x-1.05x the time
 * of one at a time, 2 + 2 chunks converting the codes again (from L2) in the second pass
 * 1.04x-1.08x, 3 + 1 that way 1.08x-1.10x.
 * Measured on the Emerald Rapids VM (family 6 model 207), tools/kernel_ab over DRAM (a 1200 MiB
 * walk), per tile pair, against one tile at a time: K = 2048 m = 49 / 64 / 72 / 80 0.784x / 0.810x-
 * 0.827x / 0.855x / 0.881x-0.892x (block-wise 128: m = 64 0.888x, m = 80 0.996x), a first prototype
 * K = 768 m = 56 / 64 0.915x / 0.919x, m = 72 / 80 0.977x / 0.985x; against passes of PAIR_CHUNKS:
 * K = 2048 m = 96 / 112 / 128 0.943x / 0.906x / 0.934x, 160 / 192 / 256 0.929x / 0.982x / 0.935x,
 * K = 768 m = 96 / 128 0.932x / 0.935x, but m = 384 1.144x (the parked C tiles outgrow the L1) and
 * m = 512 0.994x: so up to 16 chunks.  Blocks of 8 slabs against 4, 6, 12 and 16: 1.028x, 1.027x,
 * 1.052x and 1.118x the time of 8 (m = 64).  Prefetching the next block's codes during the parked
 * chunks' products: 1.33x.  Benchmark layer (tools/ab_builds.py, 8-12 rounds): T = 512 0.925x and
 * 0.885x on 2 threads (49..80 tokens parked: 0.937x), 0.922x on 1; T = 1024 0.969x and 0.995x (1
 * thread 0.982x), T = 2048 0.999x, T = 256 0.988x, T = 64 1.004x. */
#define PARK_K_BLOCK 8
#define PARK_RING (PARK_K_BLOCK + 1)
#define PARK_MAX_CHUNKS 16
/* parked_pass's scratch: a ring per weight tile, then the parked chunks' C tiles (44 KiB in all) */
#define PARK_RING_BYTES (PARK_RING * SLAB_BYTES)
#define PARK_SCRATCH_BYTES (2 * PARK_RING_BYTES + (PARK_MAX_CHUNKS - PAIR_CHUNKS) * 2 * CHUNK * NB * sizeof(float))
/* C tile registers the parked chunks borrow */
#define TILE_P0 4
#define TILE_P1 TILE_C5

/* Slabs per K block of parked_pass for block-wise weights: the largest divisor of a scale block's
 * scale_slabs that is at most PARK_K_BLOCK, so that no K block straddles two scale blocks. */
static int64_t park_block_slabs(int64_t scale_slabs) {
    int64_t d = PARK_K_BLOCK;
    while (scale_slabs % d) d--;
    return d;
}

/* Whether parked_pass takes this pair of jobs. */
static int parks(const ktfp8_tile_job *j) {
    return j->format != KTFP8_FMT_BF16 && j->m > PAIR_CHUNKS * CHUNK && j->m <= PARK_MAX_CHUNKS * CHUNK;
}

/* Under configure(CHUNK). */
static void parked_pass(const ktfp8_tile_job *j0, const ktfp8_tile_job *j1) {
    const ktfp8_tile_job *jobs[2] = {j0, j1};
    const uint16_t *a = (const uint16_t *)j0->a;
    const int64_t a_stride = j0->a_stride, a_bytes = a_stride * 2, m = j0->m, slabs = j0->k / SLAB;
    const int blockwise = j0->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t scale_slabs = blockwise ? j0->block_k / SLAB : slabs; /* per-channel: one scale block */
    const int64_t block_slabs = blockwise ? park_block_slabs(scale_slabs) : PARK_K_BLOCK;
    const int64_t chunks = (m + CHUNK - 1) / CHUNK;
    const uint8_t *codes[2] = {(const uint8_t *)j0->w, (const uint8_t *)j1->w};
    uint8_t *ring[2] = {(uint8_t *)j0->scratch, (uint8_t *)j0->scratch + PARK_RING_BYTES};
    float(*parked)[2][CHUNK][NB] = (float(*)[2][CHUNK][NB])((uint8_t *)j0->scratch + 2 * PARK_RING_BYTES);
    const ktfp8_prefetch_two ahead[2] = {weight_prefetch(j0), weight_prefetch(j1)};
    float c03[4][CHUNK][NB] __attribute__((aligned(64))); /* C tiles 0..3 at a scale block's end */
    float c45[2][CHUNK][NB] __attribute__((aligned(64))); /* C tiles 4, 5 while the parked chunks run */
#define SLOT(w, s_) (ring[w] + ((s_) % PARK_RING) * SLAB_BYTES)
#define CONVERT(w, s_)                                                                                      \
    if ((s_) < slabs) {                                                                                     \
        const int64_t at = (s_) * SLAB * NB; /* the slab's first code */                                    \
        compiler_barrier();                                                                                 \
        ktfp8_e4m3_tile_to_bf16(codes[w] + at, SLAB, (uint16_t *)SLOT(w, s_), &ahead[w], at);               \
        compiler_barrier();                                                                                 \
    }
#define LOAD_A(ch) _tile_stream_loadd(TILE_A, a + (ch) * CHUNK * a_stride + s * SLAB, a_bytes)
    CONVERT(0, 0);
    CONVERT(1, 0);
    for (int64_t s0 = 0; s0 < slabs; s0 += block_slabs) {
        const int64_t s1 = s0 + block_slabs < slabs ? s0 + block_slabs : slabs, kb = s0 / scale_slabs;
        const int first = s0 % scale_slabs == 0, last = s1 % scale_slabs == 0 || s1 == slabs; /* of a scale block */
        if (first) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(4);
            _tile_zero(TILE_C5);
        }
        /* chunks 0..2, in pass's order for two weight tiles (A0 B0, A0 B1, A1 B1, A1 B0, A2 B0, A2 B1) */
        for (int64_t s = s0; s < s1; s++) {
            CONVERT(0, s + 1);
            LOAD_A(0);
            _tile_loadd(TILE_B, SLOT(0, s), NB * 4);
            _tile_dpbf16ps(0, TILE_A, TILE_B);
            _tile_loadd(TILE_B, SLOT(1, s), NB * 4);
            _tile_dpbf16ps(1, TILE_A, TILE_B);
            CONVERT(1, s + 1);
            LOAD_A(1);
            _tile_dpbf16ps(3, TILE_A, TILE_B);
            _tile_loadd(TILE_B, SLOT(0, s), NB * 4);
            _tile_dpbf16ps(2, TILE_A, TILE_B);
            LOAD_A(2);
            _tile_dpbf16ps(4, TILE_A, TILE_B);
            _tile_loadd(TILE_B, SLOT(1, s), NB * 4);
            _tile_dpbf16ps(TILE_C5, TILE_A, TILE_B);
        }
        _tile_stored(4, c45[0], NB * 4);
        _tile_stored(TILE_C5, c45[1], NB * 4);
        /* the other chunks over the same slabs, still in the ring */
        for (int64_t ch = PAIR_CHUNKS; ch < chunks; ch++) {
            float(*p)[CHUNK][NB] = parked[ch - PAIR_CHUNKS];
            if (first) {
                _tile_zero(TILE_P0);
                _tile_zero(TILE_P1);
            } else {
                _tile_loadd(TILE_P0, p[0], NB * 4);
                _tile_loadd(TILE_P1, p[1], NB * 4);
            }
            for (int64_t s = s0; s < s1; s++) {
                LOAD_A(ch);
                _tile_loadd(TILE_B, SLOT(0, s), NB * 4);
                _tile_dpbf16ps(TILE_P0, TILE_A, TILE_B);
                _tile_loadd(TILE_B, SLOT(1, s), NB * 4);
                _tile_dpbf16ps(TILE_P1, TILE_A, TILE_B);
            }
            _tile_stored(TILE_P0, p[0], NB * 4);
            _tile_stored(TILE_P1, p[1], NB * 4);
            if (last) {
                compiler_barrier();
                const int64_t rows = m - ch * CHUNK < CHUNK ? m - ch * CHUNK : CHUNK;
                for (int w = 0; w < 2; w++) c_rows_out(jobs[w], p[w], ch * CHUNK, rows, kb);
            }
        }
        if (last) {
            _tile_stored(0, c03[0], NB * 4);
            _tile_stored(1, c03[1], NB * 4);
            _tile_stored(2, c03[2], NB * 4);
            _tile_stored(3, c03[3], NB * 4);
            compiler_barrier();
            for (int w = 0; w < 2; w++) {
                c_rows_out(jobs[w], c03[w], 0, CHUNK, kb);
                c_rows_out(jobs[w], c03[2 + w], CHUNK, CHUNK, kb);
                c_rows_out(jobs[w], c45[w], 2 * CHUNK, CHUNK, kb);
            }
        } else {
            compiler_barrier();
            _tile_loadd(4, c45[0], NB * 4);
            _tile_loadd(TILE_C5, c45[1], NB * 4);
        }
    }
#undef SLOT
#undef CONVERT
#undef LOAD_A
}

/* All m tokens of NW jobs, under configure(chunk_rows(m)): fewer than 16 in one short chunk, else
 * in whole chunks: full passes (constant shape, no per-chunk tests), then the rest. */
INLINE void run_passes(const ktfp8_tile_job *const *jobs, const int NW) {
    const ktfp8_tile_job *j = jobs[0];
    /* chunks per pass: one C tile per chunk and weight tile */
    const int per_pass = NW == 1 ? CHUNKS : PAIR_CHUNKS;
    const int64_t chunked = j->m < CHUNK ? j->m : (j->m + CHUNK - 1) / CHUNK * CHUNK;
    const int64_t step = per_pass * CHUNK, full = chunked / step * step, left = chunked - full;
    /* weights as bf16 [k/2][16][2]: BF16 weights are already packed that way; FP8 codes are
     * converted into scratch during the first pass: the whole tile when later passes reuse it,
     * else a ring of two slabs (see pass) */
    const int ring = j->format != KTFP8_FMT_BF16 && j->m <= step;
    /* per weight tile: the whole converted tile, or the ring, which is one slab when k is (the
     * scratch holds 2 whole tiles: a 2-slab ring at k = 32 would run past it) */
    const size_t whole = (size_t)j->k * NB * 2, tile_bytes = ring && whole > 2 * SLAB_BYTES ? 2 * SLAB_BYTES : whole;
    const uint8_t *codes[2] = {NULL, NULL}, *w_bf16[2] = {NULL, NULL};
    ktfp8_prefetch_two ahead[2];
    for (int w = 0; w < NW; w++) {
        codes[w] = jobs[w]->format == KTFP8_FMT_BF16 ? NULL : (const uint8_t *)jobs[w]->w;
        w_bf16[w] = codes[w] ? (const uint8_t *)j->scratch + w * tile_bytes : (const uint8_t *)jobs[w]->w;
        ahead[w] = weight_prefetch(jobs[w]);
    }
    const uint8_t *none[2] = {NULL, NULL};
    const int bf16 = codes[0] == NULL;
    for (int64_t m0 = 0; m0 < full; m0 += step)
        pass(jobs, m0 == 0 ? codes : none, w_bf16, ahead, NW, m0, per_pass, ring, bf16 && m0 == 0);
    if (left) /* the last pass: fewer chunks, or one short one */
        pass(jobs, full == 0 ? codes : none, w_bf16, ahead, NW, full, left < CHUNK ? 1 : (int)(left / CHUNK), ring,
             bf16 && full == 0);
}

/* Whether the tile path takes this job (else the small-m kernel does). */
static int amx_takes(const ktfp8_tile_job *j) {
    return j->m >= AMX_MIN_M && !(j->format == KTFP8_FMT_FP8_BLOCK && j->block_k % SLAB);
}

static void tile_matmul(const ktfp8_tile_job *j) {
    if (!amx_takes(j)) {
        SMALL_M_KERNEL.tile_matmul(j);
        return;
    }
    const ktfp8_tile_job *jobs[1] = {j};
    configure(chunk_rows(j->m));
    run_passes(jobs, 1);
}

/* Gate and up, or two adjacent down tiles (any two jobs over the same activations): each A tile
 * feeds both B tiles (parked_pass for FP8 weights and 49..256 tokens). */
static void tile_matmul2(const ktfp8_tile_job *j0, const ktfp8_tile_job *j1) {
    if (!amx_takes(j0)) {
        SMALL_M_KERNEL.tile_matmul2(j0, j1);
        return;
    }
    if (parks(j0)) {
        configure(CHUNK);
        parked_pass(j0, j1);
        return;
    }
    const ktfp8_tile_job *jobs[2] = {j0, j1};
    configure(chunk_rows(j0->m));
    run_passes(jobs, 2);
}

static size_t tile_scratch_bytes(int64_t k) {
    size_t own = 2 * (size_t)k * NB * 2; /* the two converted weight tiles of tile_matmul2 */
    if (own < PARK_SCRATCH_BYTES) own = PARK_SCRATCH_BYTES;
    const size_t small = SMALL_M_KERNEL.tile_scratch_bytes ? SMALL_M_KERNEL.tile_scratch_bytes(k) : 0;
    return own > small ? own : small;
}

KTFP8_EPILOGUE_OPS(epilogue);

const ktfp8_moe_kernel KTFP8_SYM(ktfp8_moe) = {
    .layout = {.rows_per_tile = NB, .k_pack = 2, .scale_mul = 1.0f, .code_order = KTFP8_CODES_VBMI64, .row_pad = CHUNK},
    .act_dtype = KTFP8_BF16,
    .tile_scratch_bytes = tile_scratch_bytes,
    .tile_matmul = tile_matmul,
    .tile_matmul2 = tile_matmul2,
    .release = release,
    .epilogue = &epilogue,
};
