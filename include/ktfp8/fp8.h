/* Scalar FP8 E4M3 ("e4m3fn": bias 7, max 448, no infinities, NaN = S.1111.111) and BF16 helpers.
 * These define the rounding rules every vector path must reproduce bit for bit. */
#ifndef KTFP8_FP8_H
#define KTFP8_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ktfp8/abi.h" /* enum ktfp8_dtype */

#define KTFP8_E4M3_MAX 448.0f

static inline uint32_t ktfp8_f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static inline float ktfp8_bits_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

static inline int ktfp8_e4m3_is_nan(uint8_t code) { return (code & 0x7F) == 0x7F; }

/* float -> e4m3: saturate to +-448 (Inf included), round to nearest even, NaN -> 0x7F | sign.
 * Same as ml_dtypes.float8_e4m3fn(clip(f, -448, 448)). */
static inline uint8_t ktfp8_e4m3_from_f32(float f) {
    uint32_t bits = ktfp8_f32_bits(f);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    uint32_t mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) return sign | 0x7F;   /* NaN */
    if (mag >= 0x43E00000u) return sign | 0x7E;  /* >= 448: saturate */
    if (mag >= 0x3C800000u) {                    /* >= 2^-6: normal e4m3 */
        /* round the 23-bit mantissa to 3 bits, nearest even (bit 20 is the kept lsb); a carry
         * into the exponent is the correct result.  Then rebias 127 -> 7. */
        uint32_t r = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;
        return sign | (uint8_t)(r - (120u << 3));
    }
    /* subnormal e4m3: m * 2^-9, m = 0..7 (8 rounds up to the smallest normal, code 0x08).
     * The scaling by 2^9 is exact; nearbyintf rounds half to even. */
    float m = nearbyintf(ktfp8_bits_f32(mag) * 512.0f);
    return sign | (uint8_t)m;
}

/* e4m3 -> float, exact for every code. */
static inline float ktfp8_e4m3_to_f32(uint8_t code) {
    uint32_t sign = (uint32_t)(code & 0x80) << 24;
    uint32_t e = (code >> 3) & 0xF, m = code & 7;
    if (e == 15 && m == 7) return ktfp8_bits_f32(sign | 0x7FC00000u);
    if (e == 0) return ktfp8_bits_f32(sign | ktfp8_f32_bits((float)m * (1.0f / 512.0f)));
    return ktfp8_bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

/* float -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t ktfp8_bf16_from_f32(float f) {
    uint32_t b = ktfp8_f32_bits(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

static inline float ktfp8_bf16_to_f32(uint16_t h) { return ktfp8_bits_f32((uint32_t)h << 16); }

/* IEEE half bits -> float, exact (portable; vector units use F16C). */
static inline float ktfp8_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0x1F) return ktfp8_bits_f32(sign | 0x7F800000u | (m << 13));
    if (e == 0) return ktfp8_bits_f32(sign | ktfp8_f32_bits((float)m * (1.0f / 16777216.0f)));
    return ktfp8_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* One element of an F32 / BF16 / F16 array as float. */
static inline float ktfp8_load_f32(const void *src, int dtype, size_t i) {
    switch (dtype) {
    case KTFP8_BF16: return ktfp8_bf16_to_f32(((const uint16_t *)src)[i]);
    case KTFP8_F16: return ktfp8_f16_to_f32(((const uint16_t *)src)[i]);
    default: return ((const float *)src)[i];
    }
}

#endif
