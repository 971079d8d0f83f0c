"""The goals of issue 11 that set one measurement against another, measured interleaved: at T=1 FP8
per-channel against BF16 weights, against block-wise FP8 and against the read bandwidth; at T=64 and
T=512 FP8 per-channel against the memory floor and the compute unit's peak.

A VM's memory bandwidth (and a shared core's FLOP rate) can drift by a quarter over minutes (other
tenants on the host), and the results table times each case minutes after the limits were probed, so
a ratio of two table rows, or of a row and a limit, measures the drift as much as the kernels.  Here
the formats' walks are alive together and each decode round runs, for every thread count, a
read-bandwidth probe and then a short batch of T=1 calls of each format in turn; each round at T=64 or
T=512 runs the read probe, the peak probe of the backend's compute unit and a few calls of FP8
per-channel.  A goal figure is the median over rounds of that round's ratio.  The formats' order
rotates from round to round: on the Zen 3 VM the format that ran first after the probe was 1-2 %
slower (per-channel against block-wise 0.995x with per-channel first, 1.016x with block-wise first)."""
import math
import statistics

from .. import roofline
from . import layers as L
from .run import _ktfp8_factory, time_calls, walks_alive_together

PC, BLOCK, BF16 = L.FORMATS
ROUNDS = 20        # rounds of (probe, each format's batch) per thread count
CALLS = 5          # timed T=1 calls per format and round, after one warm-up call
PROBE_REPEATS = 3  # passes of the read probe (and runs of the peak probe) per round
ROOF_TOKENS = (64, 512)        # the T of goals 2 and 3, each interleaved with both probes
ROOF_ROUNDS = 8                # rounds of (probes, calls) per thread count at each of them
ROOF_CALLS = {64: 3, 512: 1}   # timed calls per round, after one warm-up call (512: ~0.3-0.7 s each here)


def skip_reason(plan, layer, backend):
    """Why the plan leaves the interleaved step out (a sentence), or None when it runs."""
    if layer not in plan.layers:
        return f"the layer {layer.name!r} is not in the plan (--layer)"
    if not step_tokens(plan):
        return f"T=1 is not in the plan (--tokens), nor {' or '.join(map(str, ROOF_TOKENS))}"
    if backend not in plan.backends:
        return f"the default backend {backend} is not in the plan (--backends)"
    if PC not in plan.formats:
        return f"{PC} is not in the plan (--formats)"
    return None


def step_tokens(plan):
    """The T of the plan the interleaved step measures: 1 (decode) and ROOF_TOKENS."""
    return [t for t in (1,) + ROOF_TOKENS if t in plan.tokens]


def run(plan, layer, backend, log=print):
    """The interleaved step for a Plan: its thread counts and formats, walks sized as the table's,
    the probe on 4x L3 (the plan's read buffer where L3 is unknown); {"skipped": reason} if left out."""
    reason = skip_reason(plan, layer, backend)
    if reason:
        log(f"interleaved step skipped: {reason}")
        return {"skipped": reason}
    tokens = step_tokens(plan)
    formats = [f for f in L.FORMATS if f in plan.formats] if 1 in tokens else [PC]
    result = measure(layer, backend, plan.threads, formats,
                     probe_bytes=L.probe_bytes(plan.read_buffer_bytes),
                     walk_bytes=plan.walk_bytes, walk_memory_bytes=plan.walk_memory_bytes,
                     roof_tokens=[t for t in tokens if t != 1], rounds=ROUNDS if 1 in tokens else 0, log=log)
    if 1 not in tokens:
        result["decode_skipped"] = "T=1 is not in the plan (--tokens)"
    return result


def measure(layer, backend, threads, formats, probe_bytes, walk_bytes, walk_memory_bytes, roof_tokens=(),
            rounds=ROUNDS, calls=CALLS, roof_rounds=ROOF_ROUNDS, roof_calls=None, log=print):
    """Raw per-round numbers and their figures.  Decode (T=1, `rounds` rounds; 0: none):
    rounds[r][str(n)] = {read_gbs, order, ms: {format: median of the batch}, samples_ms: {format: [...]}}.
    Each T of roof_tokens (FP8 per-channel, `roof_rounds` rounds, roof_calls[T] calls, default
    ROOF_CALLS): roofline[str(T)] = {active_bytes, flops, unit, rounds: [{str(n): {read_gbs,
    peak_gflops, ms, samples_ms}}]}.  Each walk gets walk_memory_bytes, and at most a third of the
    memory free when it is built (the formats' walks stay alive together)."""
    # each format's random weights made in turn, as its walk is built
    builds = {fmt: (_ktfp8_factory(backend), lambda fmt=fmt: L.random_experts(layer, fmt)) for fmt in formats}
    with walks_alive_together(builds, layer, threads[0], 1, walk_bytes, walk_memory_bytes, share=3) as walks:
        if rounds:
            log(f"interleaved decode: {rounds} rounds x {len(threads)} thread count(s) of a {probe_bytes / 2**20:.0f} "
                f"MiB read probe, then {calls} T=1 calls of each of {', '.join(formats)} (ktfp8 {backend})")
        x = L.activations(layer, 1, seed=1)
        per_call = calls + 1  # time_calls' warm-up call, then the timed ones
        draws = {fmt: L.routing_rounds(layer, 1, rounds * len(threads) * per_call, seed=1, copies=len(w.copies))
                 for fmt, w in walks.items()} if rounds else {}
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
        result["roofline"] = {str(t): measure_roofline(walks[PC], layer, backend, threads, t, probe_buf, roof_rounds,
                                                       (roof_calls or ROOF_CALLS)[t], log)
                              for t in roof_tokens}
    result["figures"] = figures(result)
    return result


