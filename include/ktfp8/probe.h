/* Roofline probes: what this machine's memory bus and vector units can do, measured in the same
 * process as the kernels so benchmarks can report fractions of it.  The caller times each call. */
#ifndef KTFP8_PROBE_H
#define KTFP8_PROBE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KTFP8_PROBE_MAX_STREAMS 64
/* Reads bytes (a multiple of 128) of buf once, spread over threads, each thread's share as `streams`
 * (1 .. KTFP8_PROBE_MAX_STREAMS) runs read side by side (a 128-byte step of each in turn); returns the
 * sum of its 64-bit words (modulo 2^64), so that a test can see every step read once. */
uint64_t ktfp8_probe_read(const void *buf, size_t bytes, int threads, int streams);
/* Runs iters rounds of independent FP32 FMAs (AVX2, ymm) per thread; returns the flops done (0: no AVX2). */
double ktfp8_probe_fma(int64_t iters, int threads);
/* Same on zmm (AVX-512F); returns the flops done (0: no AVX-512). */
double ktfp8_probe_fma512(int64_t iters, int threads);
/* Same with vdpbf16ps (AVX-512-BF16); returns the flops done (0: not available). */
double ktfp8_probe_dpbf16(int64_t iters, int threads);
/* Same with AMX tdpbf16ps on 4 C tiles per thread; returns the flops done (0: AMX not usable here). */
double ktfp8_probe_tdpbf16(int64_t iters, int threads);

#ifdef __cplusplus
}
#endif
#endif
