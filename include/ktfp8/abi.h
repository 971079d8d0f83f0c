/* ktfp8 kernel ABI: the one set of types every ISA variant implements.
 *
 * A "variant" (reference, avx2, avx512, avx512_bf16, amx, and the test-only *_emulated builds)
 * provides one ktfp8_variant table.  The dispatcher (dispatch.c, baseline flags) only hands out
 * tables whose CPU + OS requirements this machine meets, so no function here is ever called on a
 * CPU that lacks its instructions.
 */
#ifndef KTFP8_ABI_H
#define KTFP8_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types crossing the ABI. BF16 and F16 travel as uint16 bit patterns. */
enum ktfp8_dtype { KTFP8_F32 = 0, KTFP8_BF16 = 1, KTFP8_F16 = 2 };

/* The activation of the gate, act(gate) * up: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma's
 * "gelu_pytorch_tanh"). */
enum ktfp8_activation { KTFP8_ACT_SILU = 0, KTFP8_ACT_GELU_TANH = 1 };

/* ---------------------------------------------------------------- FP8 E4M3 codec
 * Each function handles one contiguous run of n values; the driver (fp8_codec.c) walks rows and
 * blocks and spreads them over OpenMP threads.  Every variant must be bit-identical to
 * fp8_codec_reference.c. */
typedef struct ktfp8_codec_ops {
    /* max |v| over the finite values of src (0 when there are none). */
    float (*amax)(const void *src, int dtype, size_t n);
    /* codes[i] = e4m3(clip(float(src[i]) / scale, -448, 448)), round-to-nearest-even;
     * NaN -> 0x7F | sign.  scale == 1 is the plain encoder. */
    void (*quantize)(const void *src, int dtype, size_t n, float scale, uint8_t *codes);
    /* dst[i] = decode(codes[i]) * scale in FP32, stored as dtype (F32, or BF16 rounded to nearest
     * even).  NaN codes (S.1111.111) decode to NaN. */
    void (*dequantize)(const uint8_t *codes, size_t n, float scale, void *dst, int dtype);
} ktfp8_codec_ops;

/* ---------------------------------------------------------------- MoE weights
 * Weight formats of the expert projections. */
enum ktfp8_wformat {
    KTFP8_FMT_FP8_CHANNEL = 0, /* e4m3 codes, one fp32 scale per output row            */
    KTFP8_FMT_FP8_BLOCK = 1,   /* e4m3 codes, one fp32 scale per [block_n, block_k] block */
    KTFP8_FMT_BF16 = 2         /* bf16 weights, no scale                               */
};

typedef struct ktfp8_moe_shape {
    int64_t experts, hidden, inter;
    int32_t format;            /* enum ktfp8_wformat */
    int64_t block_n, block_k;  /* FP8_BLOCK only: block edges (block_k even) */
} ktfp8_moe_shape;

/* One projection of all experts as the user holds it (Hugging Face Linear layout).  One pointer per
 * expert: a checkpoint's experts need not lie at equal distances (safetensors writes names in string
 * order: experts 0, 1, 10, 100, ...), and packing from where they lie saves a stacked copy. */
typedef struct ktfp8_proj_src {
    const void *const *w; /* [E] pointers to expert e's [out, in] uint8 codes or uint16 bf16 bits, C-contiguous */
    const float *scale; /* per-channel [E, out]; block-wise [E, ceil(out/bn), ceil(in/bk)]; NULL for BF16 */
} ktfp8_proj_src;

/* How a variant wants its weights arranged.  Packed projection of out = N rows, in = K:
 *   weights  [E][N_tiles][Kpad / k_pack][rows_per_tile][k_pack] elements (1 byte FP8, 2 bytes BF16)
 *   scales   per-channel [E][N_tiles * rows_per_tile]            (fp32, times scale_mul)
 *            block-wise  [E][N_tiles][ceil(K / block_k)][rows_per_tile]
 * N is padded to whole tiles and K to KTFP8_K_ALIGN with zero weights (scale 0), so kernels never
 * see a tail.  A row (or row x K-block) holding a NaN code gets a NaN scale: every path then
 * propagates NaN exactly as a NaN weight would, even ones whose conversion maps NaN codes to a
 * finite value. */
