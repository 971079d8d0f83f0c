/* AVX-512 (F/BW/VL) FP8 E4M3 codec, bit-identical to fp8_codec_reference.c for every input.
 *
 * The same arithmetic as fp8_codec_avx2.c, 16 lanes wide with mask registers.  This source is also
 * compiled as the test-only avx512_emulated variant against SIMDe (simd.h), so it sticks to
 * intrinsics that SIMDe 0.7 implements (or that simd.h stands in for).  These are the vector steps,
 * 64 values each; the loops, the tail and the exported table are codec_skeleton.h's. */
#include "ktfp8/abi.h"
#include "ktfp8/e4m3_f16.h"
#include "ktfp8/fp8.h"
#include "ktfp8/simd.h"

enum { CODEC_STEP = 64 }; /* values per step: four vectors of 16 */
typedef __m512 codec_scale;
typedef struct codec_amax_acc { __m512i best[4]; } codec_amax_acc;

/* ------------------------------------------------------------------ loads: 16 values -> float32 */

static inline __attribute__((always_inline)) __m512 load16(const void *src, int dtype, size_t i) {
    const __m256i h = dtype == KTFP8_F32 ? _mm256_setzero_si256()
                                         : _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i));
    if (dtype == KTFP8_BF16) {
        /* bf16 k goes to the high half of dword k: word 2k + 1 takes element k, word 2k is cleared */
        const __m512i idx = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                                             7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512i w = _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(h));
        return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
    if (dtype == KTFP8_F16) return _mm512_cvtph_ps(h);
    return _mm512_loadu_ps((const float *)src + i);
}

/* ------------------------------------------------------------------ encode */

/* 16 floats (any bits) -> 16 e4m3 codes in the low byte of each int32 lane; see
 * fp8_codec_avx2.c e4m3_from_f32x8 for why each step is exact. */
static inline __m512i e4m3_from_f32x16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i sign = _mm512_xor_si512(bits, mag);
    /* saturate to 448 (Inf too); NaN is kept: vminps returns its second operand then */
    const __m512 m = _mm512_min_ps(_mm512_set1_ps(KTFP8_E4M3_MAX), _mm512_castsi512_ps(mag));
    /* magic = 2^(max(e, -6) + 20): adding and subtracting it rounds to e4m3 precision, nearest even */
    const __m512i exponent = _mm512_and_si512(_mm512_castps_si512(m), _mm512_set1_epi32(0x7F800000));
    const __m512i magic_bits = _mm512_add_epi32(_mm512_max_epi32(exponent, _mm512_set1_epi32(0x3C800000)),
                                                _mm512_set1_epi32(20 << 23));
    const __m512 magic = _mm512_castsi512_ps(magic_bits);
    const __m512 rounded = _mm512_sub_ps(_mm512_add_ps(m, magic), magic);
    /* times 2^-120: float32 bits >> 20 are the code (NaN: 0x7FC.., clamped to 0x7F) */
    const __m512 rebiased = _mm512_mul_ps(rounded, _mm512_set1_ps(0x1p-120f));
    const __m512i code = _mm512_min_epi32(_mm512_srli_epi32(_mm512_castps_si512(rebiased), 20), _mm512_set1_epi32(0x7F));
    return _mm512_or_si512(code, _mm512_srli_epi32(sign, 24));
}

/* Four vectors of int32 codes -> 64 bytes in order.  After the two packs, dword d holds four
 * codes of vector d % 4 from 128-bit lane d / 4; the permute puts them back in order. */
static inline __m512i pack_codes(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
    const __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_epi32(idx, b);
}

static inline __attribute__((always_inline)) codec_scale codec_broadcast(float scale) { return _mm512_set1_ps(scale); }

static inline __attribute__((always_inline)) void codec_quantize_step(const void *src, int dtype, size_t i,
                                                                      codec_scale scale, int divide, uint8_t *codes) {
    __m512 v[4];
    for (int k = 0; k < 4; k++) {
        v[k] = load16(src, dtype, i + 16 * k);
        if (divide) v[k] = _mm512_div_ps(v[k], scale); /* a true division, as the reference */
    }
    const __m512i out = pack_codes(e4m3_from_f32x16(v[0]), e4m3_from_f32x16(v[1]), e4m3_from_f32x16(v[2]),
                                   e4m3_from_f32x16(v[3]));
    _mm512_storeu_si512((void *)(codes + i), out);
}

/* ------------------------------------------------------------------ amax */

/* max over finite |v| as integers (non-negative floats order like their bits); others count 0 */
static inline __attribute__((always_inline)) __m512i max_finite(__m512i best, __m512 v) {
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 finite = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x7F800000), mag);
    return _mm512_mask_max_epi32(best, finite, best, mag);
}

static inline __attribute__((always_inline)) void codec_amax_zero(codec_amax_acc *acc) {
    for (int k = 0; k < 4; k++) acc->best[k] = _mm512_setzero_si512();
}

static inline __attribute__((always_inline)) void codec_amax_step(codec_amax_acc *acc, const void *src, int dtype,
                                                                  size_t i) {
    for (int k = 0; k < 4; k++) acc->best[k] = max_finite(acc->best[k], load16(src, dtype, i + 16 * k));
}

static inline __attribute__((always_inline)) float codec_amax_value(const codec_amax_acc *acc) {
    const __m512i *best = acc->best;
    const __m512i m = _mm512_max_epi32(_mm512_max_epi32(best[0], best[1]), _mm512_max_epi32(best[2], best[3]));
    int32_t lanes[16];
    _mm512_storeu_si512((void *)lanes, m);
    int32_t top = 0;
    for (int k = 0; k < 16; k++) top = lanes[k] > top ? lanes[k] : top;
    return ktfp8_bits_f32((uint32_t)top);
}

/* ------------------------------------------------------------------ decode */

/* 32 codes -> 32 floats (e4m3_f16.h), NaN codes -> the reference's 0x7FC00000 | sign. */
static inline void decode32(__m256i codes, __m512 *lo, __m512 *hi) {
    const __m512i h = ktfp8_e4m3x32_to_f16_nan(codes);
    const __m512 k256 = _mm512_set1_ps(256.0f);
    *lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 0)), k256);
    *hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), k256);
}

/* 16 floats -> 16 bf16 bit patterns in int32 lanes, nearest even, NaN -> quiet NaN (as fp8.h). */
static inline __m512i bf16_from_f32x16(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7F800000)), rounded, quiet);
}

static inline __attribute__((always_inline)) void codec_dequantize_step(const uint8_t *codes, size_t i,
                                                                        codec_scale scale, void *dst, int dtype) {
    for (int half = 0; half < 2; half++) {
        __m512 lo, hi;
        const size_t j = i + 32 * half;
        decode32(_mm256_loadu_si256((const __m256i *)(codes + j)), &lo, &hi);
        lo = _mm512_mul_ps(lo, scale);
        hi = _mm512_mul_ps(hi, scale);
        if (dtype == KTFP8_BF16) {
            /* packus per 128-bit lane: [lo 4L..4L+3, hi 4L..4L+3]; qwords 0,2,4,6 are lo, 1,3,5,7 hi */
            const __m512i p = _mm512_packus_epi32(bf16_from_f32x16(lo), bf16_from_f32x16(hi));
            const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
            _mm512_storeu_si512((void *)((uint16_t *)dst + j), _mm512_permutexvar_epi64(order, p));
        } else {
            _mm512_storeu_ps((float *)dst + j, lo);
            _mm512_storeu_ps((float *)dst + j + 16, hi);
        }
    }
}

#include "ktfp8/codec_skeleton.h"
