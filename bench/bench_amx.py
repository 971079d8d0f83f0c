"""Prefill on AMX tiles vs the avx512_bf16 micro-kernel: T = 512 on the benchmark layer of
ktfp8.bench.layers (E=64, top-8, hidden 2048, intermediate 768; about 64 tokens per active expert, so
every weight tile runs on the tile path).  The amx case records the speed-up over avx512_bf16
measured in the same run (extra_info amx_speedup, and a printed line with -s).

Needs native `amx` (AMX-TILE + AMX-BF16, and the OS granting tile state); elsewhere every case is
skipped with the reason.  `amx_emulated` is never timed: a scalar emulator's speed means nothing.
Run: pytest bench/bench_amx.py --benchmark-only -s"""
import pytest

from ktfp8 import backends
from ktfp8.bench import layers as L
from ktfp8.moe import MoE

T = 512
_MEDIANS = {}  # (backend, fmt) -> median seconds


def why_not_amx():
    """None when native amx runs here, else the reason."""
    if "amx" in backends.usable_variants():
        return None
    if "amx" not in backends.compiled_variants():
        return "native amx is not compiled in this build (compiler without -mamx-tile/-mamx-bf16, or KTFP8_ENABLE_AMX=OFF)"
    f = backends.cpu_features()
    missing = [n for n in ("amx_tile", "amx_bf16", "avx512_bf16", "avx512_vbmi", "os_amx") if not f.get(n)]
    if missing:
        return f"this CPU/OS lacks {', '.join(missing)} ({f.get('brand') or f.get('vendor')})"
    return "the OS refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"


_EXPERTS = {}


def _experts(fmt):
    if fmt not in _EXPERTS:
        _EXPERTS.clear()  # one format's weights at a time keeps memory bounded
        _EXPERTS[fmt] = L.random_experts(L.BENCH_LAYER, fmt)
    return _EXPERTS[fmt]


@pytest.mark.parametrize("fmt", ["fp8_per_channel", "fp8_block", "bf16"])
@pytest.mark.parametrize("backend", ["avx512_bf16", "amx"])  # avx512_bf16 first: amx reports the ratio
def test_amx_prefill(benchmark, backend, fmt):
    reason = why_not_amx()
    if reason:
        print(f"bench_amx: skipped: {reason}")
        pytest.skip(reason)
    layer = L.BENCH_LAYER
    moe = MoE(layer.config(fmt), _experts(fmt), backend=backend)
    x = L.activations(layer, T)
    draws = iter(L.routing_rounds(layer, T, 6))

    def setup():  # fresh routing every round, as bench_moe does (one copy of the layer: compute-bound)
        ids, w, _ = next(draws)
        return (x, ids, w), {}

    benchmark.pedantic(moe, setup=setup, rounds=5, iterations=1, warmup_rounds=1)
    _MEDIANS[(backend, fmt)] = benchmark.stats.stats.median
    benchmark.extra_info["ms"] = _MEDIANS[(backend, fmt)] * 1e3
    if backend == "amx" and ("avx512_bf16", fmt) in _MEDIANS:
        speedup = _MEDIANS[("avx512_bf16", fmt)] / _MEDIANS[("amx", fmt)]
        benchmark.extra_info["amx_speedup"] = speedup
        print(f"\nbench_amx: {fmt} T={T}: amx {speedup:.2f}x the speed of avx512_bf16")
