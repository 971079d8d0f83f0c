/* AVX-512 probe: the FP32 FMA peak on zmm (the avx512 backend's unit; twice the ymm peak where a
 * core has two 512-bit FMA ports). */
#include "ktfp8/probe.h"
#include "ktfp8/variant.h"
#define KTFP8_PROBE_FMA_BYTES 64 /* zmm */
#include "ktfp8/probe_fma.h"

double KTFP8_SYM(ktfp8_probe_fma512)(int64_t iters, int threads) { return ktfp8_probe_fma_loop(iters, threads); }
