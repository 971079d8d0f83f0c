/* Probe dispatcher (baseline flags): runs a probe_<unit>.c only when the build compiled it and
 * this CPU and OS run its level (include/ktfp8/variants.def). */
#include "ktfp8/dispatch.h"
#include "ktfp8/probe.h"
#include "ktfp8/probe_share.h"
#include "ktfp8/team.h"

uint64_t ktfp8_probe_read_avx2(const void *buf, size_t bytes, int threads, int streams) KTFP8_OPTIONAL;
double ktfp8_probe_fma_avx2(int64_t iters, int threads) KTFP8_OPTIONAL;
double ktfp8_probe_fma512_avx512(int64_t iters, int threads) KTFP8_OPTIONAL;
double ktfp8_probe_dpbf16_avx512bf16(int64_t iters, int threads) KTFP8_OPTIONAL;
double ktfp8_probe_tdpbf16_amx(int64_t iters, int threads) KTFP8_OPTIONAL;

uint64_t ktfp8_probe_read(const void *buf, size_t bytes, int threads, int streams) {
    threads = ktfp8_team_size(threads);
    if (ktfp8_probe_read_avx2 && ktfp8_isa_usable(KTFP8_ISA_avx2))
        return ktfp8_probe_read_avx2(buf, bytes, threads, streams);
    uint64_t sum = 0;
    const uint64_t *p = (const uint64_t *)buf;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    {
        ktfp8_probe_share share;
        ktfp8_probe_share_of(&share, bytes, streams);
        for (size_t i = 0; i < share.run; i++)
            for (int s = 0; s < streams; s++)
                for (int w = 0; w < 16; w++) sum += p[ktfp8_probe_stream_step(&share, s, i) * 16 + w];
        for (size_t i = share.first + streams * share.run; i < share.last; i++)
            for (int w = 0; w < 16; w++) sum += p[i * 16 + w];
    }
    return sum;
}

double ktfp8_probe_fma(int64_t iters, int threads) {
    threads = ktfp8_team_size(threads);
    if (ktfp8_probe_fma_avx2 && ktfp8_isa_usable(KTFP8_ISA_avx2)) return ktfp8_probe_fma_avx2(iters, threads);
    return 0.0;
}

double ktfp8_probe_fma512(int64_t iters, int threads) {
    threads = ktfp8_team_size(threads);
    if (ktfp8_probe_fma512_avx512 && ktfp8_isa_usable(KTFP8_ISA_avx512))
        return ktfp8_probe_fma512_avx512(iters, threads);
    return 0.0;
}

double ktfp8_probe_dpbf16(int64_t iters, int threads) {
    threads = ktfp8_team_size(threads);
    /* the unit is compiled with the whole avx512bf16 level's flags, -mavx512vbmi included */
    if (ktfp8_probe_dpbf16_avx512bf16 && ktfp8_isa_usable(KTFP8_ISA_avx512bf16))
        return ktfp8_probe_dpbf16_avx512bf16(iters, threads);
    return 0.0;
}

double ktfp8_probe_tdpbf16(int64_t iters, int threads) {
    threads = ktfp8_team_size(threads);
    /* the amx level includes the OS's permission to use tiles */
    if (ktfp8_probe_tdpbf16_amx && ktfp8_isa_usable(KTFP8_ISA_amx))
        return ktfp8_probe_tdpbf16_amx(iters, threads);
    return 0.0;
}
