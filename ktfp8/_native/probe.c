/* Probe dispatcher (baseline flags): uses an ISA unit only when the CPU and OS run it. */
#include "ktfp8/probe.h"
#include "ktfp8/cpu_features.h"

#include <string.h>

#ifdef KTFP8_HAVE_PROBE_AVX2
uint64_t ktfp8_probe_read_avx2(const void *buf, size_t bytes, int threads);
double ktfp8_probe_fma_avx2(int64_t iters, int threads);
#endif
#ifdef KTFP8_HAVE_PROBE_AVX512
double ktfp8_probe_fma512_avx512(int64_t iters, int threads);
#endif
#ifdef KTFP8_HAVE_PROBE_AVX512BF16
double ktfp8_probe_dpbf16_avx512bf16(int64_t iters, int threads);
#endif
#ifdef KTFP8_HAVE_PROBE_AMX
double ktfp8_probe_tdpbf16_amx(int64_t iters, int threads);
#endif

static int has_avx2(void) {
    ktfp8_cpu c;
    ktfp8_cpu_detect(&c);
    return c.avx && c.os_avx && c.avx2 && c.fma && c.f16c;
}

/* the AVX-512 units are compiled with F/BW/VL/DQ */
static int has_avx512(void) {
    ktfp8_cpu c;
    ktfp8_cpu_detect(&c);
    return has_avx2() && c.os_avx512 && c.avx512f && c.avx512dq && c.avx512bw && c.avx512vl;
}

static int has_avx512_bf16(void) {
    ktfp8_cpu c;
    ktfp8_cpu_detect(&c);
    return has_avx512() && c.avx512bf16 && c.avx512vbmi; /* the unit is compiled with -mavx512vbmi too */
}

uint64_t ktfp8_probe_read(const void *buf, size_t bytes, int threads) {
#ifdef KTFP8_HAVE_PROBE_AVX2
    if (has_avx2()) return ktfp8_probe_read_avx2(buf, bytes, threads);
#endif
    uint64_t sum = 0;
    const uint64_t *p = (const uint64_t *)buf;
#pragma omp parallel for reduction(+ : sum) num_threads(threads) schedule(static)
    for (size_t i = 0; i < bytes / 8; i++) sum += p[i];
    return sum;
}

double ktfp8_probe_fma(int64_t iters, int threads) {
#ifdef KTFP8_HAVE_PROBE_AVX2
    if (has_avx2()) return ktfp8_probe_fma_avx2(iters, threads);
#endif
    (void)iters, (void)threads;
    return 0.0;
}

double ktfp8_probe_fma512(int64_t iters, int threads) {
#ifdef KTFP8_HAVE_PROBE_AVX512
    if (has_avx512()) return ktfp8_probe_fma512_avx512(iters, threads);
#endif
    (void)iters, (void)threads;
    return 0.0;
}

double ktfp8_probe_dpbf16(int64_t iters, int threads) {
#ifdef KTFP8_HAVE_PROBE_AVX512BF16
    if (has_avx512_bf16()) return ktfp8_probe_dpbf16_avx512bf16(iters, threads);
#endif
    (void)iters, (void)threads;
    return 0.0;
}

double ktfp8_probe_tdpbf16(int64_t iters, int threads) {
#ifdef KTFP8_HAVE_PROBE_AMX
    /* the AMX unit is compiled with the AVX-512 flags as well, and tiles need the OS's permission */
    if (has_avx512_bf16() && ktfp8_amx_permission()) return ktfp8_probe_tdpbf16_amx(iters, threads);
#endif
    (void)iters, (void)threads;
    return 0.0;
}
