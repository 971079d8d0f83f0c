# Test hook of the AMX tile emulation (amx_emulation_hook.c); used by tests/test_amx_emulation.py only.

cdef extern from *:
    """
    int ktfp8_amx_emulated_dpbf16ps(const void *cfg, int d, int a, int b, const void *c, long c_stride,
                                    size_t c_bytes, const void *av, long a_stride, size_t a_bytes,
                                    const void *bv, long b_stride, size_t b_bytes, void *out,
                                    size_t out_bytes);
    """
    int ktfp8_amx_emulated_dpbf16ps(const void *cfg, int d, int a, int b, const void *c, long c_stride,
                                    size_t c_bytes, const void *av, long a_stride, size_t a_bytes,
                                    const void *bv, long b_stride, size_t b_bytes, void *out,
                                    size_t out_bytes) nogil


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
