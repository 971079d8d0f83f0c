/* IEEE subnormals for the duration of a kernel, whatever the caller's MXCSR says.
 *
 * E4M3's subnormal codes encode from and decode to float subnormals (and FP8 weights times small
 * scales routinely land there).  A library built with -ffast-math sets FTZ and DAZ in MXCSR when it
 * is loaded (gcc's crtfastmath.o; kt-kernel's extension does, for one), which would silently turn
 * them into zeros.  MXCSR is per thread, so every parallel region that computes clears both bits on
 * each of its threads and restores the caller's mode on the way out. */
#ifndef KTFP8_FPENV_H
#define KTFP8_FPENV_H

#include <xmmintrin.h> /* SSE: every x86-64 CPU */

#define KTFP8_MXCSR_DAZ 0x0040u /* denormal inputs read as zero */
#define KTFP8_MXCSR_FTZ 0x8000u /* denormal results flushed to zero */

static inline unsigned ktfp8_fpenv_ieee(void) {
    const unsigned caller = _mm_getcsr();
    _mm_setcsr(caller & ~(KTFP8_MXCSR_DAZ | KTFP8_MXCSR_FTZ));
    return caller;
}

static inline void ktfp8_fpenv_restore(unsigned caller) { _mm_setcsr(caller); }

#endif
