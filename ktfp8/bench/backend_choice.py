"""Goal 4 of issue 11, measured side by side: with no backend=, MoE() runs every T at least as fast as
the best single backend.

Where two backends are both at the memory bus (decode on the Zen 5 VM: avx512_bf16, avx512 and avx2
within 3 % of each other when alternated), rows of the results table timed minutes apart differ by
the machine's drift: one such table put avx512 at 0.91 ms and the default avx512_bf16 at 1.20 ms at
T=1, and the goal at 1.32x.  So here every contending backend walks its own FP8 per-channel copies
of the layer, alive together, and each round runs, for every T and thread count, a short batch of
calls of each backend in turn, the order rotating from round to round.  A figure per (T, backend) is
the median over rounds of that round's default time over the backend's, each at its fastest thread
count in the round; the goal is the worst of them.  Small T take part in more rounds (ROUNDS): their
calls cost next to nothing, and where the backends are level at the bus a burst of the machine's
noise moves a round's ratio by 10-20 % (Zen 5 VM, T=1: six rounds read 0.92x-1.18x).

A backend the results table timed at OUT_OF_CONTENTION times the default's time at a T, or did not
time there at all (over the per-call limit), sits that T out, and the result says so (left_out): no
noise makes up a factor of 3, and such calls can cost minutes a round (on an Intel Xeon VM avx2
took 4-7 s per T=64 call against the default's 0.04, its subnormal FMA inputs each taking a
microcode assist; see moe_avx2.c)."""
import math
import statistics

from . import layers as L
from .interleaved import best_ms
from .run import _ktfp8_factory, time_calls, walks_alive_together

PC = "fp8_per_channel"
ROUNDS = {1: 18, 4: 12}  # rounds each T takes part in (else DEFAULT_ROUNDS), from the first round on
DEFAULT_ROUNDS = 6
CALLS = {1: 5, 4: 4, 16: 3, 64: 2}  # timed calls per batch by T (else 1), after one warm-up call
OUT_OF_CONTENTION = 3.0  # table time over the default's from which a backend sits a T out


def skip_reason(plan, layer, default):
    """Why the plan leaves the step out (a sentence), or None when it runs."""
    if layer not in plan.layers:
        return f"the layer {layer.name!r} is not in the plan (--layer)"
    if PC not in plan.formats:
        return f"{PC} is not in the plan (--formats)"
    if default not in plan.backends:
        return f"the default backend {default} is not in the plan (--backends)"
    if len(plan.backends) < 2:
        return f"only {default} is in the plan"
    return None


def run(plan, layer, default, rows=(), log=print):
    """The step for a Plan: its backends (the default first), T and thread counts, walks sized as the
    table's; {"skipped": reason} where it is left out.  rows: the results table's, for left_out()."""
    reason = skip_reason(plan, layer, default)
    if reason:
        log(f"interleaved backend choice skipped: {reason}")
        return {"skipped": reason}
    contenders = [default] + [b for b in plan.backends if b != default]
    out = left_out(rows, layer, contenders, plan.tokens)
    for t, why in out.items():
        for b, reason in why.items():
            log(f"interleaved backend choice: {b} sits T={t} out: {reason}")
    return measure(layer, contenders, plan.threads, plan.tokens, plan.walk_bytes, plan.walk_memory_bytes,
                   left=out, log=log)


def left_out(rows, layer, backends, tokens):
    """{T: {backend: reason}} for the backends (backends[0] the default) that sit T out: the table has
    no FP8 per-channel row of theirs at T on this layer, or its best time is OUT_OF_CONTENTION times
    the default's.  Without rows of the default at T nobody sits out."""
    def best(b, t):
        ms = [r["ms"] for r in rows if r["kind"] == "ktfp8" and r["side"] == f"ktfp8 {b}" and r["format"] == PC
              and r["layer"] == layer.name and r["tokens"] == t]
        return min(ms) if ms else None
    out = {}
    for t in tokens:
        default_ms = best(backends[0], t)
        if default_ms is None:
            continue
        for b in backends[1:]:
            ms = best(b, t)
            if ms is None:
                out.setdefault(t, {})[b] = "the results table did not time it (over the per-call limit)"
            elif ms >= OUT_OF_CONTENTION * default_ms:
                out.setdefault(t, {})[b] = (f"{ms:.2f} ms in the results table, {ms / default_ms:.1f}x the "
                                            f"default's {default_ms:.2f} ms")
    return out