#define KTFP8_K_ALIGN 32
typedef struct ktfp8_layout {
    int32_t rows_per_tile;   /* NB: output rows per tile (16 everywhere today) */
    int32_t k_pack;          /* KP: consecutive K per row in one run (1, or 2 for bf16 pairs) */
    float scale_mul;         /* folded into every packed scale (256 for the fp16 conversion trick) */
    int32_t code_order;      /* enum ktfp8_code_order: FP8 bytes permuted inside each 64-byte group */
    /* FP8 formats: the kernel reads its FP32 activations times 2^act_exp (0: as they are).  Where
     * that could overflow, the driver applies a smaller power of two and gives the job the rest
     * (ktfp8_tile_job.rescale_exp). */
    int32_t act_exp;
    /* Activation rows the kernel reads a tile of at a time (0 or 1: it reads the job's m rows only).
     * A job of more than row_pad rows may read rows m .. round_up(m, row_pad) - 1, which are then
     * readable and finite (other pairs' rows, or zeros after the last one): the kernel may compute
     * whole tiles and write out only the m rows.  A job of at most row_pad rows reads its m rows
     * only (amx: one short tile), so a call whose experts all stay within row_pad tokens (decode)
     * needs no padding rows (tests/test_row_guard.py). */
    int32_t row_pad;
} ktfp8_layout;

/* Orders of the FP8 bytes inside each 64-byte group of a packed tile (moe_pack.c says where each
 * byte goes; the kernel that reads the order says why). */
enum ktfp8_code_order {
    KTFP8_CODES_NATURAL = 0, /* as [k / KP][NB][KP] says */
    KTFP8_CODES_VBMI64 = 1,  /* e4m3_bf16_vbmi.h's vpermi2b + unpack order */
    KTFP8_CODES_PAIRS32 = 2  /* moe_avx2.c's: each 32 bytes (two K steps) as 4 codes per dword */
};

/* One micro-kernel call: C[m][NB] = (A[m][K] x W_tile^T) * scale, for one NB-row tile. */
typedef struct ktfp8_tile_job {
    const void *w;        /* packed weights of this tile: [k / KP][NB][KP] */
    const void *w_next;   /* the tile this thread's weight stream continues with, or NULL when not known:
                           * where the software prefetch runs on to (prefetch_ahead.h) */
    const float *scale;   /* per-channel: [NB]; block-wise: [ceil(k / block_k)][NB] */
    int32_t format;       /* enum ktfp8_wformat */
    int64_t k;            /* padded K, a multiple of KTFP8_K_ALIGN */
    int64_t block_k;      /* block-wise only: scale block b covers K [b * block_k, (b + 1) * block_k), */
    int64_t n_kblocks;    /* b < n_kblocks, except that the last block runs on to k (the padding) */
    const void *a;        /* [m][a_stride] activations in the variant's act_dtype, zero padded to k (and
                           * readable to a whole tile of rows: layout.row_pad) */
    int64_t a_stride;     /* elements */
    int32_t act_dtype;    /* KTFP8_F32 or KTFP8_BF16 */
    int64_t m;
    float *c;             /* [m][c_stride] fp32 output */
    int64_t c_stride;     /* elements */
    void *scratch;        /* per-thread, at least tile_scratch_bytes(k) bytes, 64-byte aligned */
    int32_t rescale_exp;  /* layout.act_exp kernels: results times 2^rescale_exp, the part of 2^act_exp
                           * the driver did not apply to these activations (0 almost always) */
} ktfp8_tile_job;

/* The driver's per-element steps around the micro-kernel (moe_epilogue.h), compiled in each variant's
 * unit so they run at that unit's SIMD width rather than the driver's baseline SSE2: with AMX doing the
 * products, they would otherwise be a large part of a prefill call. */
