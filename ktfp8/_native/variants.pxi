# The compiled variants as Python objects (dispatch.h): resolved once, then handed to the codec and
# MoE seams, which call through their function tables without any lookup.

from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New

cdef extern from "ktfp8/dispatch.h":
    ctypedef struct ktfp8_variant_entry:
        ktfp8_variant v
        int isa
        int emulated
    const ktfp8_variant_entry *ktfp8_native_variants(int *count)


cdef class Variant:
    """One compiled variant (a codec and a MoE kernel for one ISA level).  Instances come from
    variants() / test_variants(); ktfp8.backends keeps them for the life of the process."""
    cdef const ktfp8_variant *v
    cdef readonly str name
    cdef readonly str isa         # the level the CPU must run
    cdef readonly bint usable     # this CPU and OS run it
    cdef readonly bint emulated   # a test-only twin, never chosen automatically
    cdef object owner             # keeps the module holding the tables alive (test variants)

    @property
    def act_dtype(self):
        """The activation dtype (KTFP8_F32 or KTFP8_BF16) this variant's micro-kernel reads."""
        return self.v.moe.act_dtype

    def _tables(self):
        """The variant's tables as a capsule ("ktfp8_variant"), for the test module's kernel hook."""
        return PyCapsule_New(<void *>self.v, "ktfp8_variant", NULL)

    def __repr__(self):
        return f"<ktfp8 variant {self.name!r}{'' if self.usable else ' (not usable here)'}>"


cdef const ktfp8_variant *runnable(Variant variant) except NULL:
    """The variant's tables, refusing one this CPU cannot run (ktfp8.backends never hands one out)."""
    if not variant.usable:
        raise ValueError(f"backend {variant.name!r} is compiled but this CPU/OS cannot run it")
    return variant.v


cdef list wrap_entries(const ktfp8_variant_entry *table, int count, object owner):
    """Variant objects of the compiled rows of a table (rows the build left out hold NULL)."""
    cdef Variant w
    out = []
    for i in range(count):
        if table[i].v.codec == NULL or table[i].v.moe == NULL:
            continue
        w = Variant.__new__(Variant)
        w.v = &table[i].v
        w.name = table[i].v.name.decode("ascii")
        w.isa = ktfp8_isa_name(table[i].isa).decode("ascii")
        w.usable = ktfp8_isa_usable(table[i].isa)
        w.emulated = table[i].emulated
        w.owner = owner
        out.append(w)
    return out


def variants():
    """Variant objects of this module's compiled variants, best first, the reference last."""
    cdef int count
    cdef const ktfp8_variant_entry *table = ktfp8_native_variants(&count)
    return wrap_entries(table, count, None)


def test_variants(module):
    """Variant objects of the test module's *_emulated variants (ktfp8._native._testing)."""
    count, capsule = module.variant_table()
    cdef const ktfp8_variant_entry *table = <const ktfp8_variant_entry *>PyCapsule_GetPointer(
        capsule, "ktfp8_variant_entry")
    return wrap_entries(table, count, module)
