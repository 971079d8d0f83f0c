/* Portable C emulation of the AMX tile intrinsics ktfp8 uses, with the semantics of the Intel SDM
 * (Vol. 2, LDTILECFG / TILELOADD / TILESTORED / TILEZERO / TILERELEASE / TDPBF16PS), so the AMX
 * kernel's own source compiles a second time against it (-DKTFP8_EMULATE_AMX, the amx_emulated
 * variant) and runs in the test suite on any CPU.
 *
 * State: eight 16 x 64-byte tile registers and their shapes (palette 1), thread-local like the
 * real registers (the kernels run inside OpenMP threads).  Each translation unit that includes
 * this header owns its own copy of the state, as each uses it only between its own
 * _tile_loadconfig and _tile_release.
 *
 * What hardware reports as #UD / #GP (an unconfigured tile, shapes that do not fit, a bad
 * configuration) is reported on stderr and aborts: it is a bug in the calling kernel.
 *
 * TILELOADDT1 is TILELOADD with a cache hint, which has no architectural effect: emulated as
 * TILELOADD.  Not emulated: palettes other than 0/1, start_row != 0 (restart after a fault), the
 * INT8/FP16 dot products, and NaN payload priorities (a NaN result is some quiet NaN). */
#ifndef KTFP8_AMX_EMULATION_H
#define KTFP8_AMX_EMULATION_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
/* Included first so that a later #include of it (or of SIMDe) cannot redeclare the names that the
 * macros at the end of this file take over. */
#include <immintrin.h>
#endif

#include "ktfp8/amx_tilecfg.h"
#include "ktfp8/bf16_dot_emulation.h"

typedef struct ktfp8_amx_state {
    uint8_t tile[KTFP8_AMX_TILES][KTFP8_AMX_MAX_ROWS][KTFP8_AMX_MAX_COLSB];
    uint16_t colsb[KTFP8_AMX_TILES];
    uint8_t rows[KTFP8_AMX_TILES];
    int configured; /* TILES_CONFIGURED */
} ktfp8_amx_state;

static _Thread_local ktfp8_amx_state ktfp8_amx_emu_state;

static void ktfp8_amx_emu_fault(const char *insn, const char *why) {
    fprintf(stderr, "ktfp8 AMX emulation: %s: %s (the hardware raises a fault here)\n", insn, why);
    fflush(stderr);
    abort();
}

/* ---------------------------------------------------------------- configuration */

static inline void ktfp8_amx_emu_release(void) { memset(&ktfp8_amx_emu_state, 0, sizeof(ktfp8_amx_emu_state)); }

static inline void ktfp8_amx_emu_loadconfig(const void *mem) {
    ktfp8_amx_tilecfg cfg;
    memcpy(&cfg, mem, sizeof(cfg));
    ktfp8_amx_emu_release(); /* a successful LDTILECFG zeroes all tile data */
    if (cfg.palette_id == 0) return;
    if (cfg.palette_id != 1) ktfp8_amx_emu_fault("ldtilecfg", "unsupported palette");
    if (cfg.start_row != 0) ktfp8_amx_emu_fault("ldtilecfg", "start_row != 0 is not emulated");
    for (int i = 0; i < 14; i++)
        if (cfg.reserved[i]) ktfp8_amx_emu_fault("ldtilecfg", "reserved bytes must be 0");
    for (int t = 0; t < 16; t++) {
        if (t >= KTFP8_AMX_TILES) {
            if (cfg.rows[t] || cfg.colsb[t]) ktfp8_amx_emu_fault("ldtilecfg", "palette 1 has tiles 0..7 only");
            continue;
        }
        if (cfg.rows[t] > KTFP8_AMX_MAX_ROWS || cfg.colsb[t] > KTFP8_AMX_MAX_COLSB)
            ktfp8_amx_emu_fault("ldtilecfg", "tile larger than 16 rows x 64 bytes");
        if ((cfg.rows[t] == 0) != (cfg.colsb[t] == 0))
            ktfp8_amx_emu_fault("ldtilecfg", "a tile has rows but no columns, or columns but no rows");
        ktfp8_amx_emu_state.rows[t] = cfg.rows[t];
        ktfp8_amx_emu_state.colsb[t] = cfg.colsb[t];
    }
    ktfp8_amx_emu_state.configured = 1;
}

static inline void ktfp8_amx_emu_check_tile(const char *insn, int t) {
    if (!ktfp8_amx_emu_state.configured) ktfp8_amx_emu_fault(insn, "tiles are not configured");
    if (t < 0 || t >= KTFP8_AMX_TILES) ktfp8_amx_emu_fault(insn, "no such tile register");
    if (ktfp8_amx_emu_state.rows[t] == 0) ktfp8_amx_emu_fault(insn, "the tile is not configured");
}

/* ---------------------------------------------------------------- data movement */

/* Rows 0 .. rows-1 of colsb bytes each from base + r * stride; the rest of the tile becomes 0. */
static inline void ktfp8_amx_emu_loadd(int t, const void *base, long stride) {
    ktfp8_amx_emu_check_tile("tileloadd", t);
    uint8_t(*tile)[KTFP8_AMX_MAX_COLSB] = ktfp8_amx_emu_state.tile[t];
    memset(tile, 0, sizeof(ktfp8_amx_emu_state.tile[t]));
    for (int r = 0; r < ktfp8_amx_emu_state.rows[t]; r++)
        memcpy(tile[r], (const uint8_t *)base + (long)r * stride, ktfp8_amx_emu_state.colsb[t]);
}

