/* Variant registry.  Built with baseline flags: it only reads tables and the cached CPUID answer,
 * so it runs on any x86-64, and it never calls a unit whose instructions this CPU or OS lacks.
 * Everything here is derived from include/ktfp8/variants.def. */
#include "ktfp8/dispatch.h"

#include <pthread.h>

static const struct level {
    const char *name;
    int extends;
    ktfp8_features needs;
} levels[KTFP8_ISA_COUNT] = {
#define KTFP8_ISA(unit, variant, extends, needs, ...) {#unit, KTFP8_ISA_##extends, needs},
#include "ktfp8/variants.def"
#undef KTFP8_ISA
    {"none", KTFP8_ISA_none, 0},
};

const char *ktfp8_isa_name(int isa) { return isa >= 0 && isa < KTFP8_ISA_COUNT ? levels[isa].name : NULL; }

ktfp8_features ktfp8_isa_needs(int isa) {
    ktfp8_features needs = 0;
    for (; isa >= 0 && isa < KTFP8_ISA_none; isa = levels[isa].extends) needs |= levels[isa].needs;
    return needs;
}

static int usable[KTFP8_ISA_COUNT];
static pthread_once_t usable_once = PTHREAD_ONCE_INIT;

static void decide_usable(void) {
    const ktfp8_features have = ktfp8_cpu_get()->features;
    for (int isa = 0; isa < KTFP8_ISA_COUNT; isa++) {
        const ktfp8_features needs = ktfp8_isa_needs(isa);
        /* tile data also needs the kernel's per-process permission (arch_prctl) */
        usable[isa] = (have & needs) == needs && (!(needs & KTFP8_NEED(os_amx)) || ktfp8_amx_permission());
    }
}

int ktfp8_isa_usable(int isa) {
    pthread_once(&usable_once, decide_usable);
    return isa >= 0 && isa < KTFP8_ISA_COUNT && usable[isa];
}

extern const ktfp8_codec_ops ktfp8_codec_reference;
extern const ktfp8_moe_kernel ktfp8_moe_reference;
#define KTFP8_ISA(unit, variant, extends, needs, flags, options, codec, twin) \
    extern const ktfp8_codec_ops ktfp8_codec_##codec KTFP8_OPTIONAL;          \
    extern const ktfp8_moe_kernel ktfp8_moe_##unit KTFP8_OPTIONAL;
#include "ktfp8/variants.def"
#undef KTFP8_ISA

static const ktfp8_variant_entry natives[] = {
#define KTFP8_ISA(unit, variant, extends, needs, flags, options, codec, twin) \
    {{#variant, &ktfp8_codec_##codec, &ktfp8_moe_##unit}, KTFP8_ISA_##unit, 0},
#include "ktfp8/variants.def"
#undef KTFP8_ISA
    {{"reference", &ktfp8_codec_reference, &ktfp8_moe_reference}, KTFP8_ISA_none, 0},
};

const ktfp8_variant_entry *ktfp8_native_variants(int *count) {
    *count = (int)(sizeof(natives) / sizeof(natives[0]));
    return natives;
}
