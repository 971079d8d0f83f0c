# CPU features and the variant registry (cpu_features.h, dispatch.h).

cdef extern from "ktfp8/cpu_features.h":
    ctypedef struct ktfp8_cpu:
        int avx, avx2, fma, f16c
        int avx512f, avx512dq, avx512bw, avx512vl, avx512bf16, avx512vnni, avx512vbmi
        int amx_tile, amx_bf16
        int os_avx, os_avx512, os_amx
        char vendor[13]
        char brand[49]
    void ktfp8_cpu_detect(ktfp8_cpu *cpu)
    int ktfp8_amx_permission()

cdef extern from "ktfp8/abi.h":
    ctypedef struct ktfp8_codec_ops:
        pass
    ctypedef struct ktfp8_layout:
        int rows_per_tile
        int k_pack
        float scale_mul
        int shuffle64
    ctypedef struct ktfp8_moe_kernel:
        ktfp8_layout layout
        int act_dtype
    ctypedef struct ktfp8_variant:
        const char *name
        const ktfp8_codec_ops *codec
        const ktfp8_moe_kernel *moe

cdef extern from "ktfp8/dispatch.h":
    int ktfp8_variant_count()
    const ktfp8_variant *ktfp8_variant_at(int i)
    int ktfp8_variant_usable(const ktfp8_variant *v)
    int ktfp8_variant_is_emulated(const ktfp8_variant *v)


def cpu_features():
    """CPUID + XGETBV facts as a dict (ints 0/1 and two strings)."""
    cdef ktfp8_cpu c
    ktfp8_cpu_detect(&c)
    return {
        "vendor": c.vendor.decode("ascii", "replace").strip("\x00 "),
        "brand": c.brand.decode("ascii", "replace").strip("\x00 "),
        "avx": c.avx, "avx2": c.avx2, "fma": c.fma, "f16c": c.f16c,
        "avx512f": c.avx512f, "avx512dq": c.avx512dq, "avx512bw": c.avx512bw, "avx512vl": c.avx512vl,
        "avx512_bf16": c.avx512bf16, "avx512_vnni": c.avx512vnni, "avx512_vbmi": c.avx512vbmi,
        "amx_tile": c.amx_tile, "amx_bf16": c.amx_bf16,
        "os_avx": c.os_avx, "os_avx512": c.os_avx512, "os_amx": c.os_amx,
    }


def amx_permission():
    """Asks the OS (once per process) for AMX tile state; True when tiles may be used."""
    return bool(ktfp8_amx_permission())


def variants():
    """[(name, usable, emulated)] for every compiled variant, best first."""
    out = []
    cdef const ktfp8_variant *v
    for i in range(ktfp8_variant_count()):
        v = ktfp8_variant_at(i)
        out.append((v.name.decode("ascii"), bool(ktfp8_variant_usable(v)),
                    bool(ktfp8_variant_is_emulated(v))))
    return out


cdef const ktfp8_variant *variant_by_name(str name) except NULL:
    cdef const ktfp8_variant *v
    for i in range(ktfp8_variant_count()):
        v = ktfp8_variant_at(i)
        if v.name.decode("ascii") == name:
            if not ktfp8_variant_usable(v):
                raise ValueError(f"backend {name!r} is compiled but this CPU/OS cannot run it")
            return v
    raise ValueError(f"backend {name!r} is not compiled in this build")


cdef extern from "ktfp8/fpenv.h":
    unsigned _mm_getcsr()
    void _mm_setcsr(unsigned)


def mxcsr():
    """This thread's MXCSR (SSE control/status: bit 6 DAZ, bit 15 FTZ)."""
    return _mm_getcsr()


def set_mxcsr(unsigned value):
    """Sets this thread's MXCSR (tests, and undoing what a -ffast-math library set at load)."""
    _mm_setcsr(value)
