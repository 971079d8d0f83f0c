/* Dispatch on a token count to a call with that count as a compile-time constant, so micro-kernel
 * accumulator arrays sized by it live in registers.  CALL(M) is a macro taking the constant,
 * defined just before the dispatch and #undef'd after it.
 *
 * Every MoE kernel names its token-count thresholds the same way (the kernel test harness reads
 * them from the sources, tests/kernel_tester.py):
 *   DECODE_M   m <= DECODE_M: weights converted in registers as they stream (KTFP8_FOR_M4/M6)
 *   DECODE_WIDE_M  m <= DECODE_WIDE_M: more accumulators per token in that loop (avx512_bf16)
 *   MR         prefill register block: tokens per pass over the converted tile (KTFP8_FOR_M6/M8);
 *              avx512_bf16 converts in every pass of MR tokens, so its DECODE_M bounds only the
 *              passes that give a token more than one accumulator
 *   KEEP_M     tokens of the prefill pass that converts the codes, where it differs from MR (moe_avx2.c)
 *   AMX_MIN_M  m >= AMX_MIN_M: the AMX tile path (moe_amx.c only)
 *   PREFETCH_BYTES  software prefetch distance of the weight stream
 * `python -m ktfp8.bench.tokens_per_expert` times every backend against m on the machine at hand. */
#ifndef KTFP8_TOKEN_COUNT_H
#define KTFP8_TOKEN_COUNT_H

#define KTFP8_FOR_M4(m, CALL)    \
    switch (m) {                 \
    case 1: CALL(1); break;      \
    case 2: CALL(2); break;      \
    case 3: CALL(3); break;      \
    default: CALL(4); break;     \
    }

#define KTFP8_FOR_M6(m, CALL)    \
    switch (m) {                 \
    case 1: CALL(1); break;      \
    case 2: CALL(2); break;      \
    case 3: CALL(3); break;      \
    case 4: CALL(4); break;      \
    case 5: CALL(5); break;      \
    default: CALL(6); break;     \
    }

/* The first prefill pass of moe_avx512.c (DECODE_M 4, MR 8): more than DECODE_M tokens, at most MR.
 * Only the counts it can see, so that the emulated build compiles no unused loops. */
#define KTFP8_FOR_M5_TO_8(m, CALL) \
    switch (m) {                   \
    case 5: CALL(5); break;        \
    case 6: CALL(6); break;        \
    case 7: CALL(7); break;        \
    default: CALL(8); break;       \
    }

#define KTFP8_FOR_M8(m, CALL)    \
    switch (m) {                 \
    case 1: CALL(1); break;      \
    case 2: CALL(2); break;      \
    case 3: CALL(3); break;      \
    case 4: CALL(4); break;      \
    case 5: CALL(5); break;      \
    case 6: CALL(6); break;      \
    case 7: CALL(7); break;      \
    default: CALL(8); break;     \
    }

#endif
