"""T = 1 calls back to back on the benchmark layer (E=64, top-8, H=2048, I=768, FP8 per-channel), each
call a fresh routing draw (ktfp8.bench.layers.routing_rounds: weights from DRAM), for --seconds per
thread count; prints the median, mean, 99th percentile and largest call in ms and the calls per second.
The thread counts alternate --passes times in one process.  The README's CPU-quota and busy-core
figures ("### Threads") come from it: cgroup_quota.sh and busy_core.sh run it.

    python bench/readme_figures/t1_calls.py [--threads 2,1] [--seconds 10] [--passes 2]"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # a source checkout built in place
import ktfp8  # noqa: E402
from ktfp8.bench import layers as L  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="2,1", help="comma-separated thread counts (default 2,1)")
    p.add_argument("--seconds", type=float, default=10.0, help="calls per thread count for this long (default 10)")
    p.add_argument("--passes", type=int, default=1, help="alternate the thread counts this often (default 1)")
    args = p.parse_args(argv)
    layer = L.BENCH_LAYER
    start = time.perf_counter()
    moe = ktfp8.MoE(layer.config("fp8_per_channel"), L.random_experts(layer, "fp8_per_channel"))
    cgroup = open("/proc/self/cgroup").read().strip().replace("\n", " ")
    print(f"pid {os.getpid()} cgroup {cgroup}")
    print(f"built {layer.name} in {time.perf_counter() - start:.1f} s; backend {moe.backend}; "
          f"packed {moe.nbytes / 1e6:.0f} MB")
    x = L.activations(layer, 1)
    draws = L.routing_rounds(layer, 1, 64)
    for number in range(args.passes):
        for threads in (int(t) for t in args.threads.split(",")):
            moe.threads = threads
            for ids, w, _ in draws[:8]:
                moe(x, ids, w)                  # warm-up
            times, end, first = [], time.perf_counter() + args.seconds, time.perf_counter()
            while True:
                ids, w, _ = draws[len(times) % len(draws)]
                before = time.perf_counter()
                moe(x, ids, w)
                after = time.perf_counter()
                times.append(after - before)
                if after >= end:
                    break
            ms = np.array(times) * 1e3
            row = dict(pass_=number, threads=threads, calls=len(ms), median_ms=float(np.median(ms)),
                       mean_ms=float(ms.mean()), p99_ms=float(np.percentile(ms, 99)), max_ms=float(ms.max()),
                       calls_per_s=len(ms) / (time.perf_counter() - first))
            print(f"pass {number} threads {threads}: {row['calls']} calls, median {row['median_ms']:.3f} ms, "
                  f"mean {row['mean_ms']:.3f}, p99 {row['p99_ms']:.3f}, max {row['max_ms']:.2f}, "
                  f"{row['calls_per_s']:.0f} calls/s")
            print("JSON " + json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
