# CPU features and ISA levels (cpu_features.h, dispatch.h), detected once per process in C.

cdef extern from "ktfp8/cpu_features.h":
    ctypedef unsigned ktfp8_features
    ctypedef struct ktfp8_cpu:
        ktfp8_features features
        char vendor[13]
        char brand[49]
        unsigned family, model, stepping
    const ktfp8_cpu *ktfp8_cpu_get()
    const char *ktfp8_feature_name(int i)
    enum: KTFP8_FEATURE_COUNT

cdef extern from "ktfp8/dispatch.h":
    enum: KTFP8_ISA_none
    const char *ktfp8_isa_name(int isa)
    ktfp8_features ktfp8_isa_needs(int isa)
    int ktfp8_isa_usable(int isa)


CPU_IDENTITY = ("vendor", "brand", "family", "model", "stepping")  # cpu_features()'s keys that are not features


cdef list _feature_names(ktfp8_features bits):
    return [ktfp8_feature_name(i).decode("ascii") for i in range(KTFP8_FEATURE_COUNT) if bits >> i & 1]


def cpu_features():
    """CPUID + XGETBV facts as a dict: 'vendor', 'brand', 'family', 'model', 'stepping' (CPU_IDENTITY),
    then 0/1 per feature of cpu_features.h (CPUID bits first, then the os_* register states)."""
    cdef ktfp8_cpu c = ktfp8_cpu_get()[0]
    out = {"vendor": c.vendor.decode("ascii", "replace").strip("\x00 "),
           "brand": c.brand.decode("ascii", "replace").strip("\x00 "),
           "family": c.family, "model": c.model, "stepping": c.stepping}
    for i in range(KTFP8_FEATURE_COUNT):
        out[ktfp8_feature_name(i).decode("ascii")] = int(c.features >> i & 1)
    return out


def isa_levels():
    """{level: (features it needs, its own and those of the levels below, usable here)}, best
    first, as include/ktfp8/variants.def lists them."""
    return {ktfp8_isa_name(i).decode("ascii"): (_feature_names(ktfp8_isa_needs(i)), bool(ktfp8_isa_usable(i)))
            for i in range(KTFP8_ISA_none)}
