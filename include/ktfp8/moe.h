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

/* 0, or -1 when the shape is invalid (sizes <= 0, odd block_k, unknown format). */
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
