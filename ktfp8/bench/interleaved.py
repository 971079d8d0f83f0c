"""The decode goals of issue 11 that set one measurement against another -- FP8 per-channel against
BF16 weights, against block-wise FP8, and against the read bandwidth -- measured interleaved.

A VM's memory bandwidth can drift by a quarter over minutes (other tenants on the host), and the
results table times each format minutes apart, so a ratio of two table rows measures the drift as
much as the kernels.  Here the three formats' walks are alive together and each round runs, for every
thread count, a read-bandwidth probe and then a short batch of T=1 calls of each format in turn; a
goal figure is the median over rounds of that round's ratio.  The formats' order rotates from round to
round: on the Zen 3 VM the format that ran first after the probe was 1-2 % slower (per-channel against
block-wise 0.995x with per-channel first, 1.016x with block-wise first)."""
import gc
import math
import statistics

from .. import roofline
from . import layers as L
from .run import _ktfp8_factory, build_walk, time_calls
from .sides import available_memory

PC, BLOCK, BF16 = L.FORMATS
ROUNDS = 20        # rounds of (probe, each format's batch) per thread count
CALLS = 5          # timed T=1 calls per format and round, after one warm-up call
PROBE_REPEATS = 3  # passes of the read probe per round


def skip_reason(plan, layer, backend):
    """Why the plan leaves the interleaved step out (a sentence), or None when it runs."""
    if layer not in plan.layers:
        return f"the layer {layer.name!r} is not in the plan (--layer)"
    if 1 not in plan.tokens:
        return "T=1 is not in the plan (--tokens)"
    if backend not in plan.backends:
        return f"the default backend {backend} is not in the plan (--backends)"
    if PC not in plan.formats:
        return f"{PC} is not in the plan (--formats)"
    return None


def run(plan, layer, backend, log=print):
    """The interleaved step for a Plan: its thread counts and formats, walks sized as the table's,
    the probe on 4x L3 (the plan's read buffer where L3 is unknown); {"skipped": reason} if left out."""
    reason = skip_reason(plan, layer, backend)
    if reason:
        log(f"interleaved decode step skipped: {reason}")
        return {"skipped": reason}
    l3 = L.l3_bytes()
    return measure(layer, backend, plan.threads, [f for f in L.FORMATS if f in plan.formats],
                   probe_bytes=L.WALK_L3_MULTIPLE * l3 if l3 else plan.read_buffer_bytes,
                   walk_bytes=plan.walk_bytes, walk_memory_bytes=plan.walk_memory_bytes, log=log)


def measure(layer, backend, threads, formats, probe_bytes, walk_bytes, walk_memory_bytes,
            rounds=ROUNDS, calls=CALLS, log=print):
    """Raw per-round numbers and their figures.  rounds[r][str(n)] = {read_gbs, ms: {format: median
    of the batch}, samples_ms: {format: [...]}}.  Each walk gets walk_memory_bytes, and at most a
    third of the memory free when it is built (the three stay alive together)."""
    walks = {}
    try:
        for fmt in formats:
            budget = min(walk_memory_bytes, available_memory() // 3)
            walks[fmt] = build_walk(_ktfp8_factory(backend), layer, L.random_experts(layer, fmt), threads[0], 1,
                                    walk_bytes, budget)
            gc.collect()
        log(f"interleaved decode: {rounds} rounds x {len(threads)} thread count(s) of a {probe_bytes / 2**20:.0f} MiB "
            f"read probe, then {calls} T=1 calls of each of {', '.join(formats)} (ktfp8 {backend})")
        x = L.activations(layer, 1, seed=1)
        per_call = calls + 1  # time_calls' warm-up call, then the timed ones
        draws = {fmt: L.routing_rounds(layer, 1, rounds * len(threads) * per_call, seed=1, copies=len(w.copies))
                 for fmt, w in walks.items()}
        probe_buf = roofline.probe_buffer(probe_bytes, max(threads))  # one buffer for every round
        out = []
        for r in range(rounds):
            record = {}
            for i, n in enumerate(threads):
                for w in walks.values():
                    w.threads = n
                start = (r * len(threads) + i) * per_call
                probe = roofline.read_bandwidth(n, repeats=PROBE_REPEATS, buf=probe_buf)
                order = list(formats[r % len(formats):]) + list(formats[:r % len(formats)])
                samples = {fmt: [s * 1e3 for s in time_calls(walks[fmt], x, draws[fmt][start:start + per_call], math.inf)]
                           for fmt in order}
                record[str(n)] = dict(read_gbs=probe, order=order, ms={f: statistics.median(s) for f, s in samples.items()},
                                      samples_ms=samples)
            out.append(record)
        result = dict(layer=layer.name, backend=backend, tokens=1, calls=calls, probe_bytes=probe_bytes,
                      threads=list(threads), formats=list(formats),
                      copies={f: len(w.copies) for f, w in walks.items()},
                      walk_bytes={f: w.walk_bytes for f, w in walks.items()},
                      active_bytes={f: statistics.median(L.active_weight_bytes(layer, ids, f) for ids, _, _ in d)
                                    for f, d in draws.items()},
                      rounds=out)
    finally:
        for w in walks.values():
            w.close()
        walks.clear()
        gc.collect()
    result["figures"] = figures(result)
    return result


def best_ms(record, fmt):
    """One round's median ms of fmt at its fastest thread count."""
    return min(by_n["ms"][fmt] for by_n in record.values())


def figures(result):
    """The goal figures: medians over rounds of each round's ratio.  FP8 per-channel against another
    format compares each format at its fastest thread count in that round; the fraction of the read
    bandwidth is per thread count, against that round's probe.  A format not measured gives None."""
    def faster_than(other):
        if other not in result["formats"]:
            return None
        return statistics.median(best_ms(rec, other) / best_ms(rec, PC) for rec in result["rounds"])

    pc_bytes = result["active_bytes"][PC]
    return dict(fp8_vs_bf16=faster_than(BF16), pc_vs_block=faster_than(BLOCK),
                bw_fraction={str(n): statistics.median(pc_bytes / (rec[str(n)]["ms"][PC] / 1e3) / 1e9
                                                       / rec[str(n)]["read_gbs"] for rec in result["rounds"])
                             for n in result["threads"]})