def measure(layer, backends, threads, tokens, walk_bytes, walk_memory_bytes, rounds=None, calls=None, left=None,
            log=print):
    """backends[0] (the default) against the others.  rounds: {T: rounds} (default ROUNDS, else
    DEFAULT_ROUNDS); left: {T: {backend: reason}} of those sitting T out (left_out()); the result's
    rounds[r][str(T)][str(n)] = {order, ms: {backend: median of the batch}, samples_ms: {backend:
    [...]}} for the T that take part in round r, over the backends in contention there; figures: see
    figures()."""
    calls = calls or CALLS
    left = left or {}
    n_rounds = {t: (rounds or ROUNDS).get(t, DEFAULT_ROUNDS) for t in tokens}
    log(f"interleaved backend choice: T={','.join(f'{t} ({n_rounds[t]} rounds)' for t in tokens)} x "
        f"{len(threads)} thread count(s) of each of {', '.join(backends)} in turn ({PC})")
    experts = L.random_experts(layer, PC, seed=2)
    # a backend sitting every T out needs no walk
    builds = {b: (_ktfp8_factory(b), lambda: experts) for b in backends
              if any(b not in left.get(t, {}) for t in tokens)}
    with walks_alive_together(builds, layer, threads[0], max(tokens), walk_bytes, walk_memory_bytes,
                              share=len(backends) + 1) as walks:
        xs = {t: L.activations(layer, t, seed=2) for t in tokens}
        per_batch = {t: calls.get(t, 1) + 1 for t in tokens}  # time_calls' warm-up call, then the timed ones
        # fresh routing for every batch, as a forward's layers draw theirs
        draws = {b: {t: L.routing_rounds(layer, t, n_rounds[t] * len(threads) * per_batch[t], seed=2,
                                         copies=len(w.copies))
                     for t in tokens} for b, w in walks.items()}
        out = []
        for r in range(max(n_rounds.values())):
            order = backends[r % len(backends):] + backends[:r % len(backends)]
            in_turn = {t: [b for b in order if b not in left.get(t, {})] for t in tokens}
            record = {}
            for t in (t for t in tokens if r < n_rounds[t]):
                record[str(t)] = {}
                for i, n in enumerate(threads):
                    start = (r * len(threads) + i) * per_batch[t]
                    samples = {}
                    for b in in_turn[t]:
                        walks[b].threads = n
                        batch = draws[b][t][start:start + per_batch[t]]
                        samples[b] = [s * 1e3 for s in time_calls(walks[b], xs[t], batch, math.inf)]
                    record[str(t)][str(n)] = dict(order=in_turn[t], samples_ms=samples,
                                                 ms={b: statistics.median(s) for b, s in samples.items()})
            out.append(record)
    result = dict(layer=layer.name, format=PC, backends=list(backends), default=backends[0], tokens=list(tokens),
                  threads=list(threads), calls={str(t): per_batch[t] - 1 for t in tokens},
                  n_rounds={str(t): n for t, n in n_rounds.items()}, rounds=out,
                  left_out={str(t): why for t, why in left.items()})
    result["figures"] = figures(result)
    return result


def figures(result):
    """ratio[str(T)][backend]: median over the rounds T took part in of the default's ms over the
    backend's, each at its fastest thread count in the round; worst: the largest of them as {tokens,
    backend, ratio, spread, default_ms, backend_ms} (medians over those rounds; spread: the per-round
    ratios' middle_half), None with a single backend."""
    default = result["default"]
    recs = {t: [rec[t] for rec in result["rounds"] if t in rec] for t in map(str, result["tokens"])}
    left = result.get("left_out", {})
    ratio = {t: {b: statistics.median(best_ms(rec, default) / best_ms(rec, b) for rec in recs[t])
                 for b in result["backends"] if b != default and b not in left.get(t, {})}
             for t in recs}
    cases = [(r, t, b) for t, by_b in ratio.items() for b, r in by_b.items()]
    if not cases:
        return dict(ratio=ratio, worst=None)
    r, t, b = max(cases)
    per_round = [best_ms(rec, default) / best_ms(rec, b) for rec in recs[t]]
    return dict(ratio=ratio, worst=dict(
        tokens=int(t), backend=b, ratio=r, spread=middle_half(per_round),
        default_ms=statistics.median(best_ms(rec, default) for rec in recs[t]),
        backend_ms=statistics.median(best_ms(rec, b) for rec in recs[t])))


def middle_half(values):
    """[first quartile, third quartile] of values (both the value itself when there is one): how far
    the rounds scatter around their median, so that a reader can tell a ratio of 1.02 from noise."""
    if len(values) < 2:
        return [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q3]
