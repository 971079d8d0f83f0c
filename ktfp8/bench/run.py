"""Runs every side on every layer, weight format, thread count and token count of a Plan, on the same
weights and routing, and collects medians, errors against a float64 oracle, and skip reasons."""
import contextlib
import dataclasses
import gc
import statistics
import time

import ml_dtypes
import numpy as np

from .. import backends, roofline
from . import layers as L
from .sides import Ktfp8Side, PeerUnavailable, Walk, available_memory, relative_error

CHECK_TOKENS = 4           # tokens of the call whose output is checked against the float64 oracle
REFERENCE_MAX_TOKENS = 4  # the scalar reference is timed at decode sizes only


@dataclasses.dataclass
class Plan:
    layers: list
    tokens: list
    threads: list
    formats: tuple = L.FORMATS
    backends: list = dataclasses.field(default_factory=backends.available_backends)
    # the formats the backends other than the default one are timed in (the default: every format)
    other_backend_formats: tuple = L.FORMATS
    peers: bool = True
    case_seconds: float = 20.0      # time budget of one (side, threads, T) case (see time_calls)
    max_call_seconds: float = 30.0  # a side whose call would take longer stops growing T
    read_buffer_bytes: int = 1 << 30
    # the copies of the layer each side walks total at least this many bytes (default: 4x L3) ...
    walk_bytes: int = dataclasses.field(default_factory=lambda: L.WALK_L3_MULTIPLE * (L.l3_bytes() or 0))
    # ... within this much memory for one side's copies (default: 4 GB, at most a third of what is free)
    walk_memory_bytes: int = dataclasses.field(default_factory=lambda: min(4 * 10**9, available_memory() // 3))

    def rounds(self, tokens):
        return 20 if tokens <= 16 else 8 if tokens <= 64 else 4


# A factory builds one copy of a side: factory(layer, experts, threads, max_tokens, first, index), with
# `first` the walk's copy 0 (None when building it; kt-kernel runs every copy on its pool) and `index`
# the copy's number.
def _ktfp8_factory(backend):
    def build(layer, experts, threads, max_tokens, first=None, index=0):
        return Ktfp8Side(layer, experts, backend, threads)
    return build


def _kt_kernel(layer, experts, threads, max_tokens, first=None, index=0):
    from .kt_kernel_peer import KtKernelMoE
    return KtKernelMoE(experts, layer.top_k, threads, max_tokens, pool=first, layer_idx=index)


def _torch_bf16(layer, experts, threads, max_tokens, first=None, index=0):
    from .torch_peers import TorchBF16MoE
    return TorchBF16MoE(layer, experts, threads)


def _torch_scaled_mm(layer, experts, threads, max_tokens, first=None, index=0):
    from .torch_peers import TorchScaledMMMoE
    return TorchScaledMMMoE(layer, experts, threads)


def _numpy_fp32(layer, experts, threads, max_tokens, first=None, index=0):
    from .numpy_peer import NumpyFP32MoE
    return NumpyFP32MoE(layer, experts, threads)


PEERS = {  # weight format -> (label, factory) of the peers that run it
    "fp8_per_channel": [("kt-kernel", _kt_kernel), ("torch._scaled_mm", _torch_scaled_mm), ("numpy fp32", _numpy_fp32)],
    "fp8_block": [("kt-kernel", _kt_kernel)],
    "bf16": [("kt-kernel", _kt_kernel), ("torch bf16", _torch_bf16)],
}


def oracle_forward(experts, x, topk_ids, topk_weights):
    """float64 MoE straight from the definition, one expert dequantized at a time (ml_dtypes decode)."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for e in np.unique(topk_ids):
        gate, up, down = (_dequantized(experts, name, e) for name in ("gate", "up", "down"))
        tok, slot = np.nonzero(topk_ids == e)
        g = x[tok] @ gate.T
        out[tok] += ((g / (1 + np.exp(-g)) * (x[tok] @ up.T)) @ down.T) * topk_weights[tok, slot, None]
    return out


def _dequantized(experts, name, e):
    w = getattr(experts, name)[e]
    if experts.format == "bf16":
        return w.view(ml_dtypes.bfloat16).astype(np.float64)
    values = w.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scale = getattr(experts, name + "_scale")[e].astype(np.float64)
    if experts.format == "fp8_per_channel":
        return values * scale.reshape(-1, 1)
    bn, bk = experts.block
    return values * np.repeat(np.repeat(scale, bn, 0), bk, 1)[:w.shape[0], :w.shape[1]]


class OracleCheck:
    """One small call (CHECK_TOKENS tokens) and its float64 oracle output, to measure every side's
    error on exactly the weights it is timed on."""

    def __init__(self, layer, experts):
        self.x = L.activations(layer, CHECK_TOKENS, seed=99)
        self.ids, self.w, _ = L.routing_rounds(layer, CHECK_TOKENS, 1, seed=99)[0]
        self.expected = oracle_forward(experts, self.x, self.ids, self.w)

    def error(self, side):
        return relative_error(side(self.x, self.ids, self.w), self.expected)


def build_walk(factory, layer, experts, threads, max_tokens, walk_bytes, walk_memory_bytes):
    """A Walk over as many copies of the side as L.copies_for() allows, each built on its own copy of
    `experts` (peers that view the weights rather than copy them need that)."""
    first = factory(layer, experts, threads, max_tokens)
    copy_bytes = layer.experts * layer.weights_per_expert * L.BYTES_PER_WEIGHT[first.format]
    sides = [first]
    try:
        for index in range(1, L.copies_for(walk_bytes, copy_bytes, walk_memory_bytes)):
            sides.append(factory(layer, L.copied(experts), threads, max_tokens, first, index))
    except BaseException:
        Walk(sides, 0).close()
        raise
    return Walk(sides, len(sides) * copy_bytes)


@contextlib.contextmanager
def walks_alive_together(builds, layer, threads, max_tokens, walk_bytes, walk_memory_bytes, share):
    """{key: Walk} for builds {key: (factory, experts)}, experts a function returning the weights it
    is built on (called in turn, so that only one key's random weights exist at a time); the walks
    are built one after another, stay alive together and are closed on exit.  Each gets
    walk_memory_bytes, and at most 1 / share of the memory free when it is built."""
    walks = {}
    try:
        for key, (factory, experts) in builds.items():
            budget = min(walk_memory_bytes, available_memory() // share)
            walks[key] = build_walk(factory, layer, experts(), threads, max_tokens, walk_bytes, budget)
            gc.collect()
        yield walks
    finally:
        for w in walks.values():
            w.close()
        walks.clear()
        gc.collect()


def result_row(layer, side, threads, tokens, seconds, active_bytes, limits, rel_err):
    """One measured case as the report, the JSON and the plot read it.  `limits`: the Roofline of
    this thread count as a dict; the roofline floor uses the peak of the side's compute unit."""
    limits = dataclasses.asdict(limits) if dataclasses.is_dataclass(limits) else limits
    unit = getattr(side, "compute_unit", None) or roofline.best_unit(limits)
    flops = layer.flops(tokens)
    memory_s, compute_s = roofline.floor_seconds(limits, active_bytes, flops, unit)
    peak = roofline.peak_gflops(limits, unit)
    gbs, tflops = active_bytes / seconds / 1e9, flops / seconds / 1e12
    return dict(layer=layer.name, side=side.name, kind=side.kind, format=side.format, threads=threads,
                tokens=tokens, ms=seconds * 1e3, active_bytes=active_bytes, flops=flops, gbs=gbs,
                bw_fraction=gbs / limits["read_gbs"], tflops=tflops,
                compute_unit=unit,
                peak_fraction=tflops * 1e3 / peak if peak else 0.0,
                memory_floor_ms=memory_s * 1e3, compute_floor_ms=compute_s * 1e3,
                roofline_fraction=max(memory_s, compute_s) / seconds, rel_err=rel_err,
                copies=len(getattr(side, "copies", [side])), walk_bytes=getattr(side, "walk_bytes", None))


def too_slow(last, tokens, max_call_seconds):
    """Why a call with `tokens` tokens is not worth timing, judged from the last (T, seconds) this
    side measured and assuming time grows linearly with T from there; None when it is."""
    if last is None:
        return None
    estimate = last[1] * tokens / last[0]
    if estimate <= max_call_seconds:
        return None
    return (f"about {estimate:.0f} s per call (extrapolated from {last[1]:.2f} s at T={last[0]}), over the "
            f"{max_call_seconds:.0f} s a case may take per call")


def time_calls(side, x, draws, budget_seconds):
    """Seconds of each timed call over fresh routing draws (each (topk_ids, topk_weights, copy) for a
    Walk): one warm-up call, then calls until the budget is spent, at least 3 of them unless the
    warm-up alone took a third of the budget."""
    t0 = time.perf_counter()
    side(x, *draws[0])
    warm = time.perf_counter() - t0
    min_calls = 3 if warm < budget_seconds / 3 else 1
    samples = []
    t_end = time.perf_counter() + budget_seconds
    for draw in draws[1:]:
        t0 = time.perf_counter()
        side(x, *draw)
        samples.append(time.perf_counter() - t0)
        if len(samples) >= min_calls and time.perf_counter() > t_end:
            break
    return samples


# Passes over every thread count's limits before the table, each figure keeping its best: one pass
# on this VM once read a 2-thread FMA peak of 95 GFLOP/s (182 in other minutes), which put the
# table's T=64 rows above 100 % of the peak.
LIMIT_PASSES = 3


def measure_limits(thread_counts, read_buffer_bytes, log=print):
    """{threads: Roofline} for each thread count, every figure the best of LIMIT_PASSES readings
    (roofline.best_of: a lower reading is another tenant's load, not the machine).  The read probe
    covers read_buffer_bytes, or the interleaved probe's WALK_L3_MULTIPLE x the L3 where that is more:
    --quick's 256 MiB fit in the 300 MiB L3 of the Intel Xeon with AMX, where its passes after the
    first would have read the cache."""
    limits = {}
    nbytes = max(read_buffer_bytes, L.probe_bytes(0))
    for p in range(LIMIT_PASSES):
        for n in thread_counts:
            log(f"measuring this machine's limits with {n} thread(s) (pass {p + 1} of {LIMIT_PASSES}) ...")
            lim = roofline.measure(threads=n, nbytes=nbytes)
            limits[n] = roofline.best_of(limits[n], lim) if n in limits else lim
    return limits


class Runner:
    def __init__(self, plan, log=print):
        self.plan, self.log = plan, log
        self.results, self.skipped, self.limits, self.versions = [], [], {}, {}

    def run(self):
        self.limits = measure_limits(self.plan.threads, self.plan.read_buffer_bytes, self.log)
        for layer in self.plan.layers:
            for fmt in self.plan.formats:
                self._run_format(layer, fmt)
        return self

    def _sides(self, fmt):
        """(label, factory) of every side timed in fmt, and {label: why not} of the ktfp8 backends left out."""
        default = backends.resolve_backend(None)
        timed = [b for b in self.plan.backends if b == default or fmt in self.plan.other_backend_formats]
        left = {f"ktfp8 {b}": f"backends other than the default ({default}) are timed in "
                              f"{', '.join(self.plan.other_backend_formats)} only (--quick; --formats times them all)"
                for b in self.plan.backends if b not in timed}
        return [(f"ktfp8 {b}", _ktfp8_factory(b)) for b in timed] + (PEERS[fmt] if self.plan.peers else []), left

    def _run_format(self, layer, fmt):
        self.log(f"{layer.name}, {fmt}: drawing random experts ...")
        experts = L.random_experts(layer, fmt)
        check = OracleCheck(layer, experts)
        sides, left = self._sides(fmt)
        for label, reason in left.items():
            self._skip(layer, label, fmt, reason)
        for label, factory in sides:
            tokens = self.plan.tokens
            if label == "ktfp8 reference" and max(tokens) > REFERENCE_MAX_TOKENS:
                tokens = [t for t in tokens if t <= REFERENCE_MAX_TOKENS]
                self._skip(layer, label, fmt, f"the portable reference is the scalar oracle: timed at T <= "
                                              f"{REFERENCE_MAX_TOKENS} only")
                if not tokens:
                    continue
            self._run_walks(layer, label, factory, fmt, experts, check, tokens)
        del experts
        gc.collect()

    def _run_walks(self, layer, label, factory, fmt, experts, check, tokens):
        """One side at every thread count: one Walk re-threaded, or one per thread count where the
        side runs only the thread count it was built for (kt-kernel's pool)."""
        walk, refused = None, False
        try:
            for threads in self.plan.threads:
                if walk is not None and not walk.threads_fixed:
                    walk.threads = threads
                else:
                    if walk is not None:
                        walk.close()
                        walk = None
                        gc.collect()
                    try:
                        walk = build_walk(factory, layer, experts, threads, max(tokens + [CHECK_TOKENS]),
                                          self.plan.walk_bytes, self.plan.walk_memory_bytes)
                    except PeerUnavailable as why:
                        if not refused:  # one line per side; a later thread count failing alone says which
                            first = threads == self.plan.threads[0]
                            self._skip(layer, label, fmt, str(why) if first else f"{threads} thread(s): {why}")
                        refused = True
                        continue
                    self.log(f"  {walk.name} [{walk.format}]: walking {len(walk.copies)} cop"
                             f"{'y' if len(walk.copies) == 1 else 'ies'} of the layer, {walk.walk_bytes / 1e6:.0f} MB"
                             f" (L3 {(L.l3_bytes() or 0) / 2**20:.0f} MiB)")
                self._run_side(layer, walk, threads, tokens, check.error(walk))
        finally:
            if walk is not None:
                walk.close()
                gc.collect()

    def _run_side(self, layer, side, threads, tokens, rel_err):
        self.versions[side.name] = side.version
        last = None
        for T in tokens:
            reason = too_slow(last, T, self.plan.max_call_seconds)
            if reason:
                self._skip(layer, side.name, side.format, f"{threads} thread(s), T >= {T}: {reason}")
                break
            x = L.activations(layer, T, seed=T)
            draws = L.routing_rounds(layer, T, self.plan.rounds(T) + 1, seed=T, copies=len(side.copies))
            samples = time_calls(side, x, draws, self.plan.case_seconds)
            seconds = statistics.median(samples)
            last = (T, seconds)
            active = statistics.median(L.active_weight_bytes(layer, ids, side.format) for ids, _, _ in draws[1:])
            row = result_row(layer, side, threads, T, seconds, active, self.limits[threads], rel_err)
            row["samples_ms"] = [s * 1e3 for s in samples]
            self.results.append(row)
            self.log(f"  {side.name:28s} {side.format:15s} threads {threads} T={T:5d}: {row['ms']:9.2f} ms "
                     f"{row['gbs']:6.1f} GB/s {row['tflops']:6.3f} TFLOP/s (err {rel_err:.1e})")

    def _skip(self, layer, label, fmt, reason):
        self.skipped.append(dict(layer=layer.name, side=label, format=fmt, reason=reason))
        self.log(f"  skipped {label} ({fmt}): {reason}")
