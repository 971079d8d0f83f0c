/* The test-only *_emulated variants: each level's kernels compiled a second time against SIMDe and
 * the AMX tile emulation (the `twin` column of include/ktfp8/variants.def), so that the AVX-512 and
 * AMX sources run, and are checked, on CPUs without those instructions.  They live in the test
 * module (ktfp8._native._testing), which `import ktfp8` never loads. */
#include "ktfp8/dispatch.h"

#define KTFP8_ISA(unit, variant, extends, needs, flags, options, codec, twin) \
    extern const ktfp8_codec_ops ktfp8_codec_##codec##_emulated KTFP8_OPTIONAL; \
    extern const ktfp8_moe_kernel ktfp8_moe_##unit##_emulated KTFP8_OPTIONAL;
#include "ktfp8/variants.def"
#undef KTFP8_ISA

/* A row whose level has no twin (or a build without SIMDe) holds NULL tables and is skipped. */
static const ktfp8_variant_entry twins[] = {
#define KTFP8_ISA(unit, variant, extends, needs, flags, options, codec, twin) \
    {{#variant "_emulated", &ktfp8_codec_##codec##_emulated, &ktfp8_moe_##unit##_emulated}, KTFP8_ISA_##twin, 1},
#include "ktfp8/variants.def"
#undef KTFP8_ISA
};

const ktfp8_variant_entry *ktfp8_emulated_variants(int *count) {
    *count = (int)(sizeof(twins) / sizeof(twins[0]));
    return twins;
}
