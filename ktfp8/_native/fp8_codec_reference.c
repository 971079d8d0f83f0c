/* Portable FP8 codec: the definition the vector codecs are tested against. */
#include "ktfp8/abi.h"
#include "ktfp8/fp8.h"

static float amax(const void *src, int dtype, size_t n) {
    float best = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(ktfp8_load_f32(src, dtype, i));
        if (a <= 3.4028235e38f && a > best) best = a; /* finite only: NaN and Inf never compare <= */
    }
    return best;
}

static void quantize(const void *src, int dtype, size_t n, float scale, uint8_t *codes) {
    for (size_t i = 0; i < n; i++) codes[i] = ktfp8_e4m3_from_f32(ktfp8_load_f32(src, dtype, i) / scale);
}

static void dequantize(const uint8_t *codes, size_t n, float scale, void *dst, int dtype) {
    for (size_t i = 0; i < n; i++) {
        float v = ktfp8_e4m3_to_f32(codes[i]) * scale;
        if (dtype == KTFP8_BF16)
            ((uint16_t *)dst)[i] = ktfp8_bf16_from_f32(v);
        else
            ((float *)dst)[i] = v;
    }
}

const ktfp8_codec_ops ktfp8_codec_reference = {amax, quantize, dequantize};
