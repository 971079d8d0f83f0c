"""Goals 2 and 3's comparisons with the peers, measured side by side: FP8 per-channel on the default
backend against PyTorch BF16 at T=64, and against kt-kernel's AMX BF16 and PyTorch BF16 at T=512.

The results table times each side minutes apart, and on an Intel Xeon VM with AMX the AMX unit's
speed changes from minute to minute (its resident tdpbf16ps loop at 2.2 or 1.0 TFLOP/s per core):
three --quick runs there put ktfp8 at T=512 at 1.83x, 3.57x and 1.33x kt-kernel's AMXBF16_MOE from
table rows.  Here each side walks its own copies of the layer (its own random weights: FP8
per-channel for ktfp8, BF16 for the peers), all alive together, and each round times a short batch
of calls of each side in turn, the order rotating from round to round, at each of the plan's thread
counts; a side's time in a round is that of its fastest count.  kt-kernel's worker pool is built for
one thread count, so it gets a walk per count, each with a pool of its own, all alive together (its
dispatcher thread busy-waits beside its workers, so on a 2-core VM a pool of 1 worker can be its
fastest, and a pool of all threads alone would flatter ktfp8).  Which count is fastest is decided
round by round, for every side, never from the table's rows: one --quick there had ktfp8's 2-thread
T=64 row slower than its 1-thread row (a slow minute), which would have put ktfp8 at 1 thread against
PyTorch at 2, and another built kt-kernel's pool of 1 from a table row where 2 threads took 110
against 102.6 ms, and put ktfp8 at 4.02x a pool that took 109 ms a call where pools of 2 took 80-100
in the other runs.  A goal figure is the median over rounds of that round's peer time over ktfp8's.
Each side's batch starts SETTLE_SECONDS after another side's (or another pool's) ended, past
kt-kernel's spinning workers."""
import contextlib
import gc
import math
import statistics
import time

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
# Pause between one side's batch and another's: kt-kernel's workers spin 50 ms after its last call
# (kt_kernel_peer.py), on the cores the next side then runs on.  On the Emerald Rapids Xeon VM (2
# cores) ktfp8's T=512 call took 54.75 ms right after a kt-kernel call and 34.30 ms 100 ms later
# (medians of 20): the side after kt-kernel in a round's order lost its first calls to the spin.
SETTLE_SECONDS = 0.1


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


def run(plan, layer, backend, log=print):
    """The step for a Plan on its thread counts, walks sized as the table's; {"skipped": reason} where
    it is left out."""
    reason = skip_reason(plan, layer, backend)
    if reason:
        log(f"interleaved peers skipped: {reason}")
        return {"skipped": reason}
    return measure(layer, backend, plan.threads, step_tokens(plan), plan.walk_bytes, plan.walk_memory_bytes,
                   log=log)


def takes_part(labels, tokens):
    """{label: [the T of `tokens` whose goals time that side]}."""
    return {label: [t for t in tokens if label == OURS or label in GOAL_PEERS[t]] for label in labels}


