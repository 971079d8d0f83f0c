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
    read_gbs: float                 # median GB/s reading a buffer much larger than the caches
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


def read_bandwidth(threads=None, nbytes=1 << 30, repeats=5, buf=None):
    """Median GB/s of `repeats` passes over an nbytes buffer (default 1 GiB >> any L3), or over `buf`
    (a probe_buffer) when given: a caller that probes again and again allocates it once."""
    threads = backends.default_threads(threads)
    if buf is None:
        buf = probe_buffer(nbytes, threads)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _ext.probe_read(buf, threads)
        rates.append(buf.nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


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
