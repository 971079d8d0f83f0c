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
#else
#include <immintrin.h>
#endif

#endif
