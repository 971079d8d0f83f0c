/* MoE entry points shared by every variant: packing (moe_pack.c) and the forward driver
 * (moe_driver.c).  Both are built with baseline flags; ISA code lives only in tile_matmul. */
#ifndef KTFP8_MOE_H
#define KTFP8_MOE_H

#include "ktfp8/abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where one packed projection lives inside a packed buffer. */
typedef struct ktfp8_packed_proj {
    int64_t n, k;                 /* logical out (rows) and in (K) */
    int64_t n_tiles, k_pad;       /* rows in whole tiles of NB; K padded to KTFP8_K_ALIGN */
    int64_t n_kblocks;            /* block-wise: ceil(k / block_k); otherwise 1 */
    size_t tile_w_bytes;          /* weights of one tile: k_pad * NB * element size */
    size_t tile_scale_floats;     /* scales of one tile: NB (per-channel), n_kblocks * NB, 0 (BF16) */
    const uint8_t *w;             /* [E][n_tiles] tiles of tile_w_bytes */
    const float *scale;           /* [E][n_tiles] tiles of tile_scale_floats */
} ktfp8_packed_proj;

enum { KTFP8_GATE = 0, KTFP8_UP = 1, KTFP8_DOWN = 2 };

/* Row stride (elements) of k_pad activations: an odd number of 64-byte lines, so that the rows
 * of an AMX A tile (16 rows, 64 in a pass) spread over all 64 L1 sets of Sapphire Rapids (12 ways)
 * instead of sharing a few.  A multiple of 4 KiB put all 16 in one set (H = 2048 in BF16); any even
 * count shares them out unevenly: I = 768 in BF16 is 24 lines, 8 sets for the 64 rows of a pass.
 * Measured on the Xeon VM with AMX (tools/kernel_ab, the amx kernel, K = 768, 25 lines apart against
 * 24): m = 32..128 0.86x-0.98x hot, m = 48..80 0.92x-0.98x from DRAM; K = 2048, 66 lines against 65:
 * 1.06x-1.10x.  Here so that tools/kernel_ab lays its rows out the same way. */
static inline int64_t ktfp8_row_stride(int64_t k_pad, size_t esz) {
    const int64_t line = 64 / (int64_t)esz; /* elements per line; k_pad is a whole number of lines */
    return (k_pad / line) % 2 ? k_pad : k_pad + line;
}

/* 0, or -1 when the shape is invalid (sizes <= 0 or past what the packed sizes can count, odd block_k,
 * unknown format). */
int ktfp8_shape_check(const ktfp8_moe_shape *shape);
size_t ktfp8_packed_size(const ktfp8_moe_shape *shape, const ktfp8_layout *layout);
/* Views of gate, up, down inside a packed buffer starting at base. */
void ktfp8_packed_views(const ktfp8_moe_shape *shape, const ktfp8_layout *layout, const void *base,
                        ktfp8_packed_proj views[3]);
/* Fills dst (ktfp8_packed_size bytes, 64-byte aligned) from the three source projections. */
void ktfp8_pack(const ktfp8_moe_shape *shape, const ktfp8_layout *layout, const ktfp8_proj_src src[3],
                void *dst, int threads);

/* Runs one forward call.  Returns 0, KTFP8_ENOMEM, or KTFP8_EINVAL (an expert id >= experts). */
#define KTFP8_ENOMEM (-1)
#define KTFP8_EINVAL (-2)
int ktfp8_moe_forward(const ktfp8_variant *variant, const ktfp8_moe_call *call);

#ifdef __cplusplus
}
#endif
#endif
