"""This machine's limits, measured in-process: streaming read bandwidth and vector FLOP/s peaks.

Benchmarks report kernel speed as fractions of these figures, measured in the same run."""
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import backends
from ._native import _ext


@dataclass(frozen=True)
class Roofline:
    threads: int
    read_gbs: float                 # median GB/s reading a buffer much larger than the caches
    fma_gflops: float               # FP32 FMA (AVX2) peak; 0 without AVX2
    dpbf16_gflops: Optional[float]  # vdpbf16ps peak; None without AVX-512-BF16

    @property
    def compute_gflops(self):
        """The peak the fastest usable kernel can aim for."""
        return self.dpbf16_gflops or self.fma_gflops


def _aligned(nbytes, alignment=64):
    raw = np.ones(nbytes + alignment, np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes]


def read_bandwidth(threads=None, nbytes=1 << 30, repeats=5):
    """Median GB/s of `repeats` passes over an nbytes buffer (default 1 GiB >> any L3)."""
    threads = backends.default_threads(threads)
    buf = _aligned(nbytes - nbytes % 128)
    _ext.probe_read(buf, threads)  # touch every page before timing
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


def measure(threads=None, nbytes=1 << 30):
    threads = backends.default_threads(threads)
    dpbf16 = _peak(_ext.probe_dpbf16, threads)
    return Roofline(threads=threads, read_gbs=read_bandwidth(threads, nbytes),
                    fma_gflops=_peak(_ext.probe_fma, threads), dpbf16_gflops=dpbf16 or None)
