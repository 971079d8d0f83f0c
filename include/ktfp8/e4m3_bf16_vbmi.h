/* FP8 E4M3 -> BF16 in AVX-512 VBMI registers, exact for all 256 codes.
 *
 * Interface (stable; shared by moe_avx512bf16.c and moe_amx.c).  Include after "ktfp8/simd.h" in a
 * unit compiled with AVX-512 F/BW + VBMI (or the *_emulated flags):
 *
 *   ktfp8_e4m3_bf16_lut lut;
 *   ktfp8_e4m3_bf16_lut_load(&lut);
 *       The bf16 value of the 128 magnitudes 0x00..0x7F, split into a high-byte table and a low-byte
 *       table of 128 entries, each in a pair of zmm registers.  Load once per kernel call, outside
 *       the loops (after inlining the four vectors stay in registers).
 *
 *   __m512i lo32, hi32;
 *   ktfp8_e4m3x64_to_bf16(&lut, codes, &lo32, &hi32);
 *       codes: pointer to 64 FP8 bytes (any alignment) stored in KTFP8_CODES_VBMI64 order (moe_pack.c,
 *       code_pos); lo32 receives the bf16 bits of natural codes 0..31, hi32 of natural codes
 *       32..63.  Cost: 1 load, 2 vpermi2b, 1 vpternlogd, 2 vpunpck*bw.  (A pointer, not an __m512i
 *       argument: the emulated build has no AVX-512 calling convention and GCC warns about it.)
 *
 *   ktfp8_e4m3_tile_to_bf16(codes, k, dst, ahead, offset);
 *       One packed FP8 tile of the layout {rows_per_tile 16, k_pack 2, KTFP8_CODES_VBMI64}, i.e. codes
 *       [k/2][16][2] permuted inside each 64-byte group, k a multiple of 4, to bf16 bits
 *       dst[k/2][16][2] in natural order: row kk of dst is one AMX B-tile row (16 columns x 2 K).
 *       To convert a K range [k0, k0 + n) (k0, n multiples of 4) pass codes + 16 * k0,
 *       n, dst + 16 * k0, offset 16 * k0.  The codes are prefetched from the tile's software
 *       prefetch `ahead` (prefetch_ahead.h: far into L2, near into L1), codes being tile byte
 *       `offset`.
 *
 * Values: a code's bf16 is its exact E4M3 value (E4M3 has 3 mantissa bits, BF16 has 7; subnormals
 * 0x01..0x07 = m * 2^-9 are normal in BF16); zero codes give +-0; the NaN codes 0x7F / 0xFF give
 * the quiet NaN 0x7FC0 / 0xFFC0, the value ktfp8_e4m3_to_f32 returns. */
#ifndef KTFP8_E4M3_BF16_VBMI_H
#define KTFP8_E4M3_BF16_VBMI_H

#include <stdint.h>

#include "ktfp8/prefetch_ahead.h"
#include "ktfp8/simd.h"

typedef struct ktfp8_e4m3_bf16_lut {
    __m512i hi0, hi1; /* high byte of bf16(code) for codes 0..63 and 64..127 */
    __m512i lo0, lo1; /* low byte, same split */
} ktfp8_e4m3_bf16_lut;

/* bf16(mag) for mag = 0x00..0x7F.  Normal codes (mag >= 8) are (mag << 4) + 0x3C00: the E4M3
 * exponent field rebiased 7 -> 127 and the 3 mantissa bits moved to the top of bf16's 7.
 * Subnormals m * 2^-9: 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60.  0x7F: NaN 0x7FC0. */
static const uint8_t ktfp8_e4m3_bf16_hi_bytes[128] __attribute__((aligned(64))) = {
    0x00, 0x3B, 0x3B, 0x3B, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C,
    0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D,
    0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E,
    0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x7F,
};
static const uint8_t ktfp8_e4m3_bf16_lo_bytes[128] __attribute__((aligned(64))) = {
    0x00, 0x00, 0x80, 0xC0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xC0,
};

static inline void ktfp8_e4m3_bf16_lut_load(ktfp8_e4m3_bf16_lut *lut) {
    lut->hi0 = _mm512_load_si512((const void *)ktfp8_e4m3_bf16_hi_bytes);
    lut->hi1 = _mm512_load_si512((const void *)(ktfp8_e4m3_bf16_hi_bytes + 64));
    lut->lo0 = _mm512_load_si512((const void *)ktfp8_e4m3_bf16_lo_bytes);
    lut->lo1 = _mm512_load_si512((const void *)(ktfp8_e4m3_bf16_lo_bytes + 64));
}

KTFP8_INLINE_UNLESS_EMULATED void
ktfp8_e4m3x64_to_bf16(const ktfp8_e4m3_bf16_lut *lut, const void *codes64, __m512i *lo32, __m512i *hi32) {
    const __m512i codes = _mm512_loadu_si512(codes64);
    /* vpermi2b reads index bits 0..6 only (bit 6 picks the second table), so the sign bit of each
     * code is ignored by the lookup and ORed into the high byte afterwards:
     * ternary 0xF8 = A | (B & C) with A = high bytes, B = codes, C = 0x80. */
    __m512i hi = _mm512_permutex2var_epi8(lut->hi0, codes, lut->hi1);
    __m512i lo = _mm512_permutex2var_epi8(lut->lo0, codes, lut->lo1);
    hi = _mm512_ternarylogic_epi32(hi, codes, _mm512_set1_epi8((char)0x80), 0xF8);
    /* per 128-bit lane L: unpacklo gives words 8L..8L+7 from bytes 16L..16L+7, unpackhi from bytes
     * 16L+8..16L+15; the KTFP8_CODES_VBMI64 storage order makes these natural codes 8L+j and 32+8L+j. */
    *lo32 = _mm512_unpacklo_epi8(lo, hi);
    *hi32 = _mm512_unpackhi_epi8(lo, hi);
}

static inline void ktfp8_e4m3_tile_to_bf16(const uint8_t *codes, int64_t k, uint16_t *dst,
                                           const ktfp8_prefetch_two *ahead, int64_t offset) {
    ktfp8_e4m3_bf16_lut lut;
    ktfp8_e4m3_bf16_lut_load(&lut);
    /* each 64-byte group holds 4 K (2 pairs x 16 rows x 2) and yields two dst rows; the codes come
     * from DRAM, so they are prefetched ahead */
    for (int64_t g = 0; g < k / 4;) { /* in up to three runs, one per pair of prefetch bases */
        int64_t until;
        uintptr_t far_base, near_base;
        ktfp8_prefetch_two_run(ahead, offset + 64 * g, &far_base, &near_base, &until);
        const int64_t stop = ktfp8_prefetch_bound(until - offset, 64, 1, k / 4);
        for (; g < stop; g++) {
            __m512i a, b;
            ktfp8_prefetch_two_line(far_base, near_base, offset + 64 * g);
            ktfp8_e4m3x64_to_bf16(&lut, codes + 64 * g, &a, &b);
            _mm512_storeu_si512((void *)(dst + 64 * g), a);
            _mm512_storeu_si512((void *)(dst + 64 * g + 32), b);
        }
    }
}

#endif
