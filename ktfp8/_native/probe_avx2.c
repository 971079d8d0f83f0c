/* AVX2 probes: streaming read bandwidth and the FP32 FMA peak on ymm. */
#include "ktfp8/probe.h"
#include "ktfp8/probe_share.h"
#include "ktfp8/simd.h"
#include "ktfp8/variant.h"
#define KTFP8_PROBE_FMA_BYTES 32 /* ymm */
#include "ktfp8/probe_fma.h"

/* Four independent 32-byte loads per 128-byte step: enough in flight to saturate the bus from one
 * stream.  More streams (a thread's share read as runs side by side) read more here all the same:
 * see roofline.READ_STREAMS. */
uint64_t KTFP8_SYM(ktfp8_probe_read)(const void *buf, size_t bytes, int threads, int streams) {
    const uint8_t *b = (const uint8_t *)buf;
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        ktfp8_probe_share share;
        ktfp8_probe_share_of(&share, bytes, streams);
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
#define STEP(i)                                                                     \
    do {                                                                            \
        const uint8_t *p = b + (i) * 128;                                           \
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)p));           \
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(p + 32)));    \
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(p + 64)));    \
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(p + 96)));    \
    } while (0)
        for (size_t i = 0; i < share.run; i++)
            for (int s = 0; s < streams; s++) STEP(ktfp8_probe_stream_step(&share, s, i));
        for (size_t i = share.first + streams * share.run; i < share.last; i++) STEP(i);
#undef STEP
        __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
        total += (uint64_t)_mm256_extract_epi64(s, 0) + (uint64_t)_mm256_extract_epi64(s, 1) +
                 (uint64_t)_mm256_extract_epi64(s, 2) + (uint64_t)_mm256_extract_epi64(s, 3);
    }
    return total;
}

double KTFP8_SYM(ktfp8_probe_fma)(int64_t iters, int threads) { return ktfp8_probe_fma_loop(iters, threads); }
