/* Portable C of the BF16 dot-product arithmetic that AVX512_BF16 and AMX-BF16 define in the Intel
 * SDM (Vol. 2, VDPBF16PS and TDPBF16PS): each accumulation one FMA rounding, round-to-nearest-even,
 * denormal inputs (BF16 operands and the FP32 accumulator) read as zero, denormal results flushed
 * to zero, MXCSR neither read nor written.  Test-only: the *_emulated kernels compile against it
 * (amx_emulation.h for TDPBF16PS; moe_avx512bf16.c for VDPBF16PS), so that they give the bits of
 * the instructions they stand for.
 *
 * Not emulated: NaN payload priorities (a NaN result is some quiet NaN). */
#ifndef KTFP8_BF16_DOT_EMULATION_H
#define KTFP8_BF16_DOT_EMULATION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* make_fp32 with DAZ: a BF16 denormal (exponent bits 0) reads as a zero of its sign. */
static inline float ktfp8_emu_bf16(uint16_t h) {
    uint32_t bits = (h & 0x7F80u) ? (uint32_t)h << 16 : (uint32_t)(h & 0x8000u) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* DAZ for an FP32 operand (the accumulator). */
static inline float ktfp8_emu_daz(float f) { return fpclassify(f) == FP_SUBNORMAL ? copysignf(0.0f, f) : f; }

/* round(a * b + c) with one rounding, RNE, and FTZ as x86 defines it: the result is flushed to a
 * signed zero when, rounded to 24 bits with an unbounded exponent, it is below 2^-126 (tininess
 * after rounding).  fmaf rounds tiny results to denormal precision instead, which can round up to
 * exactly 2^-126 where x86 flushes; so any result of magnitude <= 2^-126 is recomputed scaled by
 * 2^64, where it is normal.  Inputs are normal or zero (DAZ): a tiny non-zero a*b + c then needs
 * |a*b|, |c| < 2^-99 and |a| < 2^27, so the scaling cannot overflow. */
static inline float ktfp8_emu_fma_ftz(float a, float b, float c) {
    float r = fmaf(a, b, c);
    if (!(fabsf(r) <= 0x1p-126f) || r == 0.0f) return r; /* normal, Inf, NaN or an exact zero */
    float big = fmaf(a * 0x1p64f, b, c * 0x1p64f);
    return fabsf(big) < 0x1p-62f ? copysignf(0.0f, big) : big * 0x1p-64f;
}

/* VDPBF16PS zmm (no mask) as the SDM's Operation section gives it: per FP32 lane i, the odd BF16
 * product (elements 2i + 1) is accumulated first, then the even one, each an FMA into the lane.
 * The order shows in the bits (1 + 2^24 - 2^24 is 0 one way round and 1 the other), and the
 * Zen 4 VM's vdpbf16ps gives the odd-first bits, with the accumulator and the result between the
 * two steps flushed as above (docs/tuning-notes.md). */
static inline void ktfp8_emu_vdpbf16ps(float acc[16], const uint16_t src1[32], const uint16_t src2[32]) {
    for (int i = 0; i < 16; i++) {
        float lane = ktfp8_emu_daz(acc[i]);
        lane = ktfp8_emu_fma_ftz(ktfp8_emu_bf16(src1[2 * i + 1]), ktfp8_emu_bf16(src2[2 * i + 1]), lane);
        acc[i] = ktfp8_emu_fma_ftz(ktfp8_emu_bf16(src1[2 * i]), ktfp8_emu_bf16(src2[2 * i]), lane);
    }
}

#endif
