"""Goals 2 and 3's comparisons with the peers, measured side by side: FP8 per-channel on the default
backend against PyTorch BF16 at T=64, and against kt-kernel's AMX BF16 and PyTorch BF16 at T=512.

The results table times each side minutes apart, and on an Intel Xeon VM with AMX the AMX unit's
speed changes from minute to minute (its resident tdpbf16ps loop at 2.2 or 1.0 TFLOP/s per core):
three --quick runs there put ktfp8 at T=512 at 1.83x, 3.57x and 1.33x kt-kernel's AMXBF16_MOE from
table rows.  Here each side walks its own copies of the layer (its own random weights: FP8
per-channel for ktfp8, BF16 for the peers), all alive together, and each round times a short batch
of calls of each side in turn, the order rotating from round to round.  Each side runs at the thread
count of its fastest row in the table at that T (all of the plan's threads where it has none):
kt-kernel's dispatcher thread busy-waits beside its workers, so on a 2-core VM its pool of 1 worker
ran T=512 faster than its pool of 2 (302 against 348 us per token), and timing it on all threads
would have flattered ktfp8.  kt-kernel's pool is built for one thread count: that of the largest T it
takes part in.  A goal figure is the median over rounds of that round's peer time over ktfp8's."""
import contextlib
import gc
import math
import statistics

from . import layers as L
from .backend_choice import middle_half
from .run import _kt_kernel, _ktfp8_factory, _torch_bf16, build_walk, time_calls
from .sides import PeerUnavailable, available_memory

PC, BF16 = "fp8_per_channel", "bf16"
OURS = "ktfp8"
PEERS = {"kt-kernel": _kt_kernel, "torch bf16": _torch_bf16}  # label -> factory, on BF16 weights
GOAL_PEERS = {64: ("torch bf16",), 512: ("kt-kernel", "torch bf16")}  # the peers each T's goals name
ROUNDS = {64: 8, 512: 6}
CALLS = {64: 2, 512: 1}  # timed calls per batch, after one warm-up call (T=512: 0.04-0.2 s a call here)


def skip_reason(plan, layer, backend):
    """Why the plan leaves the step out (a sentence), or None when it runs."""
    if not plan.peers:
        return "the peers are not in the plan (--no-peers)"
    if layer not in plan.layers:
        return f"the layer {layer.name!r} is not in the plan (--layer)"
    if not step_tokens(plan):
        return f"neither T={' nor T='.join(map(str, GOAL_PEERS))} is in the plan (--tokens)"
    if backend not in plan.backends:
        return f"the default backend {backend} is not in the plan (--backends)"
    missing = [f for f in (PC, BF16) if f not in plan.formats]
    if missing:
        return f"{' and '.join(missing)} not in the plan (--formats)"
    return None


def step_tokens(plan):
    return [t for t in GOAL_PEERS if t in plan.tokens]


def run(plan, layer, backend, rows=(), log=print):
    """The step for a Plan, each side at its best thread count in the table's `rows`, walks sized as
    the table's; {"skipped": reason} where it is left out."""
    reason = skip_reason(plan, layer, backend)
    if reason:
        log(f"interleaved peers skipped: {reason}")
        return {"skipped": reason}
    tokens = step_tokens(plan)
    threads = best_threads(rows, layer, backend, tokens, max(plan.threads))
    return measure(layer, backend, threads, tokens, plan.walk_bytes, plan.walk_memory_bytes, log=log)


def best_threads(rows, layer, backend, tokens, otherwise):
    """{label: {T: n}}: the thread count of each side's fastest row on `layer` at each T of `tokens`
    (ktfp8 on `backend` with FP8 per-channel weights, a peer on BF16 weights, its rows' side name
    starting with its label), `otherwise` where the rows have none."""
    def fastest(label, t):
        found = [r for r in rows if r["layer"] == layer.name and r["tokens"] == t and (
            r["side"] == f"ktfp8 {backend}" and r["format"] == PC if label == OURS else
            r["kind"] == "peer" and r["side"].startswith(label) and r["format"] == BF16)]
        return min(found, key=lambda r: r["ms"])["threads"] if found else otherwise
    return {label: {t: fastest(label, t) for t in tokens} for label in [OURS, *PEERS]}


