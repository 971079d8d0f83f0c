"""python -m ktfp8.bench.tokens_per_expert: each ktfp8 backend's speed against m, the number of tokens
routed to one expert in a call.

Every kernel changes path at fixed token counts (include/ktfp8/token_count.h: DECODE_M, KEEP_M, MR,
AMX_MIN_M) and the default backend is chosen from the CPU's features alone; this table is what those
choices are checked against on the machine at hand.  A layer of E experts (default 16 with the
benchmark layer's hidden 2048 and intermediate 768) routes every token to every expert, so that each
expert gets exactly m tokens.  Each backend walks distinct packed copies of it totalling at least 4x
the L3 (at most 8), so the weights come from DRAM as in a model's forward.  Per thread count and m:
each backend's median ms per call, GFLOP/s, its fraction of the peak of the unit it computes on and
of its roofline (floor = max(weight bytes / read bandwidth, FLOPs / that peak)), the fastest backend
marked *.  The peaks are the best of three readings before the table, as the bench takes them; the
read bandwidth is probed before every round of the backend's own timing (the median of those
readings), because a shared machine's bus drifts over minutes: on a Zen 4 VM the best of three
readings before a table gave 44-58 GB/s on 2 threads where probes a minute later read 32-35."""
import argparse
import dataclasses
import statistics
import time

import numpy as np

from .. import backends, cpu, numa, roofline
from ..generate import _positive  # the command lines' positive-integer check
from . import layers as L
from .__main__ import _bad_env_backend, _bad_threads, _default_backends, _int_list, cores_and_cpus
from .interleaved import PROBE_REPEATS
from .run import Plan, _ktfp8_factory, build_walk, measure_limits
from .sides import available_memory

DEFAULT_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32]
MIN_CALLS = 4  # timed calls per m and round at least (a layer with one copy is walked 4 times)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m ktfp8.bench.tokens_per_expert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=_int_list, default=DEFAULT_TOKENS,
                   help=f"tokens per expert m (default {','.join(map(str, DEFAULT_TOKENS))})")
    p.add_argument("--threads", type=_int_list,
                   help=f"thread counts (default 1 and the default count, one per core: 1,{backends.usable_cores()})")
    p.add_argument("--backends", type=lambda s: s.split(","),
                   help="ktfp8 backends (default: every usable one but the scalar 'reference')")
    p.add_argument("--format", default="fp8_per_channel", choices=L.FORMATS, help="weight format")
    p.add_argument("--experts", type=_positive, default=16, help="experts E, each receiving every token")
    p.add_argument("--hidden", type=_positive, default=L.BENCH_LAYER.hidden)
    p.add_argument("--intermediate", type=_positive, default=L.BENCH_LAYER.intermediate)
    p.add_argument("--rounds", type=_positive, default=5,
                   help=f"rounds over the token counts (timed calls per m: rounds x copies, at least "
                        f"rounds x {MIN_CALLS})")
    args = p.parse_args(argv)
    usable = backends.available_backends()
    for b in args.backends or []:
        if b not in usable:
            p.error(f"--backends: {b!r} is not usable here; usable: {', '.join(usable)}")
    why = _bad_threads(args.threads) or _bad_env_backend() or _does_not_fit(args)   # else a traceback, late
    if why:
        p.error(why)
    return args


def _does_not_fit(args):
    """Why the layer's weights, or a call's activations and routing, cannot fit in the memory free now."""
    free = available_memory()
    layer = _layer(args)
    # as drawn and as packed: both are held while a MoE packs
    drawn = layer.experts * layer.weights_per_expert * L.BYTES_PER_WEIGHT[args.format]
    weights = drawn + layer.packed_bytes(args.format)
    if weights > free:
        return (f"--experts / --hidden / --intermediate: the layer's weights take {weights / 1e9:.1f} GB (as "
                f"drawn and as packed), more than the {free / 1e9:.1f} GB of memory available now")
    m = max(args.tokens)
    # per token: float32 x and output, int64 ids and float32 weights, and the kernels' h (float32 at most)
    call = m * (args.hidden * 8 + args.experts * (12 + 4 * args.intermediate))
    if call > free:
        return (f"--tokens: a call of m={m} takes {call / 1e9:.1f} GB, more than the {free / 1e9:.1f} GB of "
                f"memory available now")
    return None


