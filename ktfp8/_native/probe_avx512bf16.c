/* vdpbf16ps peak: each instruction does 16 lanes x 2 products x 2 flops = 64 flops. */
#include "ktfp8/probe.h"
#include "ktfp8/simd.h"
#include "ktfp8/variant.h"

double KTFP8_SYM(ktfp8_probe_dpbf16)(int64_t iters, int threads) {
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m512 acc[12];
        const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
        for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i);
        for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        for (int i = 1; i < 12; i++) acc[0] = _mm512_add_ps(acc[0], acc[i]);
        sink += _mm512_reduce_add_ps(acc[0]);
    }
    return sink != sink ? 0.0 : (double)iters * 12 * 64 * threads;
}
