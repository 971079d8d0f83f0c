/* AVX2 probes: streaming read bandwidth and FP32 FMA peak. */
#include "ktfp8/probe.h"
#include "ktfp8/simd.h"
#include "ktfp8/variant.h"

uint64_t KTFP8_SYM(ktfp8_probe_read)(const void *buf, size_t bytes, int threads) {
    const uint8_t *b = (const uint8_t *)buf;
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        /* four independent 32-byte loads per step: enough in flight to saturate the bus */
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static)
        for (size_t i = 0; i < bytes; i += 128) {
            a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(b + i)));
            a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(b + i + 32)));
            a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(b + i + 64)));
            a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(b + i + 96)));
        }
        __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
        total += (uint64_t)_mm256_extract_epi64(s, 0) + (uint64_t)_mm256_extract_epi64(s, 3);
    }
    return total;
}

double KTFP8_SYM(ktfp8_probe_fma)(int64_t iters, int threads) {
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        /* 12 independent chains: more than latency (4-5) x ports (2) needs */
        __m256 acc[12];
        const __m256 m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-7f);
        for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps((float)i);
        for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(acc[i], m, a);
        for (int i = 1; i < 12; i++) acc[0] = _mm256_add_ps(acc[0], acc[i]);
        float out[8];
        _mm256_storeu_ps(out, acc[0]);
        sink += out[0];
    }
    return sink != sink ? 0.0 : (double)iters * 12 * 16 * threads; /* 8 lanes x 2 flops per FMA */
}
