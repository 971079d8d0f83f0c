"""Memory for data that streams from DRAM: the packed experts, and the read-bandwidth probe's buffer.

Backed by transparent huge pages where Linux offers them to a program that asks (`madvise`, the
mode of many distributions and VMs; with `always` they come anyway, with `never` not at all).  A
stream through 4 KiB pages crosses a page every 64 cache lines, each crossing a TLB miss and a
page walk (two-dimensional in a VM); through 2 MiB pages one in 32768.  Measured on a 2-core AMD
EPYC (Zen 1) VM, `probe_read` over 512 MiB, both kinds of buffer alternated, 8 rounds, three runs:
1 thread 1.06x-1.08x the read bandwidth of 4 KiB pages, 2 threads 1.03x-1.05x.  The kernels' own
streams gained nothing there (benchmark layer, both kinds alternated in one process: T = 1
0.99x-1.01x on 1 and 2 threads, T = 64 0.98x), their software prefetch running pages ahead; the
probe has none.  So the bench's read limit is the higher figure, and the experts sit in the same
kind of pages as the buffer that figure was read from.

Why a mapping of its own rather than np.empty: NumPy's memory comes from malloc, whose large blocks
are 4 KiB-aligned private mappings the caller cannot advise before malloc returns them, and a huge
page needs a 2 MiB-aligned start.  Here an anonymous private mapping is made one huge page longer
than asked, advised on its aligned part before anything touches it (so the first touch, by whoever
writes it first, faults in huge pages), and the aligned part is returned; the unused slack is never
touched and so never resident."""
import mmap

import numpy as np

_HUGE_PAGE_BYTES = 2 << 20  # x86-64's PMD-sized transparent huge page
_ALIGNMENT = 64             # every buffer's start: a cache line (the kernels' aligned loads)


def stream_buffer(nbytes):
    """An uninitialised, 64-byte aligned uint8 array of nbytes; from 2 MiB on, 2 MiB aligned and
    advised for transparent huge pages where this OS has them.  MemoryError when it cannot be had."""
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"stream_buffer: nbytes must be >= 0, got {nbytes}")
    advise = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advise is None or nbytes < _HUGE_PAGE_BYTES:
        raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
        start = (-raw.ctypes.data) % _ALIGNMENT
        return raw[start:start + nbytes]
    try:
        mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise MemoryError(f"stream_buffer: cannot map {nbytes} bytes: {e}") from None
    raw = np.frombuffer(mapping, np.uint8)  # holds the mapping open for as long as any view lives
    start = (-raw.ctypes.data) % _HUGE_PAGE_BYTES
    try:
        mapping.madvise(advise, start, nbytes)
    except OSError:
        pass  # THP compiled out or switched off for this process: the buffer works as 4 KiB pages
    return raw[start:start + nbytes]