def measure(layer, backend, threads, tokens, walk_bytes, walk_memory_bytes, rounds=None, calls=None, peers=None,
            log=print):
    """ktfp8 `backend` on FP8 per-channel against the peers GOAL_PEERS names at each T of `tokens`
    (peers: {label: factory}, default PEERS).  `threads`: the thread counts (or one count) each side
    runs in every round; a side whose count is fixed when it is built (kt-kernel's pool) gets a walk
    per count (side_walks).  The result's rounds[r][str(T)] = {order, samples_ms: {label: {str(n):
    [...]}}, ms: {label: the median of its fastest count's batch}, threads: {label: that count}} for
    the T that take part in round r; names: {label: the side's name}; fixed_threads: {label: [the
    counts of its pools]} of the fixed sides; unavailable: {label: why} for peers that cannot run
    here; figures: see figures()."""
    peers = PEERS if peers is None else peers
    threads = sorted({threads} if isinstance(threads, int) else set(threads))
    n_rounds = {t: (rounds or ROUNDS).get(t, min(ROUNDS.values())) for t in tokens}
    per_batch = {t: (calls or CALLS).get(t, 1) + 1 for t in tokens}  # time_calls' warm-up call, then the timed
    wanted = [p for p in peers if any(p in GOAL_PEERS[t] for t in tokens)]
    sides = [(OURS, _ktfp8_factory(backend), PC)] + [(p, peers[p], BF16) for p in wanted]
    part = takes_part([label for label, _, _ in sides], tokens)
    log(f"interleaved peers: T={','.join(f'{t} ({n_rounds[t]} rounds)' for t in tokens)}, "
        f"ktfp8 {backend} [{PC}] against {', '.join(wanted)} [{BF16}] in turn, each at "
        f"{' and '.join(map(str, threads))} thread(s) (a side with a fixed pool: a pool per count)")
    with contextlib.ExitStack() as alive:
        walks, unavailable = {}, {}  # walks[label][n]: the walk that runs `label` at n threads
        for label, factory, fmt in sides:
            try:
                walks[label] = side_walks(factory, layer, fmt, threads, max(tokens), walk_bytes,
                                          walk_memory_bytes, len(sides) + 1, alive)
            except PeerUnavailable as why:
                if label == OURS:
                    raise
                unavailable[label] = str(why)
                log(f"interleaved peers: {label} unavailable: {why}")
        xs = {t: L.activations(layer, t, seed=3) for t in tokens}
        # fresh routing for every batch, as a forward's layers draw theirs
        draws = {label: {t: L.routing_rounds(layer, t, n_rounds[t] * len(threads) * per_batch[t], seed=3,
                                             copies=min(len(w.copies) for w in by_n.values())) for t in tokens}
                 for label, by_n in walks.items()}
        out, last_walk = [], None
        for r in range(max(n_rounds.values())):
            labels = list(walks)
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            record = {}
            for t in (t for t in tokens if r < n_rounds[t]):
                in_turn = [label for label in order if t in part[label]]
                samples = {}
                for label in in_turn:
                    samples[label] = {}
                    for i, n in enumerate(threads):
                        walk = walks[label][n]
                        if last_walk not in (None, walk):  # another side, or another pool of this one
                            time.sleep(SETTLE_SECONDS)
                        last_walk = walk
                        if not walk.threads_fixed:
                            walk.threads = n
                        start = (r * len(threads) + i) * per_batch[t]
                        batch = draws[label][t][start:start + per_batch[t]]
                        samples[label][str(n)] = [s * 1e3 for s in time_calls(walk, xs[t], batch, math.inf)]
                medians = {label: {n: statistics.median(v) for n, v in by_n.items()} for label, by_n in samples.items()}
                fastest = {label: min(by_n, key=by_n.get) for label, by_n in medians.items()}
                record[str(t)] = dict(order=in_turn, samples_ms=samples,
                                      threads={label: int(n) for label, n in fastest.items()},
                                      ms={label: medians[label][n] for label, n in fastest.items()})
            out.append(record)
        names = {label: by_n[threads[-1]].name for label, by_n in walks.items()}
        fixed = {label: threads for label, by_n in walks.items() if by_n[threads[-1]].threads_fixed}
        walk_bytes_of = {label: by_n[threads[-1]].walk_bytes for label, by_n in walks.items()}
    gc.collect()
    result = dict(layer=layer.name, backend=backend, threads=threads, fixed_threads=fixed, tokens=list(tokens),
                  calls={str(t): per_batch[t] - 1 for t in tokens}, n_rounds={str(t): n for t, n in n_rounds.items()},
                  names=names, walk_bytes=walk_bytes_of, unavailable=unavailable, rounds=out)
    result["figures"] = figures(result)
    return result


def side_walks(factory, layer, fmt, threads, max_tokens, walk_bytes, walk_memory_bytes, share, alive):
    """{n: Walk} for every count n of `threads`: one walk that runs at each of them, or, for a side
    whose count is fixed when it is built (kt-kernel's pool), one walk per count, each on a pool of
    its own and weights of its own.  Each walk is closed by the ExitStack `alive` and gets
    walk_memory_bytes, and at most 1 / share of the memory free when it is built."""
    def build(n):
        budget = min(walk_memory_bytes, available_memory() // share)
        try:  # one walk's random weights at a time
            walk = build_walk(factory, layer, L.random_experts(layer, fmt, seed=3), n, max_tokens, walk_bytes, budget)
        finally:
            gc.collect()
        alive.callback(walk.close)
        return walk
    most = build(threads[-1])
    if not most.threads_fixed:
        return {n: most for n in threads}
    return {**{n: build(n) for n in threads[:-1]}, threads[-1]: most}


def figures(result):
    """{str(T): {peer label: {ratio, spread, ours_ms, peer_ms, ours_threads, peer_threads}}}: ratio
    the median over the rounds T took part in of the peer's ms over ktfp8's, spread the middle half of
    those ratios, the ms medians over the same rounds, the thread counts each side was fastest at in
    some round (sorted)."""
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
                ours_threads=sorted({rec["threads"][OURS] for rec in recs}),
                peer_threads=sorted({rec["threads"][label] for rec in recs}))
    return out
