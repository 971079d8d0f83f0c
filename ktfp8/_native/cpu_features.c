/* CPUID / XGETBV feature detection, once per process.  Built with baseline flags: it must run on
 * every x86-64.  The bits it reads are the tables in cpu_features.h. */
#include "ktfp8/cpu_features.h"

#include <pthread.h>
#include <string.h>

static const char *const feature_names[KTFP8_FEATURE_COUNT] = {
#define KTFP8_FEATURE_NAME(name, ...) #name,
    KTFP8_CPUID_FEATURES(KTFP8_FEATURE_NAME) KTFP8_OS_STATES(KTFP8_FEATURE_NAME)
#undef KTFP8_FEATURE_NAME
};

const char *ktfp8_feature_name(int i) {
    return i >= 0 && i < KTFP8_FEATURE_COUNT ? feature_names[i] : NULL;
}

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

enum { eax, ebx, ecx, edx }; /* register columns of KTFP8_CPUID_FEATURES */

static void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}

/* XGETBV is only legal once CPUID says OSXSAVE; the raw opcode avoids needing -mxsave. */
static unsigned long long xgetbv0(void) {
    unsigned lo, hi;
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

/* 1 when CPUID answers (leaf, sub): leaf within CPUID.0.EAX, sub within the leaf's subleaf count
 * (EAX of subleaf 0, as leaf 7 reports it). */
static int has_leaf(unsigned leaf, unsigned sub, unsigned max_leaf) {
    unsigned r[4];
    if (leaf > max_leaf) return 0;
    if (sub == 0) return 1;
    cpuid(leaf, 0, r);
    return sub <= r[0];
}

static void detect(ktfp8_cpu *cpu) {
    unsigned r[4];
    memset(cpu, 0, sizeof(*cpu));

    cpuid(0, 0, r);
    const unsigned max_leaf = r[0];
    memcpy(cpu->vendor + 0, &r[1], 4);
    memcpy(cpu->vendor + 4, &r[3], 4);
    memcpy(cpu->vendor + 8, &r[2], 4);

    cpuid(0x80000000u, 0, r);
    const unsigned max_extended = r[0];
    if (max_extended >= 0x80000004u) {
        for (unsigned i = 0; i < 3; i++) {
            cpuid(0x80000002u + i, 0, r);
            memcpy(cpu->brand + 16 * i, r, 16);
        }
    }
    if (max_extended >= 0x80000006u) {
        cpuid(0x80000006u, 0, r);
        cpu->l2_kib = r[ecx] >> 16;
    }

#define KTFP8_READ_CPUID(name, leaf, sub, reg, bit)                         \
    if (has_leaf(leaf, sub, max_leaf)) {                                    \
        cpuid(leaf, sub, r);                                                \
        if ((r[reg] >> (bit)) & 1) cpu->features |= KTFP8_NEED(name);       \
    }
    KTFP8_CPUID_FEATURES(KTFP8_READ_CPUID)
#undef KTFP8_READ_CPUID

    cpuid(1, 0, r);
    const unsigned base_family = (r[0] >> 8) & 0xF, base_model = (r[0] >> 4) & 0xF;
    cpu->stepping = r[0] & 0xF;
    cpu->family = base_family == 0xF ? base_family + ((r[0] >> 20) & 0xFF) : base_family;
    cpu->model = base_family == 0x6 || base_family == 0xF ? (((r[0] >> 16) & 0xF) << 4) + base_model : base_model;
    const unsigned long long xcr0 = (r[2] >> 27) & 1 ? xgetbv0() : 0; /* OSXSAVE */
#define KTFP8_READ_XCR0(name, mask) \
    if ((xcr0 & (mask)) == (mask)) cpu->features |= KTFP8_NEED(name);
    KTFP8_OS_STATES(KTFP8_READ_XCR0)
#undef KTFP8_READ_XCR0
}
#else
static void detect(ktfp8_cpu *cpu) { memset(cpu, 0, sizeof(*cpu)); }
#endif

static ktfp8_cpu cached;
static pthread_once_t cached_once = PTHREAD_ONCE_INIT;
static void detect_cached(void) { detect(&cached); }

const ktfp8_cpu *ktfp8_cpu_get(void) {
    pthread_once(&cached_once, detect_cached);
    return &cached;
}

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
        const ktfp8_features amx = KTFP8_NEED(amx_tile) | KTFP8_NEED(amx_bf16) | KTFP8_NEED(os_amx);
        state = (ktfp8_cpu_get()->features & amx) == amx &&
                syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return state;
}
#else
int ktfp8_amx_permission(void) { return 0; }
#endif
