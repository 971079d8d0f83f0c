/* Variant registry.  Built with baseline flags: it only reads tables and CPUID, so it runs on any
 * x86-64, and it never hands out a variant whose instructions this CPU or OS lacks.
 *
 * The build defines KTFP8_HAVE_CODEC_<isa> / KTFP8_HAVE_MOE_<isa> for every ISA unit it compiled. */
#include "ktfp8/dispatch.h"
#include "ktfp8/cpu_features.h"

#include <string.h>

extern const ktfp8_codec_ops ktfp8_codec_reference;
extern const ktfp8_moe_kernel ktfp8_moe_reference;

enum need { NEED_NONE, NEED_AVX2, NEED_AVX512, NEED_AVX512_BF16, NEED_AMX };

typedef struct entry {
    ktfp8_variant v;
    enum need need;
    int emulated;
} entry;

#define DECLARE(codec, moe)                      \
    extern const ktfp8_codec_ops ktfp8_codec_##codec; \
    extern const ktfp8_moe_kernel ktfp8_moe_##moe;

#if defined(KTFP8_HAVE_CODEC_AVX512) && defined(KTFP8_HAVE_MOE_AMX)
DECLARE(avx512, amx)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX512) && defined(KTFP8_HAVE_MOE_AVX512BF16)
DECLARE(avx512, avx512bf16)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX512) && defined(KTFP8_HAVE_MOE_AVX512)
DECLARE(avx512, avx512)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX2) && defined(KTFP8_HAVE_MOE_AVX2)
DECLARE(avx2, avx2)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX512_EMULATED) && defined(KTFP8_HAVE_MOE_AMX_EMULATED)
DECLARE(avx512_emulated, amx_emulated)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX512_EMULATED) && defined(KTFP8_HAVE_MOE_AVX512BF16_EMULATED)
DECLARE(avx512_emulated, avx512bf16_emulated)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX512_EMULATED) && defined(KTFP8_HAVE_MOE_AVX512_EMULATED)
DECLARE(avx512_emulated, avx512_emulated)
#endif

#define ENTRY(name, codec, moe, need, emulated) \
    {{name, &ktfp8_codec_##codec, &ktfp8_moe_##moe}, need, emulated},

/* Best first: automatic selection takes the first usable non-emulated entry. */
static const entry entries[] = {
#if defined(KTFP8_HAVE_CODEC_AVX512) && defined(KTFP8_HAVE_MOE_AMX)
    ENTRY("amx", avx512, amx, NEED_AMX, 0)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX512) && defined(KTFP8_HAVE_MOE_AVX512BF16)
    ENTRY("avx512_bf16", avx512, avx512bf16, NEED_AVX512_BF16, 0)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX512) && defined(KTFP8_HAVE_MOE_AVX512)
    ENTRY("avx512", avx512, avx512, NEED_AVX512, 0)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX2) && defined(KTFP8_HAVE_MOE_AVX2)
    ENTRY("avx2", avx2, avx2, NEED_AVX2, 0)
#endif
    ENTRY("reference", reference, reference, NEED_NONE, 0)
/* The emulated variants are compiled with the AVX2 flags (SIMDe uses them underneath). */
#if defined(KTFP8_HAVE_CODEC_AVX512_EMULATED) && defined(KTFP8_HAVE_MOE_AMX_EMULATED)
    ENTRY("amx_emulated", avx512_emulated, amx_emulated, NEED_AVX2, 1)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX512_EMULATED) && defined(KTFP8_HAVE_MOE_AVX512BF16_EMULATED)
    ENTRY("avx512_bf16_emulated", avx512_emulated, avx512bf16_emulated, NEED_AVX2, 1)
#endif
#if defined(KTFP8_HAVE_CODEC_AVX512_EMULATED) && defined(KTFP8_HAVE_MOE_AVX512_EMULATED)
    ENTRY("avx512_emulated", avx512_emulated, avx512_emulated, NEED_AVX2, 1)
#endif
};

#define N_ENTRIES ((int)(sizeof(entries) / sizeof(entries[0])))

int ktfp8_variant_count(void) { return N_ENTRIES; }

const ktfp8_variant *ktfp8_variant_at(int i) {
    return (i >= 0 && i < N_ENTRIES) ? &entries[i].v : NULL;
}

static const entry *entry_of(const ktfp8_variant *v) {
    for (int i = 0; i < N_ENTRIES; i++)
        if (&entries[i].v == v) return &entries[i];
    return NULL;
}

static int meets(enum need need) {
    ktfp8_cpu c;
    ktfp8_cpu_detect(&c);
    int avx2 = c.avx && c.os_avx && c.avx2 && c.fma && c.f16c;
    /* the AVX-512 units are compiled with F/BW/VL/DQ (DQ: every CPU with BW+VL has it) */
    int avx512 = avx2 && c.os_avx512 && c.avx512f && c.avx512dq && c.avx512bw && c.avx512vl;
    int avx512_bf16 = avx512 && c.avx512bf16 && c.avx512vbmi;
    switch (need) {
    case NEED_NONE: return 1;
    case NEED_AVX2: return avx2;
    case NEED_AVX512: return avx512;
    case NEED_AVX512_BF16: return avx512_bf16;
    case NEED_AMX: return avx512_bf16 && ktfp8_amx_permission();
    }
    return 0;
}

int ktfp8_variant_usable(const ktfp8_variant *v) {
    const entry *e = entry_of(v);
    return e != NULL && meets(e->need);
}

int ktfp8_variant_is_emulated(const ktfp8_variant *v) {
    const entry *e = entry_of(v);
    return e != NULL && e->emulated;
}
