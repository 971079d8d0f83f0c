/* Portable MoE micro-kernel, written for clarity: the oracle every fast variant is tested against.
 * Layout: one output row per tile, K unpacked (plain Hugging Face rows, padded to KTFP8_K_ALIGN). */
#include "ktfp8/abi.h"
#include "ktfp8/moe_epilogue.h"
#include "ktfp8/fp8.h"

static float weight_at(const ktfp8_tile_job *j, int64_t k) {
    if (j->format == KTFP8_FMT_BF16) return ktfp8_bf16_to_f32(((const uint16_t *)j->w)[k]);
    return ktfp8_e4m3_to_f32(((const uint8_t *)j->w)[k]);
}

static float act_at(const ktfp8_tile_job *j, int64_t m, int64_t k) {
    size_t i = (size_t)(m * j->a_stride + k);
    if (j->act_dtype == KTFP8_BF16) return ktfp8_bf16_to_f32(((const uint16_t *)j->a)[i]);
    return ((const float *)j->a)[i];
}

static void tile_matmul(const ktfp8_tile_job *j) {
    /* Per-channel and BF16 are one block spanning all of K; block-wise applies its scale to each
     * block's partial sum (k0 is 0 there: the loop runs once). */
    const int blockwise = j->format == KTFP8_FMT_FP8_BLOCK;
    const int64_t nkb = blockwise ? j->n_kblocks : 1;
    for (int64_t m = 0; m < j->m; m++) {
        float acc = 0.0f;
        for (int64_t kb = 0; kb < nkb; kb++) {
            const int64_t k0 = blockwise ? kb * j->block_k : 0, k1 = kb == nkb - 1 ? j->k : k0 + j->block_k;
            float part = 0.0f;
            for (int64_t k = k0; k < k1; k++) part += act_at(j, m, k) * weight_at(j, k);
            acc += j->format == KTFP8_FMT_BF16 ? part : part * j->scale[kb];
        }
        j->c[m * j->c_stride] = acc;
    }
}

KTFP8_EPILOGUE_OPS(epilogue);

const ktfp8_moe_kernel ktfp8_moe_reference = {
    .layout = {.rows_per_tile = 1, .k_pack = 1, .scale_mul = 1.0f, .code_order = KTFP8_CODES_NATURAL},
    .act_dtype = KTFP8_F32,
    .tile_scratch_bytes = NULL,
    .tile_matmul = tile_matmul,
    .epilogue = &epilogue,
};
