/* AVX2 + FMA + F16C FP8 E4M3 codec, bit-identical to fp8_codec_reference.c for every input.
 *
 * Encode lets the FPU round each float32 to e4m3 precision (a magic-number add, 8 lanes at a time)
 * and reads the code off the result's bits; decode goes code -> IEEE half bits -> vcvtph2ps, which
 * is exact.  Runs are processed 32 values per step; a tail shorter than that goes through the same
 * vector step via a zero-padded stack buffer, so every value takes the vector path.  Like the
 * reference (division, nearbyintf), this relies on the FPU's default round-to-nearest-even mode. */
#include "ktfp8/abi.h"
#include "ktfp8/fp8.h"
#include "ktfp8/simd.h"
#include "ktfp8/variant.h"

#define STEP 32 /* values per loop step: four vectors of 8 */

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

static inline __attribute__((always_inline)) void quantize_step(const void *src, int dtype, size_t i,
                                                                __m256 scale, int divide, uint8_t *codes) {
    __m256 v[4];
    for (int k = 0; k < 4; k++) {
        v[k] = load8(src, dtype, i + 8 * k);
        if (divide) v[k] = _mm256_div_ps(v[k], scale); /* a true division: x * (1/s) rounds differently */
    }
    const __m256i out = pack_codes(e4m3_from_f32x8(v[0]), e4m3_from_f32x8(v[1]), e4m3_from_f32x8(v[2]),
                                   e4m3_from_f32x8(v[3]));
    _mm256_storeu_si256((__m256i *)(codes + i), out);
}

static inline __attribute__((always_inline)) void quantize_run(const void *src, int dtype, size_t n,
                                                               float scale, uint8_t *codes) {
    const __m256 s = _mm256_set1_ps(scale);
    const int divide = scale != 1.0f; /* v / 1 == v, bit for bit */
    size_t i = 0;
    for (; i + STEP <= n; i += STEP) quantize_step(src, dtype, i, s, divide, codes);
    if (i < n) {
        const size_t esize = dtype == KTFP8_F32 ? 4 : 2, rest = n - i;
        float in[STEP] = {0};
        uint8_t out[STEP];
        memcpy(in, (const char *)src + i * esize, rest * esize);
        quantize_step(in, dtype, 0, s, divide, out);
        memcpy(codes + i, out, rest);
    }
}

static void quantize(const void *src, int dtype, size_t n, float scale, uint8_t *codes) {
    switch (dtype) { /* one specialised loop per input type */
    case KTFP8_BF16: quantize_run(src, KTFP8_BF16, n, scale, codes); break;
    case KTFP8_F16: quantize_run(src, KTFP8_F16, n, scale, codes); break;
    default: quantize_run(src, KTFP8_F32, n, scale, codes); break;
    }
}

/* ------------------------------------------------------------------ amax */

/* Largest finite |v|, compared as integers: non-negative floats order like their bit patterns. */
static inline __attribute__((always_inline)) __m256i finite_mag(__m256 v) {
    const __m256i mag = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
    return _mm256_and_si256(mag, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), mag));
}

static inline __attribute__((always_inline)) float amax_run(const void *src, int dtype, size_t n) {
    __m256i best[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                       _mm256_setzero_si256()};
    size_t i = 0;
    for (; i + STEP <= n; i += STEP)
        for (int k = 0; k < 4; k++) best[k] = _mm256_max_epi32(best[k], finite_mag(load8(src, dtype, i + 8 * k)));
    if (i < n) {
        const size_t esize = dtype == KTFP8_F32 ? 4 : 2;
        float in[STEP] = {0}; /* zero padding never raises the max */
        memcpy(in, (const char *)src + i * esize, (n - i) * esize);
        for (int k = 0; k < 4; k++) best[k] = _mm256_max_epi32(best[k], finite_mag(load8(in, dtype, 8 * k)));
    }
    __m256i m = _mm256_max_epi32(_mm256_max_epi32(best[0], best[1]), _mm256_max_epi32(best[2], best[3]));
    __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return ktfp8_bits_f32((uint32_t)_mm_cvtsi128_si32(h));
}

static float amax(const void *src, int dtype, size_t n) {
    switch (dtype) {
    case KTFP8_BF16: return amax_run(src, KTFP8_BF16, n);
    case KTFP8_F16: return amax_run(src, KTFP8_F16, n);
    default: return amax_run(src, KTFP8_F32, n);
    }
}

/* ------------------------------------------------------------------ decode */

/* 16 codes -> 16 floats.  S.EEEE.MMM placed as half bits S.0EEEE.MMM0000000 is the same number
 * times 2^-8 for every code, subnormals included (half bias 15 = e4m3 bias 7 + 8), so vcvtph2ps
 * and one exact multiply by 256 decode it.  NaN codes become the half NaN 0x7E00 | sign, which
 * converts to the reference's 0x7FC00000 | sign (NaN * 256 keeps its bits). */
static inline void decode16(__m128i codes, __m256 *lo, __m256 *hi) {
    const __m256i w = _mm256_cvtepu8_epi16(codes);
    const __m256i m7 = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
    __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16((short)0x8000)),
                                _mm256_slli_epi16(m7, 7));
    /* a NaN code gives 0x3F80 | sign here; 0x3F80 ^ 0x4180 = 0x7E00 */
    const __m256i is_nan = _mm256_cmpeq_epi16(m7, _mm256_set1_epi16(0x7F));
    h = _mm256_xor_si256(h, _mm256_and_si256(is_nan, _mm256_set1_epi16(0x4180)));
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

static inline __attribute__((always_inline)) void dequantize_step(const uint8_t *codes, size_t i, __m256 scale,
                                                                  void *dst, int dtype) {
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

static inline __attribute__((always_inline)) void dequantize_run(const uint8_t *codes, size_t n, float scale,
                                                                 void *dst, int dtype) {
    const __m256 s = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + STEP <= n; i += STEP) dequantize_step(codes, i, s, dst, dtype);
    if (i < n) {
        const size_t esize = dtype == KTFP8_F32 ? 4 : 2, rest = n - i;
        uint8_t in[STEP] = {0};
        float out[STEP];
        memcpy(in, codes + i, rest);
        dequantize_step(in, 0, s, out, dtype);
        memcpy((char *)dst + i * esize, out, rest * esize);
    }
}

static void dequantize(const uint8_t *codes, size_t n, float scale, void *dst, int dtype) {
    if (dtype == KTFP8_BF16)
        dequantize_run(codes, n, scale, dst, KTFP8_BF16);
    else
        dequantize_run(codes, n, scale, dst, KTFP8_F32);
}

const ktfp8_codec_ops KTFP8_SYM(ktfp8_codec) = {amax, quantize, dequantize};
