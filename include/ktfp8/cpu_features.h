/* What this CPU and OS can execute, read with CPUID and XGETBV (never /proc/cpuinfo: under an
 * emulator or a hypervisor the CPUID answer is the truth the instructions obey). */
#ifndef KTFP8_CPU_FEATURES_H
#define KTFP8_CPU_FEATURES_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, leaf, subleaf, register, bit): one CPUID feature bit.  The names are the keys of
 * ktfp8.cpu_features() and what include/ktfp8/variants.def lists as an ISA level's needs. */
#define KTFP8_CPUID_FEATURES(X)          \
    X(avx, 1, 0, ecx, 28)                \
    X(fma, 1, 0, ecx, 12)                \
    X(f16c, 1, 0, ecx, 29)               \
    X(avx2, 7, 0, ebx, 5)                \
    X(avx512f, 7, 0, ebx, 16)            \
    X(avx512dq, 7, 0, ebx, 17)           \
    X(avx512bw, 7, 0, ebx, 30)           \
    X(avx512vl, 7, 0, ebx, 31)           \
    X(avx512_bf16, 7, 1, eax, 5)         \
    X(avx512_vnni, 7, 0, ecx, 11)        \
    X(avx512_vbmi, 7, 0, ecx, 1)         \
    X(amx_tile, 7, 0, edx, 24)           \
    X(amx_bf16, 7, 0, edx, 22)

/* X(name, xcr0 mask): register state the OS saves on a context switch (XCR0, read with XGETBV);
 * an instruction set whose registers the OS does not save must not be used. */
#define KTFP8_OS_STATES(X)                                                                  \
    X(os_avx, 0x6)           /* SSE + AVX (XMM, YMM) */                                     \
    X(os_avx512, 0xe6)       /* + opmask, ZMM_Hi256, Hi16_ZMM */                            \
    X(os_amx, 0x60000)       /* XTILECFG (17) + XTILEDATA (18); Linux also wants a request */

enum ktfp8_feature {
#define KTFP8_FEATURE_ENUM(name, ...) KTFP8_FEATURE_##name,
    KTFP8_CPUID_FEATURES(KTFP8_FEATURE_ENUM) KTFP8_OS_STATES(KTFP8_FEATURE_ENUM)
#undef KTFP8_FEATURE_ENUM
    KTFP8_FEATURE_COUNT
};

/* A set of features: bit (1 << KTFP8_FEATURE_<name>). */
typedef uint32_t ktfp8_features;
#define KTFP8_NEED(name) ((ktfp8_features)1 << KTFP8_FEATURE_##name)

typedef struct ktfp8_cpu {
    ktfp8_features features;
    char vendor[13];
    char brand[49];
    /* CPUID leaf 1 as the vendors and /proc/cpuinfo print them (the extended fields folded in):
     * family 6 model 207 is Intel's Emerald Rapids, family 23 AMD's Zen to Zen 2, 25 Zen 3 and 4,
     * 26 Zen 5.  The brand string alone does not tell them apart under a hypervisor ("AMD EPYC"). */
    unsigned family, model, stepping;
    /* L2 cache per core in KiB, CPUID 0x80000006 ECX[31:16] (AMD and Intel both fill it); 0 where
     * the CPU does not say.  Sizes the MoE driver's phase-2 accumulator (moe_driver.c). */
    unsigned l2_kib;
} ktfp8_cpu;

/* This CPU, detected on the first call and cached for the process (CPUID is slow under a
 * hypervisor, which traps it; the answer never changes). */
const ktfp8_cpu *ktfp8_cpu_get(void);

/* The name of feature i (< KTFP8_FEATURE_COUNT), as in the tables above. */
const char *ktfp8_feature_name(int i);

/* Asks Linux for permission to use AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM) once per
 * process.  Returns 1 when tiles may be used, 0 otherwise (no AMX, not Linux, or refused). */
int ktfp8_amx_permission(void);

#ifdef __cplusplus
}
#endif
#endif