def time_calls(walk, experts, token_counts, rounds, hidden, before_round=None):
    """{m: median seconds of one call with m tokens on each of `experts` experts}, walking the copies
    of `walk` (a list of sides).  Each round times every m in turn, each walking the copies (as often
    as it takes to make MIN_CALLS calls), so that a moment of noise on a shared machine lands on a few
    samples of several m rather than on all samples of one.  before_round: called (no arguments)
    before each round's calls, e.g. a read probe."""
    rng = np.random.default_rng(0)
    calls = {m: (rng.standard_normal((m, hidden)).astype(np.float32),
                 np.tile(np.arange(experts, dtype=np.int64), (m, 1)),
                 np.full((m, experts), 1.0 / experts, np.float32)) for m in token_counts}
    for m in token_counts:  # warm-up: first-call costs (buffers, thread pool) stay out of the timing
        for side in walk:
            side(*calls[m])
    seconds = {m: [] for m in token_counts}
    walk = walk * -(-MIN_CALLS // len(walk))
    for _ in range(rounds):
        if before_round:
            before_round()
        for m in token_counts:
            for side in walk:
                start = time.perf_counter()
                side(*calls[m])
                seconds[m].append(time.perf_counter() - start)
    return {m: statistics.median(s) for m, s in seconds.items()}


def rows_for(layer, weight_bytes, backend, threads, seconds_by_m, limit):
    """One dict per m of one backend on `threads` threads: ms, GFLOP/s, of-peak, of-roof, against
    `limit` (a Roofline as a dict) as the bench's table holds them (roofline.floor_seconds)."""
    unit = roofline.backend_unit(backend)
    peak = roofline.peak_gflops(limit, unit)  # 0.0 on a CPU without AVX2: no compute floor then
    rows = []
    for m, seconds in seconds_by_m.items():
        flops = 2 * m * layer.experts * layer.weights_per_expert
        floor = max(roofline.floor_seconds(limit, weight_bytes, flops, unit))
        rows.append(dict(threads=threads, m=m, backend=backend, ms=seconds * 1e3, gflops=flops / seconds / 1e9,
                         unit=unit, of_peak=flops / seconds / 1e9 / peak if peak else None,
                         of_roof=floor / seconds))
    return rows


def table(rows):
    lines = [f"{'thr':>3} {'m':>3}  {'backend':<14} {'ms':>9} {'GFLOP/s':>8} {'unit':>6} {'of-peak':>7} {'of-roof':>7}"]
    for key in sorted({(r["threads"], r["m"]) for r in rows}):
        group = [r for r in rows if (r["threads"], r["m"]) == key]
        fastest = min(r["ms"] for r in group)
        for r in group:
            mark = "*" if r["ms"] == fastest and len(group) > 1 else " "
            of_peak = "-" if r["of_peak"] is None else f"{r['of_peak']:.0%}"
            lines.append(f"{r['threads']:>3} {r['m']:>3} {mark}{r['backend']:<14} {r['ms']:>9.2f} {r['gflops']:>8.1f} "
                         f"{r['unit']:>6} {of_peak:>7} {r['of_roof']:>7.0%}")
    return "\n".join(lines)


def _layer(args):
    return L.Layer(f"E={args.experts} (every token on every expert) H={args.hidden} I={args.intermediate}",
                   args.experts, args.experts, args.hidden, args.intermediate)


def main(argv=None):
    args = parse_args(argv)
    layer = _layer(args)
    thread_counts = sorted(set(args.threads or [1, backends.usable_cores()]))
    plan = Plan(layers=[layer], tokens=args.tokens, threads=thread_counts,
                backends=args.backends or _default_backends())  # the bench's walk sizes
    cores = cores_and_cpus(backends.affinity_cores(), len(numa.affinity_cpus()))
    print(f"{cpu.describe(cpu.report())}: {cores}, L3 {(L.l3_bytes() or 0) / 2**20:.0f} MiB")
    print(f"layer {layer.name}, {args.format}; default backend {backends.resolve_backend(None)}", flush=True)
    measured = measure_limits(thread_counts, max(1 << 28, plan.walk_bytes), log=lambda msg: print(msg, flush=True))
    limits = {n: dataclasses.asdict(lim) for n, lim in measured.items()}
    for n in thread_counts:
        peaks = ", ".join(f"{roofline.UNIT_NAMES[u]} {limits[n][field]:.0f}"
                          for u, field in roofline.UNIT_FIELDS.items() if limits[n][field])
        print(f"{n} thread(s): read {limits[n]['read_gbs']:.1f} GB/s (the rows use the probes between their "
              f"rounds); GFLOP/s peaks: {peaks}", flush=True)
    experts = L.random_experts(layer, args.format)
    weight_bytes = layer.experts * layer.weights_per_expert * L.BYTES_PER_WEIGHT[args.format]
    probe_buf = roofline.probe_buffer(L.probe_bytes(1 << 28))
    rows = []
    for backend in plan.backends:  # packed once; the thread count changes between calls
        walk = build_walk(_ktfp8_factory(backend), layer, experts, thread_counts[0], max(args.tokens),
                          plan.walk_bytes, plan.walk_memory_bytes)
        print(f"  {backend}: {len(walk.copies)} packed copies of {weight_bytes / 1e6:.0f} MB", flush=True)
        for n in thread_counts:
            walk.threads = n
            reads = []
            seconds_by_m = time_calls(walk.copies, layer.experts, args.tokens, args.rounds, layer.hidden,
                                      before_round=lambda: reads.append(roofline.read_bandwidth(
                                          n, buf=probe_buf, repeats=PROBE_REPEATS)))
            read_gbs = statistics.median(reads)
            print(f"  {backend}, {n} thread(s): read {read_gbs:.1f} GB/s between its rounds "
                  f"({min(reads):.1f}-{max(reads):.1f})", flush=True)
            rows += rows_for(layer, weight_bytes, backend, n, seconds_by_m, dict(limits[n], read_gbs=read_gbs))
        walk.close()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