def measure(layer, backend, threads, tokens, walk_bytes, walk_memory_bytes, rounds=None, calls=None, peers=None,
            log=print):
    """ktfp8 `backend` on FP8 per-channel against the peers GOAL_PEERS names at each T of `tokens`
    (peers: {label: factory}, default PEERS), on `threads`: a count for every side and T, or {label:
    {T: count}} (best_threads()).  The result's rounds[r][str(T)] = {order, threads: {label: count},
    ms: {label: median of the batch}, samples_ms: {label: [...]}} for the T that take part in round r;
    names: {label: the side's name}; unavailable: {label: why} for peers that cannot run here;
    figures: see figures()."""
    peers = PEERS if peers is None else peers
    if isinstance(threads, int):
        threads = {label: {t: threads for t in tokens} for label in [OURS, *peers]}
    n_rounds = {t: (rounds or ROUNDS).get(t, min(ROUNDS.values())) for t in tokens}
    per_batch = {t: (calls or CALLS).get(t, 1) + 1 for t in tokens}  # time_calls' warm-up call, then the timed
    wanted = [p for p in peers if any(p in GOAL_PEERS[t] for t in tokens)]
    sides = [(OURS, _ktfp8_factory(backend), PC)] + [(p, peers[p], BF16) for p in wanted]
    takes_part = {label: [t for t in tokens if label == OURS or label in GOAL_PEERS[t]] for label, _, _ in sides}
    log(f"interleaved peers: T={','.join(f'{t} ({n_rounds[t]} rounds)' for t in tokens)}, "
        f"ktfp8 {backend} [{PC}] against {', '.join(wanted)} [{BF16}] in turn, threads "
        + "; ".join(f"{label} " + ", ".join(f"{threads[label][t]} at T={t}" for t in takes_part[label])
                    for label, _, _ in sides))
    with contextlib.ExitStack() as alive:
        walks, unavailable = {}, {}
        for label, factory, fmt in sides:  # one side's random weights at a time
            budget = min(walk_memory_bytes, available_memory() // (len(sides) + 1))
            try:
                # a pool of fixed size (kt-kernel) keeps the count of the largest T it takes part in
                walk = build_walk(factory, layer, L.random_experts(layer, fmt, seed=3),
                                  threads[label][max(takes_part[label])], max(tokens), walk_bytes, budget)
            except PeerUnavailable as why:
                if label == OURS:
                    raise
                unavailable[label] = str(why)
                log(f"interleaved peers: {label} unavailable: {why}")
                continue
            finally:
                gc.collect()
            alive.callback(walk.close)
            walks[label] = walk
        xs = {t: L.activations(layer, t, seed=3) for t in tokens}
        # fresh routing for every batch, as a forward's layers draw theirs
        draws = {label: {t: L.routing_rounds(layer, t, n_rounds[t] * per_batch[t], seed=3, copies=len(w.copies))
                         for t in tokens} for label, w in walks.items()}
        out = []
        for r in range(max(n_rounds.values())):
            labels = list(walks)
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            record = {}
            for t in (t for t in tokens if r < n_rounds[t]):
                in_turn = [label for label in order if t in takes_part[label]]
                start = r * per_batch[t]
                samples, used = {}, {}
                for label in in_turn:
                    walk = walks[label]
                    if not walk.threads_fixed:
                        walk.threads = threads[label][t]
                    used[label] = walk.threads
                    samples[label] = [s * 1e3 for s in time_calls(walk, xs[t], draws[label][t][start:start + per_batch[t]],
                                                                  math.inf)]
                record[str(t)] = dict(order=in_turn, threads=used, samples_ms=samples,
                                      ms={label: statistics.median(s) for label, s in samples.items()})
            out.append(record)
        names = {label: w.name for label, w in walks.items()}
        walk_bytes_of = {label: w.walk_bytes for label, w in walks.items()}
    gc.collect()
    result = dict(layer=layer.name, backend=backend, tokens=list(tokens),
                  calls={str(t): per_batch[t] - 1 for t in tokens}, n_rounds={str(t): n for t, n in n_rounds.items()},
                  names=names, walk_bytes=walk_bytes_of, unavailable=unavailable, rounds=out)
    result["figures"] = figures(result)
    return result


def figures(result):
    """{str(T): {peer label: {ratio, spread, ours_ms, peer_ms, ours_threads, peer_threads}}}: ratio
    the median over the rounds T took part in of the peer's ms over ktfp8's, spread the middle half of
    those ratios, the ms medians over the same rounds, the thread counts each side ran (the same in
    every round)."""
    out = {}
    for t in map(str, result["tokens"]):
        recs = [rec[t] for rec in result["rounds"] if t in rec]
        for label in GOAL_PEERS[int(t)]:
            if not recs or label not in recs[0]["ms"]:
                continue
            per_round = [rec["ms"][label] / rec["ms"][OURS] for rec in recs]
            out.setdefault(t, {})[label] = dict(
                ratio=statistics.median(per_round), spread=middle_half(per_round),
                ours_ms=statistics.median(rec["ms"][OURS] for rec in recs),
                peer_ms=statistics.median(rec["ms"][label] for rec in recs),
                ours_threads=recs[0]["threads"][OURS], peer_threads=recs[0]["threads"][label])
    return out
