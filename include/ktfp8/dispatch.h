/* The variant registry: which ISA levels and variants this build compiled (include/ktfp8/variants.def),
 * and which of them this CPU runs. */
#ifndef KTFP8_DISPATCH_H
#define KTFP8_DISPATCH_H

#include "ktfp8/abi.h"
#include "ktfp8/cpu_features.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A symbol an ISA unit defines, declared where it is looked up: it reads as NULL when the build
 * left that unit out (hidden, so the static linker resolves it, never the dynamic loader). */
#define KTFP8_OPTIONAL __attribute__((weak, visibility("hidden")))

/* ISA levels, best first, then KTFP8_ISA_none: baseline x86-64, what the reference variant needs. */
enum ktfp8_isa {
#define KTFP8_ISA(unit, ...) KTFP8_ISA_##unit,
#include "ktfp8/variants.def"
#undef KTFP8_ISA
    KTFP8_ISA_none,
    KTFP8_ISA_COUNT
};

/* The level's unit name ("none" for KTFP8_ISA_none). */
const char *ktfp8_isa_name(int isa);
/* Everything the level needs, its own needs and those of the levels below it. */
ktfp8_features ktfp8_isa_needs(int isa);
/* 1 when this CPU and OS run the level; decided once per process (asking Linux for AMX tile
 * permission where a level needs it). */
int ktfp8_isa_usable(int isa);

/* A variant as this module or the test-only one holds it.  codec and moe are NULL when the build
 * did not compile the variant's units. */
typedef struct ktfp8_variant_entry {
    ktfp8_variant v;
    int isa;      /* the level the CPU must run: enum ktfp8_isa */
    int emulated; /* 1: a test-only twin, never chosen automatically */
} ktfp8_variant_entry;

/* This module's variants, best first, the reference last; *count entries. */
const ktfp8_variant_entry *ktfp8_native_variants(int *count);

#ifdef __cplusplus
}
#endif
#endif
