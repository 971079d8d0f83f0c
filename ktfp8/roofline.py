"""This machine's limits, measured in-process: streaming read bandwidth and the FLOP/s peak of each
compute unit a kernel can use (FP32 FMA on ymm and zmm, AVX-512 `vdpbf16ps`, AMX `tdpbf16ps`).

Benchmarks report kernel speed as fractions of these figures, measured in the same run: the roofline
floor of a call is max(bytes it must read / read bandwidth, its FLOPs / the peak of the unit it
computes on)."""
import statistics
import time
from dataclasses import dataclass, fields
from typing import Optional

from . import backends, pages
from ._native import _ext

# compute unit -> the Roofline field holding its peak
UNIT_FIELDS = {"amx": "amx_gflops", "dpbf16": "dpbf16_gflops", "fma512": "fma512_gflops", "fma": "fma_gflops"}
UNIT_NAMES = {"amx": "AMX tdpbf16ps", "dpbf16": "vdpbf16ps", "fma512": "FP32 FMA zmm", "fma": "FP32 FMA"}
# the unit each backend's large-T path computes on; every other backend uses FP32 FMA on ymm
BACKEND_UNITS = {"amx": "amx", "avx512_bf16": "dpbf16", "avx512": "fma512"}
# compute unit -> its peak probe in _ext (each returns 0.0 where this CPU or build cannot run it)
UNIT_PROBES = {"amx": "probe_tdpbf16", "dpbf16": "probe_dpbf16", "fma512": "probe_fma512", "fma": "probe_fma"}


@dataclass(frozen=True)
class Roofline:
    threads: int
    read_gbs: float                 # GB/s reading a buffer much larger than the caches (read_bandwidth)
    fma_gflops: float               # FP32 FMA (AVX2, ymm) peak; 0 without AVX2
    dpbf16_gflops: Optional[float]  # vdpbf16ps peak; None without AVX-512-BF16
    amx_gflops: Optional[float] = None     # AMX tdpbf16ps peak; None where tiles are not usable
    fma512_gflops: Optional[float] = None  # FP32 FMA peak on zmm; None without AVX-512


def backend_unit(backend):
    """The compute unit ('amx', 'dpbf16', 'fma512' or 'fma') a ktfp8 backend's compute-bound path runs on."""
    return BACKEND_UNITS.get(backend, "fma")


def best_unit(limits):
    """The unit with the highest measured peak in `limits` (a Roofline as a dict)."""
    return max(UNIT_FIELDS, key=lambda u: limits.get(UNIT_FIELDS[u]) or 0.0)


def peak_gflops(limits, unit=None):
    """The measured peak of `unit` in `limits` (a Roofline as a dict, as results JSON holds it);
    unit None, or a unit not measured there: the fastest unit this machine has."""
    return (limits.get(UNIT_FIELDS[unit]) if unit else None) or limits.get(UNIT_FIELDS[best_unit(limits)]) or 0.0


def floor_seconds(limits, nbytes, flops, unit=None):
    """(memory floor, compute floor) in seconds of a call reading `nbytes` and doing `flops` on
    `unit`, against `limits` (a Roofline as a dict); the roofline floor is the larger of the two."""
    peak = peak_gflops(limits, unit)
    return nbytes / (limits["read_gbs"] * 1e9), flops / (peak * 1e9) if peak else 0.0


def probe_buffer(nbytes, threads=None):
    """A buffer for read_bandwidth: nbytes (down to the probe's 128-byte step), 64-byte aligned, in
    the same kind of pages as the packed experts (pages.stream_buffer), so that their streams are
    held to what this machine's memory delivers to them.  Written once (a page never written reads
    as the kernel's one shared zero page, from cache) and read once by `threads` threads."""
    buf = pages.stream_buffer(nbytes - nbytes % 128)
    buf.fill(1)
    _ext.probe_read(buf, backends.default_threads(threads))
    return buf


# Streams per thread the read probe tries; the bandwidth is the best of them.  One sequential stream a
# thread under-reads what the kernels' several streams (gate and up tiles, experts side by side) get:
# an Emerald Rapids VM's kernels read 104 % of the 1-stream figure.  On the 2-core Zen 3 VM (1 GiB,
# medians of 7 passes, three processes) 1 stream read 19.2-20.4 GB/s on 1 thread, 4 streams
# 22.8-26.5; on 2 threads 29.9-36.8 against 32.5-43.5 (2 streams: between the two).  The streams
# start at different offsets within a page (probe_share.h): 256 MiB apart and at the same offset,
# 4 streams read 14-27 GB/s on 1 thread, by process (the physical pages' DRAM banks, presumably).
# Software prefetch 0.5-2 KiB ahead added nothing to 4 streams (0.97x-1.01x) and took 1 stream to 0.8x.
READ_STREAMS = (1, 4)


def read_bandwidth(threads=None, nbytes=1 << 30, repeats=5, buf=None):
    """GB/s reading an nbytes buffer (default 1 GiB >> any L3), or `buf` (a probe_buffer) when given:
    a caller that probes again and again allocates it once.  The best over READ_STREAMS of the median
    of `repeats` passes, the stream counts taking turns pass by pass."""
    threads = backends.default_threads(threads)
    if buf is None:
        buf = probe_buffer(nbytes, threads)
    rates = {streams: [] for streams in READ_STREAMS}
    for _ in range(repeats):
        for streams, seen in rates.items():
            t0 = time.perf_counter()
            _ext.probe_read(buf, threads, streams)
            seen.append(buf.nbytes / (time.perf_counter() - t0) / 1e9)
    return max(statistics.median(seen) for seen in rates.values())


def _peak(probe, threads, repeats=5, seconds=0.05):
    iters = 1 << 16
    while True:  # grow until one run takes long enough to time well
        t0 = time.perf_counter()
        flops = probe(iters, threads)
        if flops == 0.0:
            return 0.0
        if time.perf_counter() - t0 >= seconds:
            break
        iters *= 2
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        flops = probe(iters, threads)
        rates.append(flops / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def unit_peak(unit, threads=None, repeats=5):
    """Median GFLOP/s of `unit`'s peak probe on `threads` threads; 0.0 where it cannot run here."""
    return _peak(getattr(_ext, UNIT_PROBES[unit]), backends.default_threads(threads), repeats)


def best_of(a, b):
    """Field by field the higher of two Rooflines of one thread count: a limit is what the machine
    can do, and a lower reading is another tenant's load, not the machine."""
    def higher(x, y):
        return y if x is None else x if y is None else max(x, y)
    return Roofline(**{f.name: higher(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)})


def measure(threads=None, nbytes=1 << 30):
    threads = backends.default_threads(threads)
    return Roofline(threads=threads, read_gbs=read_bandwidth(threads, nbytes),
                    fma_gflops=unit_peak("fma", threads),
                    dpbf16_gflops=unit_peak("dpbf16", threads) or None,
                    amx_gflops=unit_peak("amx", threads) or None,
                    fma512_gflops=unit_peak("fma512", threads) or None)