def measure_roofline(walk, layer, backend, threads, tokens, probe_buf, rounds, calls, log=print):
    """`rounds` rounds at T=`tokens` on `walk` (FP8 per-channel): per thread count the read probe, the
    peak probe of the backend's compute unit, then `calls` calls after a warm-up one."""
    unit = roofline.backend_unit(backend)
    log(f"interleaved T={tokens}: {rounds} rounds x {len(threads)} thread count(s) of the read probe and the "
        f"{roofline.UNIT_NAMES[unit]} peak probe, then {calls} T={tokens} calls of {PC} (ktfp8 {backend})")
    x = L.activations(layer, tokens, seed=tokens)
    per_call = calls + 1
    draws = L.routing_rounds(layer, tokens, rounds * len(threads) * per_call, seed=tokens, copies=len(walk.copies))
    out = []
    for r in range(rounds):
        record = {}
        for i, n in enumerate(threads):
            walk.threads = n
            start = (r * len(threads) + i) * per_call
            read = roofline.read_bandwidth(n, repeats=PROBE_REPEATS, buf=probe_buf)
            peak = roofline.unit_peak(unit, n, repeats=PROBE_REPEATS)
            samples = [s * 1e3 for s in time_calls(walk, x, draws[start:start + per_call], math.inf)]
            record[str(n)] = dict(read_gbs=read, peak_gflops=peak, ms=statistics.median(samples), samples_ms=samples)
        out.append(record)
    return dict(tokens=tokens, calls=calls, unit=unit, flops=layer.flops(tokens),
                active_bytes=statistics.median(L.active_weight_bytes(layer, ids, PC) for ids, _, _ in draws),
                rounds=out)


def round_best(record):
    """One roofline round at its fastest thread count against its best probes (the bus with all
    threads, the unit's peak): (ms, read GB/s, peak GFLOP/s)."""
    return (min(v["ms"] for v in record.values()), max(v["read_gbs"] for v in record.values()),
            max(v["peak_gflops"] for v in record.values()))


def roofline_figures(entry):
    """Goals 2 and 3 from one T of the roofline rounds: medians over rounds of that round's ratio
    (round_best): time over the memory floor, fraction of the unit's peak, fraction of the roofline."""
    def per_round(rec):
        ms, read, peak = round_best(rec)
        seconds, memory_s = ms / 1e3, entry["active_bytes"] / (read * 1e9)
        compute_s = entry["flops"] / (peak * 1e9) if peak else 0.0
        return seconds / memory_s, compute_s / seconds if peak else None, max(memory_s, compute_s) / seconds
    rounds = [per_round(rec) for rec in entry["rounds"]]
    peak_fractions = [r[1] for r in rounds if r[1] is not None]
    return dict(over_memory_floor=statistics.median(r[0] for r in rounds),
                peak_fraction=statistics.median(peak_fractions) if peak_fractions else None,
                roofline_fraction=statistics.median(r[2] for r in rounds))


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

    roof = {t: roofline_figures(entry) for t, entry in result["roofline"].items()}
    if not result["rounds"]:  # no decode rounds (T=1 not in the plan)
        return dict(fp8_vs_bf16=None, pc_vs_block=None, bw_fraction={}, roofline=roof)
    pc_bytes = result["active_bytes"][PC]
    return dict(fp8_vs_bf16=faster_than(BF16), pc_vs_block=faster_than(BLOCK),
                bw_fraction={str(n): statistics.median(pc_bytes / (rec[str(n)]["ms"][PC] / 1e3) / 1e9
                                                       / rec[str(n)]["read_gbs"] for rec in result["rounds"])
                             for n in result["threads"]},
                roofline=roof)
