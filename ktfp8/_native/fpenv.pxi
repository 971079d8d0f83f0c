# The caller's floating-point mode (fpenv.h).  Not test-only: the benchmark's kt-kernel side undoes
# the FTZ/DAZ that kt-kernel's -ffast-math build sets when it is imported (ktfp8/bench/kt_kernel_peer.py).

cdef extern from "ktfp8/fpenv.h":
    unsigned _mm_getcsr()
    void _mm_setcsr(unsigned)


def mxcsr():
    """This thread's MXCSR (SSE control/status: bit 6 DAZ, bit 15 FTZ)."""
    return _mm_getcsr()


def set_mxcsr(unsigned value):
    """Sets this thread's MXCSR (undoing what a -ffast-math library set at load; tests)."""
    _mm_setcsr(value)
