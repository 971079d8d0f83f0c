# cython: language_level=3
"""Test-only native code, kept out of the package's import (as NumPy keeps _umath_tests): the
*_emulated variants and a hook into the AMX tile emulation.  Built with the test suite's build
(KTFP8_ENABLE_EMULATED not OFF); ktfp8.backends loads it only when an emulated variant is named or
listed."""

from libc.stdint cimport uint8_t
from cpython.pycapsule cimport PyCapsule_New

cdef extern from "ktfp8/dispatch.h":
    ctypedef struct ktfp8_variant_entry:
        pass

cdef extern from *:
    """
    const ktfp8_variant_entry *ktfp8_emulated_variants(int *count);
    int ktfp8_amx_emulated_dpbf16ps(const void *cfg, int d, int a, int b, const void *c, long c_stride,
                                    size_t c_bytes, const void *av, long a_stride, size_t a_bytes,
                                    const void *bv, long b_stride, size_t b_bytes, void *out,
                                    size_t out_bytes);
    """
    const ktfp8_variant_entry *ktfp8_emulated_variants(int *count)
    int ktfp8_amx_emulated_dpbf16ps(const void *cfg, int d, int a, int b, const void *c, long c_stride,
                                    size_t c_bytes, const void *av, long a_stride, size_t a_bytes,
                                    const void *bv, long b_stride, size_t b_bytes, void *out,
                                    size_t out_bytes) nogil


def variant_table():
    """(count, capsule of the ktfp8_variant_entry table) of the emulated twins, for
    ktfp8._native._ext.test_variants(); rows this build did not compile hold NULL tables."""
    cdef int count
    cdef const ktfp8_variant_entry *table = ktfp8_emulated_variants(&count)
    return count, PyCapsule_New(<void *>table, "ktfp8_variant_entry", NULL)


def amx_emulated_dpbf16ps(const uint8_t[::1] cfg, int d, int a, int b, const uint8_t[::1] c, long c_stride,
                          const uint8_t[::1] av, long a_stride, const uint8_t[::1] bv, long b_stride,
                          uint8_t[::1] out):
    """Emulated LDTILECFG cfg; TILELOADD d <- c, a <- av, b <- bv; TDPBF16PS d, a, b; TILESTORED d -> out.
    Buffers are raw bytes, strides in bytes.  Returns False when a buffer is too short for its tile."""
    if cfg.shape[0] != 64:
        raise ValueError("cfg must be the 64-byte tile configuration")
    if c.shape[0] == 0 or av.shape[0] == 0 or bv.shape[0] == 0 or out.shape[0] == 0:
        raise ValueError("tile buffers must not be empty")
    cdef int rc
    with nogil:
        rc = ktfp8_amx_emulated_dpbf16ps(&cfg[0], d, a, b, &c[0], c_stride, c.shape[0], &av[0], a_stride,
                                         av.shape[0], &bv[0], b_stride, bv.shape[0], &out[0], out.shape[0])
    return rc == 0
