# Roofline probes (probe.h).

from libc.stdint cimport uint64_t

cdef extern from "ktfp8/probe.h":
    const int KTFP8_PROBE_MAX_STREAMS
    uint64_t ktfp8_probe_read(const void *buf, size_t bytes, int threads, int streams) nogil
    double ktfp8_probe_fma(int64_t iters, int threads) nogil
    double ktfp8_probe_fma512(int64_t iters, int threads) nogil
    double ktfp8_probe_dpbf16(int64_t iters, int threads) nogil
    double ktfp8_probe_tdpbf16(int64_t iters, int threads) nogil


def probe_read(buf, int threads, int streams=1):
    """Reads the whole uint8 buffer (length a multiple of 128, 32-byte aligned) once, each thread's
    share as `streams` runs side by side; returns the sum of its 64-bit words modulo 2**64."""
    if not 1 <= streams <= KTFP8_PROBE_MAX_STREAMS:
        raise ValueError(f"probe_read: streams must be 1 .. {KTFP8_PROBE_MAX_STREAMS}, got {streams}")
    cdef const uint8_t[::1] b = buf
    cdef uint64_t total
    with nogil:
        total = ktfp8_probe_read(&b[0], b.shape[0], threads, streams)
    return total


def probe_fma(int64_t iters, int threads):
    """FP32 FMA flops done (0.0 when this CPU has no AVX2)."""
    with nogil:
        flops = ktfp8_probe_fma(iters, threads)
    return flops


def probe_fma512(int64_t iters, int threads):
    """FP32 FMA flops done on zmm (0.0 when this CPU has no AVX-512)."""
    with nogil:
        flops = ktfp8_probe_fma512(iters, threads)
    return flops


def probe_dpbf16(int64_t iters, int threads):
    """vdpbf16ps flops done (0.0 when this CPU has no AVX-512-BF16)."""
    with nogil:
        flops = ktfp8_probe_dpbf16(iters, threads)
    return flops


def probe_tdpbf16(int64_t iters, int threads):
    """AMX tdpbf16ps flops done (0.0 when AMX tiles are not usable here)."""
    with nogil:
        flops = ktfp8_probe_tdpbf16(iters, threads)
    return flops
