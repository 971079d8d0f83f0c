/* AVX2 + FMA + F16C FP8 E4M3 codec, bit-identical to fp8_codec_reference.c for every input.
 *
 * Encode lets the FPU round each float32 to e4m3 precision (a magic-number add, 8 lanes at a time)
 * and reads the code off the result's bits; decode goes code -> IEEE half bits -> vcvtph2ps, which
 * is exact (e4m3_f16.h).  These are the vector steps, 32 values each; the loops, the tail and the
 * exported table are codec_skeleton.h's. */
#include "ktfp8/abi.h"
#include "ktfp8/e4m3_f16.h"
#include "ktfp8/fp8.h"
#include "ktfp8/simd.h"

enum { CODEC_STEP = 32 }; /* values per step: four vectors of 8 */
typedef __m256 codec_scale;
typedef struct codec_amax_acc { __m256i best[4]; } codec_amax_acc;

/* ------------------------------------------------------------------ loads: 8 values -> float32 */

static inline __attribute__((always_inline)) __m256 load8(const void *src, int dtype, size_t i) {
    if (dtype == KTFP8_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dtype == KTFP8_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
    return _mm256_loadu_ps((const float *)src + i);
}

/* ------------------------------------------------------------------ encode */

/* 8 floats (any bits: NaN, Inf, subnormal) -> 8 e4m3 codes in the low byte of each int32 lane.
 *
 * The FPU does the rounding: with e the exponent of |v| (at least -6, where e4m3 subnormals start),
 * |v| + 2^(e+20) has ulp 2^(e-3), i.e. it rounds |v| to e4m3 precision, nearest even, with carries
 * into the next binade and the subnormal grid (2^-9 steps below 2^-6) coming out right; subtracting
 * 2^(e+20) again is exact.  The rounded value times 2^-120 is a float32 whose bits >> 20 are the
 * code: 120 rebiases the exponent 127 -> 7, and e4m3 subnormals land on float32 subnormals.
 * min(448, |v|) saturates (Inf included) and keeps NaN (vminps returns its second operand when
 * either is NaN); a NaN ends as bits 0x7FC..., which the final min turns into 0x7F. */
static inline __m256i e4m3_from_f32x8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i sign = _mm256_xor_si256(bits, mag);
    const __m256 m = _mm256_min_ps(_mm256_set1_ps(KTFP8_E4M3_MAX), _mm256_castsi256_ps(mag));
    const __m256i exponent = _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(0x7F800000));
    const __m256i magic_bits = _mm256_add_epi32(_mm256_max_epi32(exponent, _mm256_set1_epi32(0x3C800000)),
                                                _mm256_set1_epi32(20 << 23));
    const __m256 magic = _mm256_castsi256_ps(magic_bits);
    const __m256 rounded = _mm256_sub_ps(_mm256_add_ps(m, magic), magic);
    const __m256 rebiased = _mm256_mul_ps(rounded, _mm256_set1_ps(0x1p-120f));
    const __m256i code = _mm256_min_epi32(_mm256_srli_epi32(_mm256_castps_si256(rebiased), 20), _mm256_set1_epi32(0x7F));
    return _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
}

/* Four vectors of int32 codes (0..255) -> 32 bytes in order.  The two packs interleave 128-bit
 * lanes: dword d of the result holds codes of vector d % 4, lane d / 4; the permute undoes that. */
static inline __m256i pack_codes(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline __attribute__((always_inline)) codec_scale codec_broadcast(float scale) { return _mm256_set1_ps(scale); }

static inline __attribute__((always_inline)) void codec_quantize_step(const void *src, int dtype, size_t i,
                                                                      codec_scale scale, int divide, uint8_t *codes) {
    __m256 v[4];
    for (int k = 0; k < 4; k++) {
        v[k] = load8(src, dtype, i + 8 * k);
        if (divide) v[k] = _mm256_div_ps(v[k], scale); /* a true division: x * (1/s) rounds differently */
    }
    const __m256i out = pack_codes(e4m3_from_f32x8(v[0]), e4m3_from_f32x8(v[1]), e4m3_from_f32x8(v[2]),
                                   e4m3_from_f32x8(v[3]));
    _mm256_storeu_si256((__m256i *)(codes + i), out);
}

/* ------------------------------------------------------------------ amax */

/* Largest finite |v|, compared as integers: non-negative floats order like their bit patterns. */
static inline __attribute__((always_inline)) __m256i finite_mag(__m256 v) {
    const __m256i mag = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
    return _mm256_and_si256(mag, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), mag));
}

static inline __attribute__((always_inline)) void codec_amax_zero(codec_amax_acc *acc) {
    for (int k = 0; k < 4; k++) acc->best[k] = _mm256_setzero_si256();
}

static inline __attribute__((always_inline)) void codec_amax_step(codec_amax_acc *acc, const void *src, int dtype,
                                                                  size_t i) {
    for (int k = 0; k < 4; k++) acc->best[k] = _mm256_max_epi32(acc->best[k], finite_mag(load8(src, dtype, i + 8 * k)));
}

static inline __attribute__((always_inline)) float codec_amax_value(const codec_amax_acc *acc) {
    const __m256i *best = acc->best;
    __m256i m = _mm256_max_epi32(_mm256_max_epi32(best[0], best[1]), _mm256_max_epi32(best[2], best[3]));
    __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return ktfp8_bits_f32((uint32_t)_mm_cvtsi128_si32(h));
}

/* ------------------------------------------------------------------ decode */

/* 16 codes -> 16 floats (e4m3_f16.h), NaN codes -> the reference's 0x7FC00000 | sign. */
static inline void decode16(__m128i codes, __m256 *lo, __m256 *hi) {
    const __m256i h = ktfp8_e4m3x16_to_f16_nan(codes);
    const __m256 k256 = _mm256_set1_ps(256.0f);
    *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k256);
    *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k256);
}

/* 8 floats -> 8 bf16 bit patterns in int32 lanes, nearest even, NaN -> quiet NaN (as fp8.h). */
static inline __m256i bf16_from_f32x8(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
    return _mm256_blendv_epi8(rounded, quiet, _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000)));
}

static inline __attribute__((always_inline)) void codec_dequantize_step(const uint8_t *codes, size_t i,
                                                                        codec_scale scale, void *dst, int dtype) {
    for (int half = 0; half < 2; half++) {
        __m256 lo, hi;
        decode16(_mm_loadu_si128((const __m128i *)(codes + i + 16 * half)), &lo, &hi);
        lo = _mm256_mul_ps(lo, scale);
        hi = _mm256_mul_ps(hi, scale);
        const size_t j = i + 16 * half;
        if (dtype == KTFP8_BF16) {
            /* packus interleaves lanes: [lo 0-3, hi 0-3 | lo 4-7, hi 4-7] -> qwords 0, 2, 1, 3 */
            const __m256i p = _mm256_packus_epi32(bf16_from_f32x8(lo), bf16_from_f32x8(hi));
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + j), _mm256_permute4x64_epi64(p, _MM_SHUFFLE(3, 1, 2, 0)));
        } else {
            _mm256_storeu_ps((float *)dst + j, lo);
            _mm256_storeu_ps((float *)dst + j + 8, hi);
        }
    }
}

#include "ktfp8/codec_skeleton.h"
