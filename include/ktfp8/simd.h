/* Intrinsics for the ISA units.
 *
 * Native builds get <immintrin.h>.  The test-only *_emulated builds (-DKTFP8_EMULATE_SIMD) get
 * SIMDe's portable implementations under the same names, so the *same* AVX-512 source runs on a CPU
 * without AVX-512 and is checked against the reference in the test suite. */
#ifndef KTFP8_SIMD_H
#define KTFP8_SIMD_H

#ifdef KTFP8_EMULATE_SIMD
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

/* AVX-512F widenings SIMDe 0.7 lacks, built from two 256-bit halves with the same results (the
 * emulated build has AVX2 + F16C). */
#ifndef _mm512_cvtph_ps
static inline __m512 ktfp8_emu_mm512_cvtph_ps(__m256i h) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm256_castsi256_si128(h))),
                              _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), 1);
}
#define _mm512_cvtph_ps(h) ktfp8_emu_mm512_cvtph_ps(h)
#endif
#ifndef _mm512_cvtepu16_epi32
static inline __m512i ktfp8_emu_mm512_cvtepu16_epi32(__m256i a) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a))),
                              _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)), 1);
}
#define _mm512_cvtepu16_epi32(a) ktfp8_emu_mm512_cvtepu16_epi32(a)
#endif
#else
#include <immintrin.h>
#endif

/* For a kernel helper whose SIMDe form is a long instruction sequence (vpermi2b: some forty AVX2
 * instructions; vcvtph2ps: a loop over the lanes): inlined into every unrolled copy of the loops it
 * multiplies the emulated build's compile time, so the emulated build calls it; native builds inline
 * it. */
#ifdef KTFP8_EMULATE_SIMD
#define KTFP8_INLINE_UNLESS_EMULATED static __attribute__((noinline, unused))
#else
#define KTFP8_INLINE_UNLESS_EMULATED static inline __attribute__((always_inline))
#endif

#endif
