"""The README's huge-page figures (Backends): the read probe (ktfp8's own, _ext.probe_read) over a
buffer in transparent huge pages (ktfp8.pages.stream_buffer, as the packed experts are) against one in
4 KiB pages (an anonymous mapping advised MADV_NOHUGEPAGE), the two alternated pass by pass, on 1 and
2 threads, 1 and 4 streams a thread; GB/s medians and the huge / 4 KiB ratio per round.

    python bench/readme_figures/huge_pages.py [--mib 512] [--rounds 8]"""
import argparse
import mmap
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # a source checkout built in place
from ktfp8 import pages  # noqa: E402
from ktfp8._native import _ext  # noqa: E402


def anon_huge_kb():
    with open("/proc/self/smaps_rollup") as f:
        return next((line.split()[1] for line in f if line.startswith("AnonHugePages")), "?")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="each buffer's size (default 512 MiB)")
    p.add_argument("--rounds", type=int, default=8, help="passes over each buffer (default 8)")
    args = p.parse_args(argv)
    size = args.mib << 20
    huge = pages.stream_buffer(size)
    huge.fill(1)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    small = np.frombuffer(mapping, np.uint8)
    small.fill(1)
    print(f"AnonHugePages of the process: {anon_huge_kb()} kB (the huge-page buffer is {size >> 10} kB)")
    for threads in (1, 2):
        for streams in (1, 4):
            for buf in (huge, small):               # warm-up
                _ext.probe_read(buf, threads, streams)
            rates = {"huge": [], "4k": []}
            for r in range(args.rounds):
                order = (("huge", huge), ("4k", small)) if r % 2 == 0 else (("4k", small), ("huge", huge))
                for name, buf in order:
                    start = time.perf_counter()
                    _ext.probe_read(buf, threads, streams)
                    rates[name].append(size / (time.perf_counter() - start) / 1e9)
            ratios = [h / s for h, s in zip(rates["huge"], rates["4k"])]
            print(f"{threads} thread(s), {streams} stream(s): huge {statistics.median(rates['huge']):.1f} GB/s, "
                  f"4 KiB {statistics.median(rates['4k']):.1f} GB/s; huge / 4 KiB median "
                  f"{statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
