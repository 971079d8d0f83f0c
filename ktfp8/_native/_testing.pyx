# cython: language_level=3
"""Test-only native code, kept out of the package's import (as NumPy keeps _umath_tests): the
*_emulated variants, hooks into the AMX tile emulation and the emulated VDPBF16PS, and one into a
variant's micro-kernel.
Built with the test suite's build (KTFP8_ENABLE_EMULATED not OFF); ktfp8.backends loads it only
when an emulated variant is named or listed."""

from libc.stdint cimport int64_t, uint8_t, uint16_t
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New

cdef extern from "ktfp8/dispatch.h":
    ctypedef struct ktfp8_variant_entry:
        pass
    ctypedef struct ktfp8_variant:
        pass

cdef extern from "ktfp8/bf16_dot_emulation.h":
    void ktfp8_emu_vdpbf16ps(float *acc, const uint16_t *src1, const uint16_t *src2) nogil

cdef extern from *:
    """
    const ktfp8_variant_entry *ktfp8_emulated_variants(int *count);
    int ktfp8_amx_emulated_dpbf16ps(const void *cfg, int d, int a, int b, const void *c, long c_stride,
                                    size_t c_bytes, const void *av, long a_stride, size_t a_bytes,
                                    const void *bv, long b_stride, size_t b_bytes, void *out,
                                    size_t out_bytes);
    int ktfp8_testing_tile_pair(const ktfp8_variant *variant, int paired, int format, int64_t k, int64_t block_k,
                                int64_t n_kblocks, const void *const w[2], const size_t w_bytes[2],
                                const float *const scale[2], const size_t scale_bytes[2], const void *a,
                                size_t a_bytes, int64_t a_stride, int64_t m, float *const c[2],
                                const size_t c_bytes[2]);
    int ktfp8_testing_tile_palette(void);
    """
    const ktfp8_variant_entry *ktfp8_emulated_variants(int *count)
    int ktfp8_amx_emulated_dpbf16ps(const void *cfg, int d, int a, int b, const void *c, long c_stride,
                                    size_t c_bytes, const void *av, long a_stride, size_t a_bytes,
                                    const void *bv, long b_stride, size_t b_bytes, void *out,
                                    size_t out_bytes) nogil
    int ktfp8_testing_tile_pair(const ktfp8_variant *variant, int paired, int format, int64_t k, int64_t block_k,
                                int64_t n_kblocks, const void *const w[2], const size_t w_bytes[2],
                                const float *const scale[2], const size_t scale_bytes[2], const void *a,
                                size_t a_bytes, int64_t a_stride, int64_t m, float *const c[2],
                                const size_t c_bytes[2]) nogil
    int ktfp8_testing_tile_palette() nogil


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


def emulated_vdpbf16ps(float[::1] acc, const uint16_t[::1] src1, const uint16_t[::1] src2):
    """VDPBF16PS acc, src1, src2 on one zmm as the *_emulated kernels run it
    (include/ktfp8/bf16_dot_emulation.h): acc, 16 FP32 lanes, is updated in place; src1 and src2
    hold 32 BF16 bit patterns each."""
    if acc.shape[0] != 16 or src1.shape[0] != 32 or src2.shape[0] != 32:
        raise ValueError("emulated_vdpbf16ps takes 16 FP32 accumulators and two vectors of 32 BF16")
    with nogil:
        ktfp8_emu_vdpbf16ps(&acc[0], &src1[0], &src2[0])


def tile_pair(variant, bint paired, int fmt, int64_t k, int64_t block_k, int64_t n_kblocks,
              const uint8_t[::1] w0, const uint8_t[::1] w1, const float[::1] s0, const float[::1] s1,
              const uint8_t[::1] a, int64_t a_stride, int64_t m, float[::1] c0, float[::1] c1):
    """Two micro-kernel jobs of `variant` (a ktfp8.backends Variant, native or emulated, that this
    CPU runs: the caller's check) over the same activations a [m][a_stride] (raw bytes of the
    variant's act_dtype; for m past layout.row_pad, rows up to a whole row_pad tile, which the
    kernel may read): weights w0, w1 (one packed tile each, raw bytes), scales s0, s1, outputs c0,
    c1 [m][rows_per_tile]; through tile_matmul2 when `paired`, else as two tile_matmul calls
    (testing/tile_pair_hook.c).
    An empty buffer raises IndexError (bounds-checked [0])."""
    cdef const void *w[2]
    cdef const float *s[2]
    cdef float *c[2]
    cdef size_t wb[2]
    cdef size_t sb[2]
    cdef size_t cb[2]
    w[0], w[1], wb[0], wb[1] = &w0[0], &w1[0], w0.shape[0], w1.shape[0]
    s[0], s[1], sb[0], sb[1] = &s0[0], &s1[0], 4 * s0.shape[0], 4 * s1.shape[0]
    c[0], c[1], cb[0], cb[1] = &c0[0], &c1[0], 4 * c0.shape[0], 4 * c1.shape[0]
    cdef const ktfp8_variant *v = <const ktfp8_variant *>PyCapsule_GetPointer(variant._tables(), "ktfp8_variant")
    cdef int rc = ktfp8_testing_tile_pair(v, paired, fmt, k, block_k, n_kblocks, w, wb, s, sb, &a[0],
                                          a.shape[0], a_stride, m, c, cb)
    if rc == -1:
        raise ValueError(f"{variant.name!r}: the buffers do not fit the jobs")
    if rc == -2:
        raise AssertionError(f"{variant.name!r} wrote past tile_scratch_bytes(k = {k})")
    if rc == -3:
        raise MemoryError("tile_pair: scratch")


def tile_palette():
    """The palette of the AMX tile configuration the calling thread holds: 0 when it holds none.
    Only on a CPU whose native `amx` variant is usable (else SIGILL)."""
    return ktfp8_testing_tile_palette()
