/* The variant registry: which variants this build compiled, and which of them this CPU runs. */
#ifndef KTFP8_DISPATCH_H
#define KTFP8_DISPATCH_H

#include "ktfp8/abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Compiled variants, best first; the *_emulated test variants come last. */
int ktfp8_variant_count(void);
const ktfp8_variant *ktfp8_variant_at(int i);
/* 1 when this CPU and OS can run the variant (asks for AMX permission where needed). */
int ktfp8_variant_usable(const ktfp8_variant *v);
/* 1 for test-only variants that automatic selection never picks. */
int ktfp8_variant_is_emulated(const ktfp8_variant *v);

#ifdef __cplusplus
}
#endif
#endif
