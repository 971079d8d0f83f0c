/* Naming of the symbols an ISA translation unit exports.
 *
 * The build compiles some sources twice (natively and, for the *_emulated test variants, against
 * software emulation), so each unit names its exported table with KTFP8_SYM(): the build passes
 * -DKTFP8_VARIANT=<suffix>, e.g. avx512bf16 or avx512bf16_emulated. */
#ifndef KTFP8_VARIANT_H
#define KTFP8_VARIANT_H

#define KTFP8_CAT_(a, b) a##_##b
#define KTFP8_CAT(a, b) KTFP8_CAT_(a, b)
#ifndef KTFP8_VARIANT
#error "compile ISA units with -DKTFP8_VARIANT=<name>"
#endif
#define KTFP8_SYM(name) KTFP8_CAT(name, KTFP8_VARIANT)

#endif
