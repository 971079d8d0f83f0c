/* The FP32 FMA peak loop of the probes, one body for every vector width: an ISA unit defines
 * KTFP8_PROBE_FMA_BYTES (32: AVX2 ymm, 64: AVX-512 zmm) and includes this header, and its -m flags
 * (FMA, and AVX-512F for zmm) make GCC contract each `acc * m + a` into one vfmadd. */
#ifndef KTFP8_PROBE_FMA_H
#define KTFP8_PROBE_FMA_H

#include <stdint.h>

#define KTFP8_PROBE_FMA_CHAINS 12 /* independent chains: more than latency (4-5) x FMA ports (2) needs */

typedef float ktfp8_probe_fma_vec __attribute__((vector_size(KTFP8_PROBE_FMA_BYTES)));

/* Runs iters rounds of KTFP8_PROBE_FMA_CHAINS FMAs per thread; returns the flops done (0: NaN). */
static double ktfp8_probe_fma_loop(int64_t iters, int threads) {
    const int lanes = KTFP8_PROBE_FMA_BYTES / 4;
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        ktfp8_probe_fma_vec acc[KTFP8_PROBE_FMA_CHAINS];
        ktfp8_probe_fma_vec m, a;
        for (int l = 0; l < lanes; l++) m[l] = 0.999999f, a[l] = 1e-7f;
        for (int i = 0; i < KTFP8_PROBE_FMA_CHAINS; i++)
            for (int l = 0; l < lanes; l++) acc[i][l] = (float)i;
        for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
            for (int i = 0; i < KTFP8_PROBE_FMA_CHAINS; i++) acc[i] = acc[i] * m + a;
        for (int i = 1; i < KTFP8_PROBE_FMA_CHAINS; i++) acc[0] += acc[i];
        sink += acc[0][0];
    }
    return sink != sink ? 0.0 : (double)iters * KTFP8_PROBE_FMA_CHAINS * lanes * 2 * threads;
}

#endif
