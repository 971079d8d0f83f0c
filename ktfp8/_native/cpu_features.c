/* CPUID / XGETBV feature detection.  Built with baseline flags: it must run on every x86-64. */
#include "ktfp8/cpu_features.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}

/* XGETBV is only legal once CPUID says OSXSAVE; the raw opcode avoids needing -mxsave. */
static unsigned long long xgetbv0(void) {
    unsigned lo, hi;
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

void ktfp8_cpu_detect(ktfp8_cpu *cpu) {
    unsigned r[4];
    memset(cpu, 0, sizeof(*cpu));

    cpuid(0, 0, r);
    unsigned max_leaf = r[0];
    memcpy(cpu->vendor + 0, &r[1], 4);
    memcpy(cpu->vendor + 4, &r[3], 4);
    memcpy(cpu->vendor + 8, &r[2], 4);

    cpuid(0x80000000u, 0, r);
    if (r[0] >= 0x80000004u) {
        for (unsigned i = 0; i < 3; i++) {
            cpuid(0x80000002u + i, 0, r);
            memcpy(cpu->brand + 16 * i, r, 16);
        }
    }

    cpuid(1, 0, r);
    int osxsave = (r[2] >> 27) & 1;
    cpu->avx = (r[2] >> 28) & 1;
    cpu->fma = (r[2] >> 12) & 1;
    cpu->f16c = (r[2] >> 29) & 1;

    unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
    cpu->os_avx = (xcr0 & 0x6) == 0x6;              /* SSE + AVX state */
    cpu->os_avx512 = cpu->os_avx && (xcr0 & 0xe0) == 0xe0; /* opmask, ZMM_Hi256, Hi16_ZMM */
    cpu->os_amx = (xcr0 & 0x60000) == 0x60000;      /* XTILECFG (17) + XTILEDATA (18) */

    if (max_leaf >= 7) {
        cpuid(7, 0, r);
        unsigned max_sub = r[0];
        cpu->avx2 = (r[1] >> 5) & 1;
        cpu->avx512f = (r[1] >> 16) & 1;
        cpu->avx512dq = (r[1] >> 17) & 1;
        cpu->avx512bw = (r[1] >> 30) & 1;
        cpu->avx512vl = (r[1] >> 31) & 1;
        cpu->avx512vbmi = (r[2] >> 1) & 1;
        cpu->avx512vnni = (r[2] >> 11) & 1;
        cpu->amx_bf16 = (r[3] >> 22) & 1;
        cpu->amx_tile = (r[3] >> 24) & 1;
        if (max_sub >= 1) {
            cpuid(7, 1, r);
            cpu->avx512bf16 = (r[0] >> 5) & 1;
        }
    }
}
#else
void ktfp8_cpu_detect(ktfp8_cpu *cpu) { memset(cpu, 0, sizeof(*cpu)); }
#endif

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int ktfp8_amx_permission(void) {
    /* One request per process; the answer does not change.  A racing second caller repeats the
     * (idempotent) syscall, which is harmless. */
    static volatile int state = -1;
    if (state < 0) {
        ktfp8_cpu cpu;
        ktfp8_cpu_detect(&cpu);
        int ok = cpu.amx_tile && cpu.amx_bf16 && cpu.os_amx &&
                 syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        state = ok;
    }
    return state;
}
#else
int ktfp8_amx_permission(void) { return 0; }
#endif
