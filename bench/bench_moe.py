"""MoE decode and prefill, ktfp8 beside its peers on the same weights and routing:

    python -m pytest bench/bench_moe.py --benchmark-only [--bench-layers bench,deepseek-v3]

Layers: the benchmark layer (E=64, top-8, hidden 2048, intermediate 768; FP8 experts 302 MB >> L3) and
a DeepSeek-V3 slice (hidden 7168, intermediate 2048, top-8, as many experts as fit in a quarter of RAM
in BF16; the count is in the case id).  Formats: FP8 per-channel, FP8 block-wise, BF16.  Sides: every
usable ktfp8 backend, kt-kernel, PyTorch (BF16 loop, torch._scaled_mm FP8), NumPy FP32 - each skipped
with its reason where it cannot run.  T in {1, 4, 16} (decode) and {64, 512, 2048} (prefill); 1 thread
and all.  Each side walks distinct copies of the layer (4x L3 in all) with fresh routing per round, so
the active weights come from DRAM (ktfp8.bench.layers.routing_rounds).  The decode goals come from
test_decode_goals_interleaved, as in `python -m ktfp8.bench`.
The summary at the end prints the same tables as `python -m ktfp8.bench`."""
import dataclasses
import gc
import statistics

import pytest

import ktfp8
from ktfp8 import backends
from ktfp8.bench import interleaved
from ktfp8.bench import layers as L
from ktfp8.bench.run import (PEERS, REFERENCE_MAX_TOKENS, OracleCheck, Plan, _ktfp8_factory, build_walk,
                             result_row, too_slow)
from ktfp8.bench.sides import PeerUnavailable

TOKENS = [1, 4, 16, 64, 512, 2048]
MAX_CALL_SECONDS = 30.0  # a side whose call would take longer is skipped at larger T
_PLAN = Plan(layers=[], tokens=[], threads=[])  # only for its walk sizes (4x L3, memory-bounded)
THREADS = sorted({1, backends.usable_cores()})
SIDES = {fmt: [(f"ktfp8 {b}", _ktfp8_factory(b)) for b in ktfp8.available_backends()] + PEERS[fmt]
         for fmt in L.FORMATS}


def _cases(layer_names):
    for name in layer_names:
        for fmt in L.FORMATS:
            for label, _ in SIDES[fmt]:
                for threads in THREADS:
                    for T in TOKENS:
                        case_id = f"{name}-{fmt}-{label.replace(' ', '_')}-{threads}thr-T{T}"
                        yield pytest.param(name, fmt, label, threads, T, id=case_id)


def pytest_generate_tests(metafunc):
    if "layer_name" in metafunc.fixturenames:
        names = metafunc.config.getoption("bench_layers").split(",")
        metafunc.parametrize("layer_name, fmt, label, threads, T", list(_cases(names)))


class _Current:
    """The one layer's weights and the one side alive at a time (the DeepSeek-V3 slice is GBs)."""
    experts_key = side_key = experts = side = check = None
    unavailable, errors, last = {}, {}, {}


def _layer(name):
    return L.BENCH_LAYER if name == "bench" else L.deepseek_v3_slice()


def _side(layer_name, fmt, label, threads):
    cur = _Current
    if cur.side_key != (layer_name, fmt, label, threads):
        if cur.side is not None:
            cur.side.close()
        cur.side, cur.side_key = None, (layer_name, fmt, label, threads)
        if cur.experts_key != (layer_name, fmt):
            cur.experts = None
            gc.collect()
            cur.experts = L.random_experts(_layer(layer_name), fmt)
            cur.experts_key = (layer_name, fmt)
            cur.check = OracleCheck(_layer(layer_name), cur.experts)
        factory = dict(SIDES[fmt])[label]
        try:
            cur.side = build_walk(factory, _layer(layer_name), cur.experts, threads, max(TOKENS),
                                  _PLAN.walk_bytes, _PLAN.walk_memory_bytes)
            cur.errors[cur.side_key] = cur.check.error(cur.side)
        except PeerUnavailable as why:
            cur.unavailable[(layer_name, fmt, label, threads)] = str(why)
    reason = cur.unavailable.get((layer_name, fmt, label, threads))
    if reason:
        pytest.skip(f"{label} [{fmt}]: {reason}")
    return cur.side


def test_moe(benchmark, limits_by_threads, moe_rows, layer_name, fmt, label, threads, T):
    if label == "ktfp8 reference" and T > REFERENCE_MAX_TOKENS:
        pytest.skip(f"the portable reference is the scalar oracle: T <= {REFERENCE_MAX_TOKENS} only")
    layer = _layer(layer_name)
    side = _side(layer_name, fmt, label, threads)
    reason = too_slow(_Current.last.get(_Current.side_key), T, MAX_CALL_SECONDS)
    if reason:
        pytest.skip(f"{label} [{fmt}]: {reason}")
    x = L.activations(layer, T, seed=T)
    rounds = 20 if T <= 16 else 8 if T <= 64 else 3
    draws = iter(L.routing_rounds(layer, T, rounds + 1, seed=T, copies=len(side.copies)))
    used = []

    def setup():
        ids, w, copy = next(draws)
        used.append(ids)
        return (x, ids, w, copy), {}

    benchmark.pedantic(side, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    _Current.last[_Current.side_key] = (T, seconds)
    active = statistics.median(L.active_weight_bytes(layer, ids, side.format) for ids in used[1:])
    row = result_row(layer, side, threads, T, seconds, active, limits_by_threads(threads),
                     _Current.errors[_Current.side_key])
    benchmark.extra_info.update({k: v for k, v in row.items() if k not in ("layer",)})
    moe_rows.append(row)


def test_decode_goals_interleaved(benchmark, interleaved_results, request):
    """Goal 1's ratios -- FP8 per-channel against BF16 weights, against block-wise FP8 and against the
    read bandwidth -- from rounds that alternate a read probe with T=1 calls of each format on the
    benchmark layer (ktfp8.bench.interleaved): test_moe's rows are timed minutes apart.  Its benchmark
    time is the whole step's; the figures are in extra_info and in the summary's goal lines."""
    if "bench" not in request.config.getoption("bench_layers").split(","):
        pytest.skip("the benchmark layer is not in --bench-layers")
    default = backends.resolve_backend(None)
    plan = dataclasses.replace(_PLAN, layers=[L.BENCH_LAYER], tokens=[1], threads=THREADS, backends=[default])
    result = benchmark.pedantic(interleaved.run, args=(plan, L.BENCH_LAYER, default), rounds=1, iterations=1)
    if "skipped" in result:
        pytest.skip(result["skipped"])
    interleaved_results["result"] = result
    benchmark.extra_info["figures"] = result["figures"]
