/* The 64-byte memory operand of LDTILECFG (Intel SDM Vol. 2, LDTILECFG), palette 1: the one
 * definition shared by the AMX kernel (moe_amx.c) and the tile emulation (amx_emulation.h). */
#ifndef KTFP8_AMX_TILECFG_H
#define KTFP8_AMX_TILECFG_H

#include <stdint.h>

#define KTFP8_AMX_TILES 8      /* palette 1: tmm0 .. tmm7          */
#define KTFP8_AMX_MAX_ROWS 16  /* palette 1: rows per tile          */
#define KTFP8_AMX_MAX_COLSB 64 /* palette 1: bytes per row           */

typedef struct ktfp8_amx_tilecfg {
    uint8_t palette_id;   /* 0: release (init state), 1: 8 tiles of at most 16 x 64 bytes */
    uint8_t start_row;    /* restart row after a fault; 0 */
    uint8_t reserved[14]; /* must be 0 */
    uint16_t colsb[16];   /* bytes per row of tile t (tiles 8..15 must be 0 under palette 1) */
    uint8_t rows[16];     /* rows of tile t */
} __attribute__((aligned(64))) ktfp8_amx_tilecfg;
_Static_assert(sizeof(ktfp8_amx_tilecfg) == 64, "LDTILECFG reads exactly 64 bytes");

#endif
