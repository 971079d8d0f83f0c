/* What this CPU and OS can execute, read with CPUID and XGETBV (never /proc/cpuinfo: under an
 * emulator or a hypervisor the CPUID answer is the truth the instructions obey). */
#ifndef KTFP8_CPU_FEATURES_H
#define KTFP8_CPU_FEATURES_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ktfp8_cpu {
    /* CPUID feature bits */
    int avx, avx2, fma, f16c;
    int avx512f, avx512dq, avx512bw, avx512vl, avx512bf16, avx512vnni, avx512vbmi;
    int amx_tile, amx_bf16;
    /* OS support: XCR0 says the kernel saves the register state */
    int os_avx;     /* XMM + YMM */
    int os_avx512;  /* + opmask, ZMM_Hi256, Hi16_ZMM */
    int os_amx;     /* XTILECFG + XTILEDATA enabled in XCR0 */
    char vendor[13];
    char brand[49];
} ktfp8_cpu;

/* Fills *cpu; cheap, may be called any time. */
void ktfp8_cpu_detect(ktfp8_cpu *cpu);

/* Asks Linux for permission to use AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM) once per
 * process.  Returns 1 when tiles may be used, 0 otherwise (no AMX, not Linux, or refused). */
int ktfp8_amx_permission(void);

#ifdef __cplusplus
}
#endif
#endif
