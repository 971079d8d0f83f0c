/* AMX tdpbf16ps peak: per thread 4 independent C tiles fed by 2 A and 2 B tiles (2 x 2 -> 4 C, the
 * blocking kt-kernel and the figures use), all operands resident in tiles, so the loop is
 * bound by TDPBF16PS throughput alone.  Each TDPBF16PS is 16 rows x 16 columns x 32 products x 2
 * flops = 16384 flops.
 *
 * Runs only where probe.c found AMX usable (CPUID, XCR0 and the arch_prctl permission); the same
 * source compiles against include/ktfp8/amx_emulation.h (-DKTFP8_EMULATE_AMX) so a test can check
 * its tile configuration and arithmetic on any CPU. */
#include <string.h>

#include "ktfp8/probe.h"
#include "ktfp8/simd.h"
#include "ktfp8/variant.h"
#ifdef KTFP8_EMULATE_AMX
#include "ktfp8/amx_emulation.h"
#endif

#define ROWS 16
#define COLSB 64                /* every tile: 16 rows of 64 bytes (C: 16 fp32, A/B: 32 bf16) */
#define FLOPS_PER_TDP (ROWS * 16 * 32 * 2)
#define BF16_ONE 0x3f80         /* 1.0 */
#define BF16_STEP 0x3a80        /* 2^-10: each TDPBF16PS adds 32 * 2^-10 = 2^-5 to every C element */
#define EXACT_ITERS (1LL << 24) /* below this the C sums (iters * 2^-5) are exact in fp32 */

/* LDTILECFG memory operand, palette 1. */
typedef struct tilecfg {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tilecfg;

/* GCC's tile intrinsics do not tell the compiler which memory they read or write: keep the operand
 * stores before the loads and the reads of c after the tile stores. */
#define COMPILER_BARRIER() __asm__ __volatile__("" ::: "memory")

/* Tiles: tmm0..3 C, tmm4..5 A, tmm6..7 B. */
static int run_tiles(int64_t iters) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = ROWS;
        cfg.colsb[t] = COLSB;
    }
    uint16_t a[ROWS * COLSB / 2], b[ROWS * COLSB / 2];
    for (int i = 0; i < ROWS * COLSB / 2; i++) a[i] = BF16_ONE, b[i] = BF16_STEP;
    COMPILER_BARRIER();
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, a, COLSB);
    _tile_loadd(5, a, COLSB);
    _tile_loadd(6, b, COLSB);
    _tile_loadd(7, b, COLSB);
    for (int64_t it = 0; it < iters; it++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float c[4][ROWS * COLSB / 4];
    _tile_stored(0, c[0], COLSB);
    _tile_stored(1, c[1], COLSB);
    _tile_stored(2, c[2], COLSB);
    _tile_stored(3, c[3], COLSB);
    COMPILER_BARRIER();
    /* every C element is exactly iters * 2^-5 (while that is exact in fp32): the tiles were
     * configured, loaded and multiplied as intended, and no TDPBF16PS was optimised away */
    int ok = 1;
    for (int i = 0; i < 4 * ROWS * COLSB / 4 && iters < EXACT_ITERS; i++)
        ok &= c[i / (ROWS * COLSB / 4)][i % (ROWS * COLSB / 4)] == (float)iters / 32.0f;
    _tile_release();
    return ok;
}

double KTFP8_SYM(ktfp8_probe_tdpbf16)(int64_t iters, int threads) {
    int ok = 1;
#pragma omp parallel num_threads(threads) reduction(&& : ok)
    ok = run_tiles(iters);
    return ok ? (double)iters * 4 * FLOPS_PER_TDP * threads : 0.0;
}