typedef struct ktfp8_epilogue_ops {
    /* Phase 1: h row i, columns [0, cols) = activation(g[i]) * u[i] (enum ktfp8_activation) in the
     * activation dtype act, for the m rows of g and u ([m][nb] FP32; g is overwritten); h rows h_stride
     * elements apart.  g clamped to at most limit and u to [-limit, limit] first (+inf: no clamp). */
    void (*glu_store)(float *g, const float *u, int64_t m, int64_t nb, int64_t cols, void *h, int64_t h_stride,
                      int act, int activation, float limit);
    /* Phase 2: acc[token[i] - token0][0, cols) += weight[i] * z[i][0, cols) for i < m; rows
     * acc_stride (acc) and z_stride (z) floats apart.  Pairs of one token accumulate in i order. */
    void (*scatter_add)(float *acc, int64_t acc_stride, const int64_t *token, int64_t token0, const float *weight,
                        const float *z, int64_t z_stride, int64_t m, int64_t cols);
} ktfp8_epilogue_ops;

/* The MoE half of a variant: its weight layout and its one micro-kernel. */
typedef struct ktfp8_moe_kernel {
    ktfp8_layout layout;
    int32_t act_dtype;                       /* KTFP8_F32 or KTFP8_BF16: what tile_matmul reads */
    size_t (*tile_scratch_bytes)(int64_t k); /* may be NULL: no scratch */
    void (*tile_matmul)(const ktfp8_tile_job *job);
    /* Optional (NULL: two tile_matmul calls): two jobs that differ only in w, scale and c (the
     * gate and up tiles of one expert), computed together so each activation tile read feeds both
     * weight tiles.  scratch is first's; it must hold tile_scratch_bytes(k). */
    void (*tile_matmul2)(const ktfp8_tile_job *first, const ktfp8_tile_job *second);
    /* Optional (NULL: nothing to let go): frees what this thread's tile_matmul calls kept for the
     * next one (amx: the tile configuration).  Whoever calls tile_matmul calls it on each thread after
     * that thread's last call of a run (the driver: of a forward), before other code that may use
     * the same CPU state. */
    void (*release)(void);
    const ktfp8_epilogue_ops *epilogue;      /* KTFP8_EPILOGUE_OPS in the variant's unit */
} ktfp8_moe_kernel;

/* A variant as dispatch.c hands it out: a codec and a MoE kernel compiled for one ISA level. */
typedef struct ktfp8_variant {
    const char *name;
    const ktfp8_codec_ops *codec;
    const ktfp8_moe_kernel *moe;
} ktfp8_variant;

/* A forward call: y[T, H] (+)= sum over slots of w * expert(x). */
typedef struct ktfp8_moe_call {
    const ktfp8_moe_shape *shape;
    const void *packed;            /* buffer filled by ktfp8_pack for this variant's layout */
    int64_t tokens, top_k;
    const void *x;                 /* [T, H] in x_dtype (F32 or BF16), C-contiguous */
    int32_t x_dtype;
    const int64_t *topk_ids;       /* [T, top_k]; < 0: skip this slot */
    const void *topk_weights;      /* [T, top_k] in weights_dtype: F32, or BF16 (widened exactly) */
    int32_t weights_dtype;
    void *y;                       /* [T, H] in x_dtype */
    int32_t accumulate;            /* 1: add into y */
    int32_t threads;               /* > 0 */
    int32_t act_dtype;             /* activations given to tile_matmul; normally moe->act_dtype */
    int64_t layer_experts;         /* the whole layer's expert count, of which shape->experts may be a
                                    * shard (0: shape->experts); sets phase 2's token blocks alike for
                                    * every shard (moe_driver.c, phase2_block_tokens) */
    int32_t activation;            /* enum ktfp8_activation: h = activation(gate) * up */
    float swiglu_limit;            /* > 0: gate at most this and up within +-it before activation(gate) * up
                                    * (DeepSeek-V4's clamped SwiGLU); +inf: none */
} ktfp8_moe_call;

#ifdef __cplusplus
}
#endif
#endif