static inline void ktfp8_amx_emu_stored(int t, void *base, long stride) {
    ktfp8_amx_emu_check_tile("tilestored", t);
    for (int r = 0; r < ktfp8_amx_emu_state.rows[t]; r++)
        memcpy((uint8_t *)base + (long)r * stride, ktfp8_amx_emu_state.tile[t][r], ktfp8_amx_emu_state.colsb[t]);
}

static inline void ktfp8_amx_emu_zero(int t) {
    ktfp8_amx_emu_check_tile("tilezero", t);
    memset(ktfp8_amx_emu_state.tile[t], 0, sizeof(ktfp8_amx_emu_state.tile[t]));
}

/* ---------------------------------------------------------------- TDPBF16PS arithmetic */

/* TDPBF16PS tsrcdest, tsrc1, tsrc2 as the SDM's Operation section gives it: per destination row m,
 * the even and the odd BF16 products are accumulated in two separate FP32 sums over all K pairs
 * of the tile (FMA, DAZ, FTZ, RNE), then added to each other, and that sum is added to the
 * destination.  (The intrinsics guide summarises it as C += even + odd per pair; the SDM order
 * is the ISA's definition.)  Bytes beyond the destination's shape are zeroed. */
static inline void ktfp8_amx_emu_dpbf16ps(int d, int a, int b) {
    static const char *insn = "tdpbf16ps";
    ktfp8_amx_emu_check_tile(insn, d);
    ktfp8_amx_emu_check_tile(insn, a);
    ktfp8_amx_emu_check_tile(insn, b);
    ktfp8_amx_state *s = &ktfp8_amx_emu_state;
    if (d == a || d == b || a == b) ktfp8_amx_emu_fault(insn, "the three tile registers must differ");
    if (s->colsb[d] % 4 || s->colsb[a] % 4 || s->colsb[b] % 4)
        ktfp8_amx_emu_fault(insn, "colsb must be a multiple of 4 (BF16 pairs / FP32)");
    if (s->rows[d] != s->rows[a]) ktfp8_amx_emu_fault(insn, "tsrcdest.rows != tsrc1.rows");
    if (s->colsb[a] != 4 * s->rows[b]) ktfp8_amx_emu_fault(insn, "tsrc1.colsb != 4 * tsrc2.rows");
    if (s->colsb[d] != s->colsb[b]) ktfp8_amx_emu_fault(insn, "tsrcdest.colsb != tsrc2.colsb");

    const int rows = s->rows[d], pairs = s->colsb[a] / 4, cols = s->colsb[d] / 4;
    for (int m = 0; m < rows; m++) {
        float temp[2 * KTFP8_AMX_MAX_COLSB / 4] = {0}; /* [n][even, odd] */
        const uint16_t *arow = (const uint16_t *)s->tile[a][m];
        for (int k = 0; k < pairs; k++) {
            const float a0 = ktfp8_emu_bf16(arow[2 * k]), a1 = ktfp8_emu_bf16(arow[2 * k + 1]);
            const uint16_t *brow = (const uint16_t *)s->tile[b][k];
            for (int n = 0; n < cols; n++) {
                temp[2 * n] = ktfp8_emu_fma_ftz(a0, ktfp8_emu_bf16(brow[2 * n]), temp[2 * n]);
                temp[2 * n + 1] = ktfp8_emu_fma_ftz(a1, ktfp8_emu_bf16(brow[2 * n + 1]), temp[2 * n + 1]);
            }
        }
        float *crow = (float *)s->tile[d][m];
        for (int n = 0; n < cols; n++) {
            const float pair_sum = ktfp8_emu_fma_ftz(temp[2 * n], 1.0f, temp[2 * n + 1]);
            crow[n] = ktfp8_emu_fma_ftz(ktfp8_emu_daz(crow[n]), 1.0f, pair_sum);
        }
        memset((uint8_t *)crow + s->colsb[d], 0, KTFP8_AMX_MAX_COLSB - s->colsb[d]);
    }
    for (int m = rows; m < KTFP8_AMX_MAX_ROWS; m++) memset(s->tile[d][m], 0, KTFP8_AMX_MAX_COLSB);
}

/* ---------------------------------------------------------------- the intrinsic names
 * <immintrin.h> declares them too (included above): macros of the same names shadow both its
 * macros and its inline functions at every call site after this point. */
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) ktfp8_amx_emu_loadconfig(config)
#define _tile_release() ktfp8_amx_emu_release()
#define _tile_loadd(t, base, stride) ktfp8_amx_emu_loadd((t), (base), (long)(stride))
#define _tile_stream_loadd(t, base, stride) ktfp8_amx_emu_loadd((t), (base), (long)(stride))
#define _tile_stored(t, base, stride) ktfp8_amx_emu_stored((t), (base), (long)(stride))
#define _tile_zero(t) ktfp8_amx_emu_zero(t)
#define _tile_dpbf16ps(d, a, b) ktfp8_amx_emu_dpbf16ps((d), (a), (b))

#endif
