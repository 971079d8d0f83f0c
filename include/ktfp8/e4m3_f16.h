/* FP8 E4M3 -> IEEE half bits, for vcvtph2ps: the FP8 decode of the units without VBMI (the AVX2
 * and AVX-512 F/BW codecs and MoE kernels).  e4m3_bf16_vbmi.h is the byte-table route of the
 * units that have VBMI.
 *
 * The trick, exact for every code: the e4m3 code S.EEEE.MMM placed as the half S.0EEEE.MMM0000000
 * is the same number times 2^-8.  The exponent biases differ by 8 (half 15, e4m3 7), and the e4m3
 * subnormals m * 2^-9 land on the half subnormals m * 2^-17.  So vcvtph2ps widens the code to FP32
 * exactly and one exact multiplication by 256 restores its value; the MoE kernels fold that 256
 * into the packed scales (ktfp8_layout.scale_mul), the codec multiplies.
 *
 * Building the half: sign-extend the byte to 16 bits and shift it left by 7 -- S lands in bit 15,
 * EEEE.MMM in bits 13..7, and a copy of S in bit 14, which the AND with 0xBFFF clears.
 *
 * NaN: the NaN codes S.1111.111 become the finite half S.01111.1110000000 (+-480 / 256).  The MoE
 * kernels keep that and rely on the NaN scale moe_pack.c gives every row holding a NaN code; the
 * codec needs the NaN itself and uses the *_nan forms, which turn those lanes into the half quiet
 * NaN 0x7E00 | S (vcvtph2ps: 0x7FC00000 | S, the value ktfp8_e4m3_to_f32 returns; NaN * 256 keeps
 * its bits).
 *
 * Include after "ktfp8/simd.h".  The AVX2 forms need AVX2 + F16C, the AVX-512 forms AVX-512 F/BW
 * (or the *_emulated build, KTFP8_EMULATE_SIMD). */
#ifndef KTFP8_E4M3_F16_H
#define KTFP8_E4M3_F16_H

#include "ktfp8/simd.h"

#if defined(__AVX2__) || defined(KTFP8_EMULATE_SIMD)
/* 16 codes -> 16 half bit patterns (value / 256; NaN codes -> +-480 / 256). */
static inline __attribute__((always_inline)) __m256i ktfp8_e4m3x16_to_f16(__m128i codes) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7), _mm256_set1_epi16((short)0xBFFF));
}

/* The same with the NaN codes as the half NaN 0x7E00 | S: their halves are S.01111.1110000000,
 * i.e. 0x3F80 | S, and 0x3F80 ^ 0x4180 = 0x7E00. */
static inline __attribute__((always_inline)) __m256i ktfp8_e4m3x16_to_f16_nan(__m128i codes) {
    const __m256i h = ktfp8_e4m3x16_to_f16(codes);
    const __m256i is_nan =
        _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x3F80));
    return _mm256_xor_si256(h, _mm256_and_si256(is_nan, _mm256_set1_epi16(0x4180)));
}
#endif

#if defined(__AVX512BW__) || defined(KTFP8_EMULATE_SIMD)
/* 32 codes -> 32 half bit patterns (value / 256; NaN codes -> +-480 / 256). */
static inline __attribute__((always_inline)) __m512i ktfp8_e4m3x32_to_f16(__m256i codes) {
    return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), 7), _mm512_set1_epi16((short)0xBFFF));
}

/* The same with the NaN codes as the half NaN 0x7E00 | S (see ktfp8_e4m3x16_to_f16_nan).  0x3F80 is
 * the largest magnitude a code gives, so >= is == here (SIMDe 0.7 has no cmpeq_epi16_mask). */
static inline __attribute__((always_inline)) __m512i ktfp8_e4m3x32_to_f16_nan(__m256i codes) {
    const __m512i h = ktfp8_e4m3x32_to_f16(codes);
    const __mmask32 is_nan =
        _mm512_cmpge_epu16_mask(_mm512_and_si512(h, _mm512_set1_epi16(0x7FFF)), _mm512_set1_epi16(0x3F80));
    return _mm512_mask_mov_epi16(h, is_nan, _mm512_xor_si512(h, _mm512_set1_epi16(0x4180)));
}
#endif

#endif
