"""The benchmark suite's own correctness: workloads, the peers' arithmetic, the figures it derives,
and `python -m ktfp8.bench` end to end on a tiny layer (speed itself is measured in bench/, not here)."""
import io
import json
import os
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8.bench import layers as L
from ktfp8.bench import report
from ktfp8 import roofline
from ktfp8._native import _ext
from ktfp8.moe import native_shape
from ktfp8.bench.run import oracle_forward, result_row
from ktfp8.bench.sides import Ktfp8Side, PeerUnavailable, check_fits, relative_error
from moe_oracle import make_experts, moe_fp64, random_routing

TINY = L.Layer("tiny", 8, 2, 64, 32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_deepseek_v3_slice_fits_a_quarter_of_ram_in_bf16():
    ram = 24 * 2**30
    layer = L.deepseek_v3_slice(ram)
    assert (layer.hidden, layer.intermediate, layer.top_k) == (7168, 2048, 8)
    bf16_bytes = layer.experts * 3 * 7168 * 2048 * 2
    assert bf16_bytes <= ram / 4 < bf16_bytes + 3 * 7168 * 2048 * 2
    assert f"E={layer.experts}" in layer.name


@pytest.mark.parametrize("copies", [1, 3])
def test_routing_walks_the_copies_and_rereads_an_expert_only_after_the_whole_walk(copies):
    layer = L.BENCH_LAYER  # 64 experts, top-8
    for T, pools in ((1, 8), (4, 2), (16, 1)):
        draws = L.routing_rounds(layer, T, 3 * pools * copies, seed=1, copies=copies)
        assert [c for _, _, c in draws] == [r % copies for r in range(len(draws))]
        last, seen = {}, set()
        for r, (ids, w, copy) in enumerate(draws):
            assert ids.shape == (T, layer.top_k) and all(len(set(row)) == layer.top_k for row in ids)
            np.testing.assert_allclose(w.sum(axis=1), 1, rtol=1e-6)
            for e in set(ids.ravel().tolist()):
                assert r - last.get((copy, e), -pools * copies) >= pools * copies, (T, r, copy, e)
                last[(copy, e)] = r
                seen.add((copy, e))
        if T == 1:  # one walk over the pools reads every expert of every copy
            assert seen == {(c, e) for c in range(copies) for e in range(layer.experts)}
    # every expert active: draws from all of them, no artificial concentration of tokens per expert
    big = L.routing_rounds(layer, 64, 2, seed=1)
    assert len(np.unique(big[0][0])) > layer.experts // 2


def test_walk_copies_cover_the_target_within_memory_and_the_cap():
    xeon_walk = 4 * 300 * 2**20  # 4x the 300 MiB L3 of the AMX machine
    assert L.copies_for(xeon_walk, 302e6, 6e9) == 5     # the benchmark layer in FP8
    assert L.copies_for(xeon_walk, 604e6, 6e9) == 3     # ... and in BF16
    assert L.copies_for(4 * 32 * 2**20, 302e6, 6e9) == 1  # a 32 MiB L3: one copy is already 2.3x the walk
    assert L.copies_for(4e9, 1e9, 2.5e9) == 2            # bounded by memory
    assert L.copies_for(1e12, 1e3, 1e12) == L.MAX_COPIES
    assert L.copies_for(1e9, 1e10, 1e9) == 1             # never zero
    assert L._size_bytes("32768K") == 32 * 2**20 and L._size_bytes("300M") == 300 * 2**20
    l3 = L.l3_bytes()
    assert l3 is None or l3 >= 2**20


@pytest.mark.parametrize("l3_mib, read_mib", [(300, 1200), (32, 256), (None, 256)])
def test_the_tables_read_probe_covers_four_times_the_l3(monkeypatch, l3_mib, read_mib):
    """--quick's 256 MiB probe buffer, grown to 4x the L3 where that is more (the Xeon's 300 MiB)."""
    from ktfp8.bench import run
    monkeypatch.setattr(L, "l3_bytes", lambda: l3_mib and l3_mib << 20)
    probed = []
    monkeypatch.setattr(roofline, "measure", lambda threads, nbytes: probed.append(nbytes) or f"limits {nbytes}")
    monkeypatch.setattr(roofline, "best_of", lambda a, b: b)
    assert run.measure_limits([1, 2], 256 << 20, log=lambda msg: None) == {n: f"limits {read_mib << 20}"
                                                                            for n in (1, 2)}
    assert probed == [read_mib << 20] * (2 * run.LIMIT_PASSES)


@pytest.mark.parametrize("fmt", ["fp8_per_channel", "bf16"])
def test_copied_experts_hold_the_same_values_in_memory_of_their_own(fmt):
    w = L.random_experts(TINY, fmt)
    c = L.copied(w)
    for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"):
        a, b = getattr(w, name), getattr(c, name)
        if a is None:
            assert b is None
            continue
        assert not np.shares_memory(a, b)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    assert c.format == w.format and c.block == w.block


@pytest.mark.parametrize("fmt", L.FORMATS)
def test_random_experts_are_finite_and_sized_as_the_layer(fmt):
    w = L.random_experts(TINY, fmt)
    assert w.gate.shape == (8, 32, 64) and w.down.shape == (8, 64, 32)
    if fmt != "bf16":
        assert np.isfinite(w.gate.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).all()
    else:
        assert np.isfinite(w.gate.astype(np.float32)).all()


@pytest.mark.parametrize("fmt", L.FORMATS)
@pytest.mark.parametrize("hidden, intermediate", [(1, 1), (70, 33), (64, 32), (300, 129)])
def test_packed_bytes_are_what_the_largest_packer_packs(fmt, hidden, intermediate):
    """The memory check's packed size against MoE.nbytes of the layer packed by every usable backend
    (native or emulated): the padding of a tiny layer (1.7 KB an expert at H = I = 1) made a layer that
    passed a check on the drawn bytes end in a MemoryError traceback."""
    layer = L.Layer("odd", 2, 1, hidden, intermediate)
    experts = L.random_experts(layer, fmt)
    packed = [ktfp8.MoE(layer.config(fmt), experts, backend=b).nbytes for b in ktfp8.backends.usable_variants()]
    assert layer.packed_bytes(fmt) == max(packed)


def test_packed_size_refuses_an_invalid_shape():
    variant = ktfp8.backends.variant("reference")
    with pytest.raises(ValueError, match="invalid MoE shape"):
        _ext.packed_size(variant, native_shape(2, 0, 64, "fp8_per_channel"))
    # sizes whose byte count would wrap size_t: each below 2**31, at most 2**59 weights in all
    for experts, hidden, inter in [(2**31, 64, 64), (1, 2**31, 1), (2**29 + 1, 2**15, 2**15), (2**31 - 1,) * 3]:
        with pytest.raises(ValueError, match="at most 2\\*\\*59 weights"):
            _ext.packed_size(variant, native_shape(experts, hidden, inter, "bf16"))
    largest = _ext.packed_size(variant, native_shape(2**29, 2**15, 2**15, "bf16"))
    assert largest >= 3 * 2 * 2**59         # counted, not wrapped


def test_random_codes_are_distributed_as_a_quantized_gaussian():
    table = L.gaussian_code_table()
    v = table.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.isfinite(v).all() and (np.diff(v) >= 0).all() and np.abs(v).max() == 448.0
    sigma = 448.0 / L.GAUSSIAN_SIGMAS_AT_448
    assert v.std() == pytest.approx(sigma, rel=0.02) and abs(v.mean()) < 0.01 * sigma
    subnormal = np.mean((np.abs(v) > 0) & (np.abs(v) < 2.0 ** -6))
    assert 3e-5 < subnormal < 3e-4  # about 2 * 0.4 * 2^-6 / sigma of a Gaussian: real checkpoints' share


@pytest.mark.parametrize("fmt", L.FORMATS)
def test_bench_oracle_matches_the_test_oracle(fmt):
    experts, (gate, up, down) = make_experts(fmt, 6, 64, 32, seed=3)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    ids, w = random_routing(5, 6, 2, seed=4)
    np.testing.assert_allclose(oracle_forward(experts, x, ids, w), moe_fp64(x, ids, w, gate, up, down),
                               rtol=1e-10, atol=1e-12)


def _check(side, experts, tol):
    x = L.activations(TINY, 5, seed=2)
    ids, w, _ = L.routing_rounds(TINY, 5, 1, seed=2)[0]
    err = relative_error(side(x, ids, w), oracle_forward(experts, x, ids, w))
    assert err < tol, f"{side.name}: relative error {err:.2e}"
    return err


@pytest.mark.parametrize("fmt", L.FORMATS)
def test_ktfp8_side_matches_the_oracle_and_changes_threads(fmt):
    experts = L.random_experts(TINY, fmt)
    side = Ktfp8Side(TINY, experts, ktfp8.available_backends()[0], threads=1)
    _check(side, experts, 1e-2)
    side.threads = 2
    assert side.moe.threads == 2
    _check(side, experts, 1e-2)


def test_torch_bf16_peer_matches_the_oracle_without_copying_weights():
    torch = pytest.importorskip("torch")
    from ktfp8.bench.torch_peers import TorchBF16MoE
    experts = L.random_experts(TINY, "bf16")
    side = TorchBF16MoE(TINY, experts, threads=1)
    assert side.gate.data_ptr() == experts.gate.ctypes.data  # a view, not a copy
    assert side.gate.dtype == torch.bfloat16
    _check(side, experts, 2e-2)
    with pytest.raises(PeerUnavailable, match="bf16"):
        TorchBF16MoE(TINY, L.random_experts(TINY, "fp8_block"), threads=1)


def test_torch_scaled_mm_peer_matches_the_oracle_to_fp8_activation_precision():
    pytest.importorskip("torch")
    from ktfp8.bench.torch_peers import TorchScaledMMMoE
    experts = L.random_experts(TINY, "fp8_per_channel")
    try:
        side = TorchScaledMMMoE(TINY, experts, threads=1)
    except PeerUnavailable as why:
        pytest.skip(str(why))
    assert side.gate.data_ptr() == experts.gate.ctypes.data
    err = _check(side, experts, 0.15)  # activations are rounded to E4M3 (3 mantissa bits) twice
    assert err > 1e-4, "FP8 activations should cost visible precision; is _scaled_mm really used?"
    with pytest.raises(PeerUnavailable, match="per row"):
        TorchScaledMMMoE(TINY, L.random_experts(TINY, "fp8_block"), threads=1)


def test_numpy_peer_matches_the_oracle_and_refuses_what_would_not_fit(monkeypatch):
    pytest.importorskip("threadpoolctl")
    from ktfp8.bench import numpy_peer, sides
    experts = L.random_experts(TINY, "fp8_per_channel")
    side = numpy_peer.NumpyFP32MoE(TINY, experts, threads=1)
    _check(side, experts, 1e-5)
    # FP32 BLAS is held to the FP32 FMA peak of the widest vectors here, not to AMX or vdpbf16ps
    assert side.compute_unit == ("fma512" if ktfp8.backends.isa_levels()["avx512"][1] else "fma")
    limits = dict(read_gbs=10.0, fma_gflops=100.0, fma512_gflops=200.0, dpbf16_gflops=400.0, amx_gflops=3000.0)
    row = result_row(TINY, side, 1, 4, 1e-3, 1e6, limits, 0.0)
    assert row["compute_floor_ms"] == pytest.approx(TINY.flops(4) / (limits[roofline.UNIT_FIELDS[side.compute_unit]]
                                                                     * 1e9) * 1e3)
    monkeypatch.setattr(sides, "available_memory", lambda: 1 << 16)  # 64 KiB
    with pytest.raises(PeerUnavailable, match="more than half the memory"):
        numpy_peer.NumpyFP32MoE(TINY, experts, threads=1)
    with pytest.raises(PeerUnavailable, match="GB copy"):
        check_fits("x", 1 << 16)


def test_a_walk_short_of_four_l3s_is_flagged_as_read_partly_from_cache():
    """A walk capped by MAX_COPIES (a tiny layer) or by memory used to be reported as from DRAM: a
    3 MB walk printed 121-243 % of the read bandwidth with no word."""
    from ktfp8.bench import report
    l3_mib = 32
    target = L.WALK_L3_MULTIPLE * l3_mib * 2**20
    rows = [dict(layer="E=4", side="ktfp8 x", format=f, copies=c, walk_bytes=b)
            for f, c, b in (("bf16", 8, target - 1), ("fp8_block", 1, target))]
    short, enough = report.walk_lines(rows, l3_mib)
    assert short.startswith("weights walked in turn: E=4 [bf16]: 8 distinct copies") and \
        f"under 4x the {l3_mib} MiB L3: read partly from cache" in short
    assert enough.startswith("weights walked in turn: E=4 [fp8_block]: 1 distinct copy") and "cache" not in enough
    assert not any("cache" in line for line in report.walk_lines(rows, None))  # L3 unknown: no claim
    from ktfp8.bench import plot
    results = dict(machine=dict(cpu="CPU", l3_mib=l3_mib), results=rows)
    assert plot.title(results) == "CPU: each side at its best thread count; weights partly from cache (walks " \
                                  "under 4x the L3)"
    results["results"] = rows[1:]
    assert plot.title(results) == "CPU: each side at its best thread count; weights from DRAM"


def test_walk_builds_copies_on_memory_of_their_own_and_each_matches_the_oracle():
    pytest.importorskip("torch")
    from ktfp8.bench.run import _ktfp8_factory, _torch_bf16, build_walk
    bf16 = L.random_experts(TINY, "bf16")
    copy_bytes = 8 * 3 * 64 * 32 * 2
    walk = build_walk(_torch_bf16, TINY, bf16, 1, 8, walk_bytes=3 * copy_bytes - 1, walk_memory_bytes=1 << 30)
    assert len(walk.copies) == 3 and walk.walk_bytes == 3 * copy_bytes
    # the PyTorch side views its weights: each copy must view weights of its own
    assert len({side.gate.data_ptr() for side in walk.copies}) == 3
    x = L.activations(TINY, 5, seed=2)
    for ids, w, copy in L.routing_rounds(TINY, 5, 3, seed=2, copies=3):
        err = relative_error(walk(x, ids, w, copy), oracle_forward(bf16, x, ids, w))
        assert err < 2e-2
    walk.threads = 2
    assert all(side.threads == 2 for side in walk.copies)
    walk.close()
    fp8 = L.random_experts(TINY, "fp8_per_channel")
    walk = build_walk(_ktfp8_factory(ktfp8.available_backends()[0]), TINY, fp8, 1, 8, walk_bytes=1 << 40,
                      walk_memory_bytes=2 * copy_bytes)  # memory for 4 FP8 copies
    assert len(walk.copies) == 4 and walk.compute_unit == roofline.backend_unit(ktfp8.available_backends()[0])
    walk.close()


def test_amx_peak_probe_runs_its_tiles_right_under_the_emulation(tmp_path):
    """probe_amx.c compiled against include/ktfp8/amx_emulation.h: a wrong tile configuration would
    abort, wrong sums make it return 0, and it must count 4 TDPBF16PS of 16384 flops per iteration."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    main = tmp_path / "main.c"
    main.write_text("#include <stdio.h>\n#include <stdint.h>\n"
                    "double ktfp8_probe_tdpbf16_amx_emulated(int64_t, int);\n"
                    "int main(void) { printf(\"%.0f %.0f\\n\", ktfp8_probe_tdpbf16_amx_emulated(3, 2),"
                    " ktfp8_probe_tdpbf16_amx_emulated(1, 1)); return 0; }\n")
    exe = tmp_path / "probe"
    subprocess.run([cc, "-O1", "-std=gnu11", "-fopenmp", "-I", os.path.join(ROOT, "include"),
                    "-DKTFP8_EMULATE_AMX", "-DKTFP8_VARIANT=amx_emulated",
                    os.path.join(ROOT, "ktfp8", "_native", "probe_amx.c"), str(main), "-o", str(exe), "-lm"],
                   check=True, capture_output=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=60).stdout.split()
    assert [float(v) for v in out] == [3 * 4 * 16384 * 2, 1 * 4 * 16384 * 1]


class _Stub:
    """Just what result_row reads of a side."""

    def __init__(self, name, kind, fmt, unit=None):
        self.name, self.kind, self.format = name, kind, fmt
        if unit:
            self.compute_unit = unit


GOAL_LAYER = L.Layer("L", 64, 8, 2048, 768)
EXPERT_BYTES = 3 * 2048 * 768  # FP8: one byte per weight


def _limits(amx=None):
    return {"1": dict(threads=1, read_gbs=10.0, fma_gflops=100.0, dpbf16_gflops=None, amx_gflops=amx and amx / 2),
            "2": dict(threads=2, read_gbs=20.0, fma_gflops=200.0, dpbf16_gflops=None, amx_gflops=amx)}


def _row(side, fmt, T, ms, threads=2, kind=None, unit=None, limits=None):
    kind = kind or ("ktfp8" if side.startswith("ktfp8") else "peer")
    experts = min(T * 8, 64)  # the routing of these rows: T tokens on distinct experts, up to all 64
    active = experts * EXPERT_BYTES * L.BYTES_PER_WEIGHT[fmt]
    return result_row(GOAL_LAYER, _Stub(side, kind, fmt, unit), threads, T, ms / 1e3, active,
                      (limits or _limits())[str(threads)], 0.0)


def test_result_row_floors_use_the_sides_unit_and_the_rows_thread_count():
    r = _row("ktfp8 avx2", "fp8_per_channel", 512, 300.0, threads=1, unit="fma")
    flops = 2 * 512 * 8 * EXPERT_BYTES
    assert r["memory_floor_ms"] == pytest.approx(64 * EXPERT_BYTES / 10e9 * 1e3)
    assert r["compute_floor_ms"] == pytest.approx(flops / 100e9 * 1e3)
    assert r["roofline_fraction"] == pytest.approx(flops / 100e9 / 0.3)
    peer = _row("torch bf16 F.linear", "bf16", 512, 300.0, limits=_limits(amx=2000.0))
    assert peer["compute_unit"] == "amx"  # a peer is held to the fastest unit of the machine
    assert peer["compute_floor_ms"] == pytest.approx(flops / 2000e9 * 1e3)


def test_roofline_units():
    lim = _limits()["2"]
    assert roofline.backend_unit("amx") == "amx" and roofline.backend_unit("avx512_bf16") == "dpbf16"
    assert roofline.backend_unit("avx2") == "fma" and roofline.backend_unit("avx512") == "fma512"
    assert roofline.floor_seconds(lim, 2e9, 4e11, "fma") == pytest.approx((0.1, 2.0))
    assert roofline.peak_gflops(lim, "amx") == 200.0  # not measured here: the fastest unit that is
    assert roofline.best_unit(_limits(amx=1000.0)["2"]) == "amx"


def test_limits_keep_each_figures_best_reading():
    a = roofline.Roofline(threads=2, read_gbs=20.0, fma_gflops=95.0, dpbf16_gflops=None, amx_gflops=None,
                          fma512_gflops=None)
    b = roofline.Roofline(threads=2, read_gbs=18.0, fma_gflops=182.0, dpbf16_gflops=None, amx_gflops=None,
                          fma512_gflops=None)
    assert roofline.best_of(a, b) == roofline.Roofline(threads=2, read_gbs=20.0, fma_gflops=182.0, dpbf16_gflops=None)
    c = roofline.Roofline(threads=2, read_gbs=1.0, fma_gflops=1.0, dpbf16_gflops=50.0)
    assert roofline.best_of(b, c).dpbf16_gflops == 50.0 and roofline.best_of(c, b).read_gbs == 18.0


def test_goals_are_the_issues_four_on_the_default_backend():
    rows = [_row("ktfp8 avx2", "fp8_per_channel", 1, 2.0), _row("ktfp8 avx2", "fp8_per_channel", 1, 5.0, threads=1),
            _row("ktfp8 avx2", "bf16", 1, 3.0), _row("ktfp8 avx2", "fp8_block", 1, 2.0),
            _row("ktfp8 other", "fp8_per_channel", 1, 1.9),
            _row("ktfp8 avx2", "fp8_per_channel", 64, 20.0), _row("torch bf16 F.linear", "bf16", 64, 40.0),
            _row("ktfp8 avx2", "fp8_per_channel", 512, 300.0),
            _row("kt-kernel AVX2BF16_MOE", "bf16", 512, 1000.0), _row("torch bf16 F.linear", "bf16", 512, 600.0)]
    goals = report.goals(rows, _limits(), "L", "avx2", {"skipped": "T=1 is not in the plan (--tokens)"})
    measured = [(g["goal"], g["measured"], g["reached"]) for g in goals]
    # the decode goals come from the interleaved step alone (test_interleaved_...), never from the rows
    assert all(m[1:] == (None, None) and g["note"] == "T=1 is not in the plan (--tokens)"
               for m, g in zip(measured[:4], goals))
    assert "1 thread(s)" in goals[0]["goal"] and "2 thread(s)" in goals[1]["goal"]
    assert "BF16" in goals[2]["goal"] and "block-wise" in goals[3]["goal"]
    assert measured[4][1:] == (pytest.approx(20.0 / (64 * EXPERT_BYTES / 20e9 * 1e3)), True)  # 1.32x the floor
    assert measured[5][1:] == (pytest.approx(2.0), False)   # T=64 vs PyTorch: 40 / 20 < 2.5
    assert "no AMX" in goals[6]["goal"] and measured[6][1:] == (
        pytest.approx(2 * 512 * 8 * EXPERT_BYTES / 0.3 / 200e9), True)  # 64 % of the FMA peak
    assert measured[7][1:] == (None, None) and "AMXBF16_MOE unavailable" in goals[7]["note"]
    assert "AVX2BF16_MOE: 3.33x" in goals[7]["note"]
    assert measured[8][1:] == (pytest.approx(2.0), False)   # T=512 vs PyTorch: 600 / 300 < 3
    # the default choice comes from the interleaved backend step alone (test_backend_choice_...): the
    # faster "ktfp8 other" row does not count
    assert measured[9][1:] == (None, None) and goals[9]["note"] == "the backend step did not run"
    assert len(goals) == 10
    text = report.goals_lines(goals)
    assert "NOT reached" in text and "not measured" in text and "reached " in text and "<= 1.5x" in text
    # with AMX the prefill goal is the roofline: max(bytes / bandwidth, FLOPs / AMX peak)
    lim = _limits(amx=2000.0)
    amx_rows = [_row("ktfp8 amx", "fp8_per_channel", 512, 100.0, unit="amx", limits=lim)]
    g = [g for g in report.goals(amx_rows, lim, "L", "amx") if g["goal"].startswith("T=512: fraction")][0]
    floor_ms = max(64 * EXPERT_BYTES / 20e9, 2 * 512 * 8 * EXPERT_BYTES / 2000e12 * 1e3) * 1e3
    assert g["measured"] == pytest.approx(floor_ms / 100.0) and g["reached"] is False


@pytest.mark.parametrize("peak_gflops", [1000.0, 4000.0])
def test_t512_roofline_note_names_both_floors_and_the_probes_they_come_from(peak_gflops):
    """On an AMX machine the T=512 goal's floor is the memory floor in some minutes and the compute
    floor in others (a VM's tiles at half speed): the note gives both, with the probes' medians."""
    flops, active = 40e9, 1e9                # 1 GB at 100 GB/s: a 10 ms memory floor
    rec = {"2": dict(ms=40.0, read_gbs=100.0, peak_gflops=peak_gflops)}
    entry = dict(rounds=[rec], active_bytes=active, flops=flops, unit="amx", calls=1)
    res = {"rounds": [], "decode_skipped": "T=1 is not in the plan (--tokens)", "roofline": {"512": entry},
           "figures": {"roofline": {"512": dict(over_memory_floor=4.0, peak_fraction=None, roofline_fraction=0.5)}}}
    lim = _limits(amx=2000.0)
    g = next(g for g in report.goals([], lim, "L", "amx", res) if g["goal"].startswith("T=512: fraction"))
    compute_ms = flops / (peak_gflops * 1e9) * 1e3  # 40 ms or 10 ms against the 10 ms memory floor
    assert g["measured"] == 0.5
    assert f"40.00 ms vs floor {max(10.0, compute_ms):.2f} ms" in g["note"]
    assert "memory floor 10.00 ms at 100.0 GB/s" in g["note"]
    assert f"compute floor {compute_ms:.2f} ms at the {roofline.UNIT_NAMES['amx']} peak of {peak_gflops:.0f} GFLOP/s" \
        in g["note"]


def test_prefill_goal_names_the_peak_it_divides_by_on_an_amx_machine_with_another_default():
    """KTFP8_BACKEND=avx512_bf16 on an AMX machine: the roofline goal is drawn with the vdpbf16ps peak
    (the default's unit, as the rows and the interleaved step measure it) and used to say 'AMX peak'."""
    lim = {n: dict(v, dpbf16_gflops=4 * v["fma_gflops"]) for n, v in _limits(amx=2000.0).items()}
    rows = [_row("ktfp8 avx512_bf16", "fp8_per_channel", 512, 100.0, unit="dpbf16", limits=lim)]
    g = [g for g in report.goals(rows, lim, "L", "avx512_bf16") if g["goal"].startswith("T=512: fraction")][0]
    assert "AMX" not in g["goal"] and "vdpbf16ps" in g["goal"]
    floor_ms = max(64 * EXPERT_BYTES / 20e9, 2 * 512 * 8 * EXPERT_BYTES / 800e9) * 1e3
    assert g["measured"] == pytest.approx(floor_ms / 100.0)


def test_interleaved_decode_goals_are_medians_of_per_round_ratios_from_the_recorded_numbers():
    from ktfp8.bench import interleaved
    backend = ktfp8.available_backends()[0]
    res = interleaved.measure(TINY, backend, [1, 2], L.FORMATS, probe_bytes=1 << 20, walk_bytes=0,
                              walk_memory_bytes=1 << 30, rounds=3, calls=2, log=lambda msg: None)
    assert len(res["rounds"]) == 3 and res["copies"] == {f: 1 for f in L.FORMATS}
    active = {f: 2 * 3 * 64 * 32 * L.BYTES_PER_WEIGHT[f] for f in L.FORMATS}  # top-2 distinct experts
    assert res["active_bytes"] == active
    best = {f: [] for f in L.FORMATS}
    fraction = {"1": [], "2": []}
    for r, record in enumerate(res["rounds"]):
        assert set(record) == {"1", "2"}
        for n, by_n in record.items():
            assert by_n["read_gbs"] > 0
            # the formats' order rotates, so no format always runs right after the probe
            assert by_n["order"] == list(L.FORMATS[r:]) + list(L.FORMATS[:r])
            for f in L.FORMATS:
                assert len(by_n["samples_ms"][f]) == 2
                assert by_n["ms"][f] == pytest.approx(float(np.median(by_n["samples_ms"][f])))
            fraction[n].append(active["fp8_per_channel"] / (by_n["ms"]["fp8_per_channel"] * 1e6) / by_n["read_gbs"])
        for f in L.FORMATS:
            best[f].append(min(record[n]["ms"][f] for n in record))
    pc = np.array(best["fp8_per_channel"])
    fig = res["figures"]
    assert fig["fp8_vs_bf16"] == pytest.approx(float(np.median(np.array(best["bf16"]) / pc)))
    assert fig["pc_vs_block"] == pytest.approx(float(np.median(np.array(best["fp8_block"]) / pc)))
    assert fig["bw_fraction"] == {n: pytest.approx(float(np.median(v))) for n, v in fraction.items()}
    json.dumps(res)  # stored as is in bench-results.json
    goals = report.goals([], _limits(), "L", backend, res)
    assert [g["measured"] for g in goals[:4]] == [fig["bw_fraction"]["1"], fig["bw_fraction"]["2"],
                                                 fig["fp8_vs_bf16"], fig["pc_vs_block"]]
    text = report.goals_lines(goals[:4])
    assert text.count("interleaved: 3 rounds") == 4
    # a plan without bf16: FP8 against BF16 is not measured, and says why
    res = interleaved.measure(TINY, backend, [1], ("fp8_per_channel", "fp8_block"), probe_bytes=1 << 20,
                              walk_bytes=0, walk_memory_bytes=1 << 30, rounds=2, calls=1, log=lambda msg: None)
    goals = report.goals([], {"1": _limits()["1"]}, "L", backend, res)
    assert goals[1]["measured"] is None and "bf16 is not in the plan" in goals[1]["note"]
    assert goals[2]["measured"] == res["figures"]["pc_vs_block"] is not None
    assert "not measured decode T=1: FP8 per-channel faster than BF16" in report.goals_lines(goals)


def test_goal_lines_print_a_digit_more_where_rounding_would_show_the_target_itself():
    goals = [report._goal("ratio", "at_most", 1.0, 1.0019, ""), report._goal("met", "at_most", 1.0, 1.0, ""),
             report._goal("fraction", "fraction", 0.5, 0.4962, ""), report._goal("far", "speedup", 3.0, 2.371, "")]
    lines = report.goals_lines(goals).splitlines()[1:]
    assert lines[0].startswith("  NOT reached  ratio (target <= 1.0x): 1.002x")
    assert lines[1].startswith("  reached      met (target <= 1.0x): 1.00x")
    assert lines[2].startswith("  NOT reached  fraction (target >= 50%): 49.6%")
    assert lines[3].startswith("  NOT reached  far (target >= 3.0x): 2.37x")
    # as many digits as it takes (a helper's audit: 'NOT reached ... (target >= 85%): 85.0%')
    goals = [report._goal("bus", "fraction", 0.85, 0.8496, ""), report._goal("fp8", "speedup", 1.8, 1.79996, ""),
             report._goal("choice", "at_most", 1.0, 1.00004, "")]
    assert [line.split(": ", 1)[1].split()[0] for line in report.goals_lines(goals).splitlines()[1:]] == \
        ["84.96%", "1.79996x", "1.00004x"]


def test_goals_say_why_a_peer_or_a_token_count_was_not_timed():
    """With --no-peers, or a T not in --tokens, the notes said 'kt-kernel AMXBF16_MOE unavailable here' and
    'PyTorch BF16 not timed at T=64 (see skipped)' (a helper's audit)."""
    lim = _limits()
    rows = [_row("ktfp8 avx2", "fp8_per_channel", t, 10.0, limits=lim) for t in (64, 512)]
    notes = {g["goal"]: g["note"] for g in report.goals(rows, lim, "L", "avx2")}
    assert notes["T=512: faster than kt-kernel AMX BF16"] == \
        "kt-kernel AMXBF16_MOE not timed in this run (--no-peers, or not installed: see skipped)"
    assert notes["T=64: faster than PyTorch BF16"] == \
        "torch bf16 not timed in this run (--no-peers, or not installed: see skipped)"
    notes = {g["goal"]: g["note"] for g in report.goals(rows[1:], lim, "L", "avx2")}
    assert notes["T=64: faster than PyTorch BF16"] == "T=64 is not in this run's --tokens"


def test_interleaved_roofline_goals_are_medians_of_per_round_ratios_from_the_recorded_numbers():
    from ktfp8.bench import interleaved
    from ktfp8.bench.run import Plan
    backend = ktfp8.available_backends()[0]
    res = interleaved.measure(TINY, backend, [1, 2], ("fp8_per_channel",), probe_bytes=1 << 20, walk_bytes=0,
                              walk_memory_bytes=1 << 30, roof_tokens=(64, 512), rounds=0, roof_rounds=3,
                              roof_calls={64: 2, 512: 1}, log=lambda msg: None)
    assert res["rounds"] == [] and set(res["roofline"]) == {"64", "512"}
    unit = roofline.backend_unit(backend)
    probed = roofline.unit_peak(unit, 1, repeats=1) > 0
    for t, calls in ((64, 2), (512, 1)):
        entry = res["roofline"][str(t)]
        assert entry["unit"] == unit and entry["flops"] == 2 * t * 2 * 3 * 64 * 32  # top-2, 3 projections
        assert len(entry["rounds"]) == 3 and all(set(rec) == {"1", "2"} for rec in entry["rounds"])
        over, peak_frac, roof_frac = [], [], []
        for rec in entry["rounds"]:
            for by_n in rec.values():
                assert by_n["read_gbs"] > 0 and len(by_n["samples_ms"]) == calls
                assert (by_n["peak_gflops"] > 0) == probed  # 0.0: the unit's probe cannot run here
                assert by_n["ms"] == pytest.approx(float(np.median(by_n["samples_ms"])))
            seconds = min(v["ms"] for v in rec.values()) / 1e3
            memory_s = entry["active_bytes"] / (max(v["read_gbs"] for v in rec.values()) * 1e9)
            compute_s = entry["flops"] / (max(v["peak_gflops"] for v in rec.values()) * 1e9) if probed else 0.0
            over.append(seconds / memory_s)
            peak_frac.append(compute_s / seconds)
            roof_frac.append(max(memory_s, compute_s) / seconds)
        fig = res["figures"]["roofline"][str(t)]
        assert fig == {"over_memory_floor": pytest.approx(float(np.median(over))),
                       "peak_fraction": pytest.approx(float(np.median(peak_frac))) if probed else None,
                       "roofline_fraction": pytest.approx(float(np.median(roof_frac)))}
    json.dumps(res)  # stored as is in bench-results.json
    # goals 2 and 3 take these figures, not the rows'
    rows = [_row(f"ktfp8 {backend}", "fp8_per_channel", 64, 1.0), _row(f"ktfp8 {backend}", "fp8_per_channel", 512, 1.0)]
    goals = report.goals(rows, _limits(), "L", backend, res)
    memory, prefill = goals[4], goals[6]
    assert memory["goal"].startswith("T=64: time over the memory floor")
    assert memory["measured"] == res["figures"]["roofline"]["64"]["over_memory_floor"]
    assert "interleaved: 3 rounds" in memory["note"] and "2 T=64 calls" in memory["note"]
    entry = res["roofline"]["64"]  # the note also names the compute floor: whether 1.5x is reachable
    peak = float(np.median([max(v["peak_gflops"] for v in rec.values()) for rec in entry["rounds"]]))
    compute_ms = entry["flops"] / (peak * 1e9) * 1e3 if probed else 0.0
    assert f"compute floor {compute_ms:.2f} ms on the {roofline.UNIT_NAMES[unit]} peak" in memory["note"]
    assert prefill["measured"] == res["figures"]["roofline"]["512"]["peak_fraction"]
    assert "interleaved: 3 rounds" in prefill["note"]
    # a plan without T=1 still measures T=64, and the decode goals say why they are not measured
    plan = Plan(layers=[TINY], tokens=[64], threads=[1], backends=[backend], walk_bytes=0)
    res = interleaved.run(plan, TINY, backend, log=lambda msg: None)
    assert set(res["roofline"]) == {"64"} and len(res["roofline"]["64"]["rounds"]) == interleaved.ROOF_ROUNDS
    goals = report.goals([], {"1": _limits()["1"]}, "L", backend, res)
    assert [g["note"] for g in goals[:3]] == ["T=1 is not in the plan (--tokens)"] * 3
    assert goals[3]["measured"] == res["figures"]["roofline"]["64"]["over_memory_floor"]


@pytest.mark.parametrize("peak_gflops, out_of_reach", [(10.0, True), (1000.0, False)])
def test_t64_goal_says_when_the_compute_floor_alone_is_past_it(peak_gflops, out_of_reach):
    """T=64 at 1.5x the memory floor cannot be met where FLOPs / peak is already more than that (a
    fast minute of a VM's bus): the note says so, with the ratio of the two floors."""
    backend = ktfp8.available_backends()[0]
    unit = roofline.backend_unit(backend)
    flops, active = 4e9, 1e9                 # 1 GB at 100 GB/s: a 10 ms memory floor
    rec = {"2": dict(ms=50.0, read_gbs=100.0, peak_gflops=peak_gflops)}
    entry = dict(rounds=[rec], active_bytes=active, flops=flops, unit=unit, calls=3)
    res = {"rounds": [], "decode_skipped": "T=1 is not in the plan (--tokens)", "roofline": {"64": entry},
           "figures": {"roofline": {"64": dict(over_memory_floor=5.0, peak_fraction=None, roofline_fraction=None)}}}
    memory = next(g for g in report.goals([], _limits(), "L", backend, res) if g["goal"].startswith("T=64: time"))
    compute_ms = flops / (peak_gflops * 1e9) * 1e3  # 400 ms or 4 ms against the 10 ms memory floor
    assert f"compute floor {compute_ms:.2f} ms" in memory["note"]
    assert ("the compute floor alone is 40.00x the memory floor: out of reach for any kernel here"
            in memory["note"]) == out_of_reach
    assert ("out of reach" in memory["note"]) == out_of_reach


def test_backend_choice_goal_is_the_worst_median_of_per_round_ratios_from_the_recorded_numbers():
    from ktfp8.bench import backend_choice
    default = ktfp8.available_backends()[0]
    contenders = [default, "reference"]  # reference runs on every CPU: a second backend wherever CI runs
    res = backend_choice.measure(TINY, contenders, [1, 2], [1, 4], walk_bytes=0, walk_memory_bytes=1 << 30,
                                 rounds={1: 3, 4: 2}, calls={1: 2}, log=lambda msg: None)
    assert res["default"] == default and res["calls"] == {"1": 2, "4": 1} and len(res["rounds"]) == 3
    assert res["n_rounds"] == {"1": 3, "4": 2}
    ratios = {"1": [], "4": []}
    best = {(t, b): [] for t in ratios for b in contenders}
    for r, record in enumerate(res["rounds"]):
        assert set(record) == ({"1", "4"} if r < 2 else {"1"})  # T=4 takes part in the first two rounds
        for t, by_n in record.items():
            assert set(by_n) == {"1", "2"}
            for rec in by_n.values():
                # the backends' order rotates, so neither always runs first
                assert rec["order"] == contenders[r % 2:] + contenders[:r % 2]
                for b in contenders:
                    assert len(rec["samples_ms"][b]) == res["calls"][t]
                    assert rec["ms"][b] == pytest.approx(float(np.median(rec["samples_ms"][b])))
            for b in contenders:
                best[t, b].append(min(rec["ms"][b] for rec in by_n.values()))
            ratios[t].append(best[t, default][-1] / best[t, "reference"][-1])
    fig = res["figures"]
    assert fig["ratio"] == {t: {"reference": pytest.approx(float(np.median(v)))} for t, v in ratios.items()}
    worst_t = max(ratios, key=lambda t: fig["ratio"][t]["reference"])
    assert fig["worst"] == dict(tokens=int(worst_t), backend="reference", ratio=fig["ratio"][worst_t]["reference"],
                                spread=pytest.approx([float(np.percentile(ratios[worst_t], q)) for q in (25, 75)]),
                                default_ms=pytest.approx(float(np.median(best[worst_t, default]))),
                                backend_ms=pytest.approx(float(np.median(best[worst_t, "reference"]))))
    assert fig["worst"]["ratio"] < 1.0  # the SIMD default is faster than the scalar oracle at every T
    json.dumps(res)  # stored as is in bench-results.json
    goal = report.goals([], _limits(), "L", default, None, res)[-1]
    assert goal["goal"].startswith("default choice") and goal["measured"] == fig["worst"]["ratio"]
    assert goal["reached"] is True and "T=1 (3 rounds),4 (2 rounds)" in goal["note"]
    q1, q3 = fig["worst"]["spread"]
    assert f"worst T={worst_t} (middle half of its rounds {q1:.2f}x-{q3:.2f}x): {default}" in goal["note"]


def _renamed_torch_peer(name):
    """A factory of PyTorch BF16 sides that call themselves `name` (a kt-kernel build stand-in)."""
    from ktfp8.bench.run import _torch_bf16

    def build(layer, experts, threads, max_tokens, first=None, index=0):
        side = _torch_bf16(layer, experts, threads, max_tokens, first, index)
        side.name = name
        return side
    return build


def _fixed_pool_peer(name):
    """Like _renamed_torch_peer, but its thread count is fixed when built, as kt-kernel's pool is."""
    renamed = _renamed_torch_peer(name)

    def build(layer, experts, threads, max_tokens, first=None, index=0):
        side = renamed(layer, experts, threads, max_tokens, first, index)
        side.threads_fixed = True
        return side
    return build


def _unavailable_peer(layer, experts, threads, max_tokens, first=None, index=0):
    raise PeerUnavailable("kt_kernel cannot be imported: ModuleNotFoundError")


def test_peer_goals_are_medians_of_per_round_ratios_from_the_recorded_numbers():
    pytest.importorskip("torch")
    from ktfp8.bench import peer_rounds
    from ktfp8.bench.run import _torch_bf16
    default = ktfp8.available_backends()[0]
    peers = {"kt-kernel": _renamed_torch_peer("kt-kernel AMXBF16_MOE"), "torch bf16": _torch_bf16}
    res = peer_rounds.measure(TINY, default, 1, [64, 512], walk_bytes=0, walk_memory_bytes=1 << 30,
                              rounds={64: 3, 512: 2}, calls={64: 2}, peers=peers, log=lambda msg: None)
    assert res["calls"] == {"64": 2, "512": 1} and res["n_rounds"] == {"64": 3, "512": 2}
    assert res["names"] == {"ktfp8": f"ktfp8 {default}", "kt-kernel": "kt-kernel AMXBF16_MOE",
                            "torch bf16": "torch bf16 F.linear"} and res["unavailable"] == {}
    labels = ["ktfp8", "kt-kernel", "torch bf16"]
    ratios = {("64", "torch bf16"): [], ("512", "kt-kernel"): [], ("512", "torch bf16"): []}
    for r, record in enumerate(res["rounds"]):
        assert set(record) == ({"64", "512"} if r < 2 else {"64"})  # T=512 takes part in two rounds
        order = labels[r % 3:] + labels[:r % 3]  # the sides' order rotates, so none always runs first
        assert record["64"]["order"] == [x for x in order if x != "kt-kernel"]  # T=64's goal names PyTorch only
        for t, rec in record.items():
            for label, by_n in rec["samples_ms"].items():
                assert list(by_n) == ["1"] and len(by_n["1"]) == res["calls"][t]  # the one thread count asked
                assert rec["ms"][label] == pytest.approx(float(np.median(by_n["1"])))
            for label in rec["order"]:
                if label != "ktfp8":
                    ratios[t, label].append(rec["ms"][label] / rec["ms"]["ktfp8"])
    fig = res["figures"]
    for (t, label), values in ratios.items():
        assert fig[t][label]["ratio"] == pytest.approx(float(np.median(values)))
        assert fig[t][label]["spread"] == pytest.approx([float(np.percentile(values, q)) for q in (25, 75)])
    json.dumps(res)  # stored as is in bench-results.json
    goals = {g["goal"]: g for g in report.goals([], _limits(), "L", default, None, None, res)}
    g = goals["T=512: faster than kt-kernel AMX BF16"]
    assert g["measured"] == fig["512"]["kt-kernel"]["ratio"]
    assert "interleaved: 2 rounds alternating" in g["note"] and "each at its fastest of 1 thread(s)" in g["note"]
    assert goals["T=64: faster than PyTorch BF16"]["measured"] == fig["64"]["torch bf16"]["ratio"]
    assert goals["T=512: faster than PyTorch BF16"]["measured"] == fig["512"]["torch bf16"]["ratio"]


def test_peer_rounds_start_each_sides_batch_after_the_previous_side_has_settled(monkeypatch):
    """kt-kernel's workers spin after its calls on the cores the next side runs on: a batch of one
    side starts SETTLE_SECONDS after another side's batch ended, whatever the order."""
    pytest.importorskip("torch")
    from ktfp8.bench import peer_rounds
    default = ktfp8.available_backends()[0]
    batches = []  # (side name, start, end) of every batch, in the order they ran
    timed = peer_rounds.time_calls

    def recorded(walk, x, draws, budget):
        start = time.perf_counter()
        samples = timed(walk, x, draws, budget)
        batches.append((walk.name, start, time.perf_counter()))
        return samples
    monkeypatch.setattr(peer_rounds, "time_calls", recorded)
    peers = {"kt-kernel": _renamed_torch_peer("kt-kernel AMXBF16_MOE"), "torch bf16": _renamed_torch_peer("torch x")}
    peer_rounds.measure(TINY, default, [1, 2], [64, 512], walk_bytes=0, walk_memory_bytes=1 << 30,
                        rounds={64: 2, 512: 2}, calls={64: 1}, peers=peers, log=lambda msg: None)
    switches = [(a, b) for a, b in zip(batches, batches[1:]) if a[0] != b[0]]
    assert len(switches) >= 8  # 2 rounds at T=64 (2 sides) and at T=512 (3 sides)
    for (_, _, end), (_, start, _) in switches:
        assert start - end >= peer_rounds.SETTLE_SECONDS
    same = [b[1] - a[2] for a, b in zip(batches, batches[1:]) if a[0] == b[0]]  # one side's thread counts
    assert same and max(same) < peer_rounds.SETTLE_SECONDS


def test_peer_goals_say_which_kt_kernel_ran_and_fall_back_to_the_table_without_the_peer():
    pytest.importorskip("torch")
    from ktfp8.bench import peer_rounds
    default = ktfp8.available_backends()[0]
    other_build = peer_rounds.measure(TINY, default, 1, [512], walk_bytes=0, walk_memory_bytes=1 << 30,
                                      rounds={512: 1}, peers={"kt-kernel": _renamed_torch_peer("kt-kernel AVX2BF16_MOE")},
                                      log=lambda msg: None)
    g = [g for g in report.goals([], _limits(), "L", default, None, None, other_build)
         if g["goal"] == "T=512: faster than kt-kernel AMX BF16"][0]
    ratio = other_build["figures"]["512"]["kt-kernel"]["ratio"]
    assert g["measured"] is None and g["note"].startswith(
        f"kt-kernel AMXBF16_MOE unavailable here (its build here runs kt-kernel AVX2BF16_MOE: {ratio:.2f}x")
    missing = peer_rounds.measure(TINY, default, 1, [512], walk_bytes=0, walk_memory_bytes=1 << 30, rounds={512: 1},
                                  peers={"kt-kernel": _unavailable_peer}, log=lambda msg: None)
    assert missing["unavailable"] == {"kt-kernel": "kt_kernel cannot be imported: ModuleNotFoundError"}
    assert missing["figures"] == {} and missing["rounds"][0]["512"]["order"] == ["ktfp8"]
    # the table's rows decide where the step did not time the peer
    rows = [_row(f"ktfp8 {default}", "fp8_per_channel", 512, 100.0), _row("kt-kernel AMXBF16_MOE", "bf16", 512, 400.0)]
    g = [g for g in report.goals(rows, _limits(), "L", default, None, None, missing)
         if g["goal"] == "T=512: faster than kt-kernel AMX BF16"][0]
    assert g["measured"] == pytest.approx(4.0) and "400.00 ms" in g["note"]


def test_peer_rounds_time_each_side_at_every_thread_count_and_a_fixed_pool_per_count(monkeypatch):
    """A side whose thread count is fixed when built (kt-kernel's pool) gets a walk per count, each
    on a pool of its own, timed in every round like the others' counts; batches of two pools of one
    side start SETTLE_SECONDS apart, as those of two sides do."""
    pytest.importorskip("torch")
    from ktfp8.bench import peer_rounds
    from ktfp8.bench.run import _torch_bf16
    default = ktfp8.available_backends()[0]
    built, batches = [], []  # the thread count of every copy built; (walk, its threads, start, end) of every batch
    fixed = _fixed_pool_peer("kt-kernel AMXBF16_MOE")

    def pool(layer, experts, threads, max_tokens, first=None, index=0):
        built.append(threads)
        return fixed(layer, experts, threads, max_tokens, first, index)
    timed = peer_rounds.time_calls

    def recorded(walk, x, draws, budget):
        start = time.perf_counter()
        samples = timed(walk, x, draws, budget)
        batches.append((walk, walk.threads, start, time.perf_counter()))
        return samples
    monkeypatch.setattr(peer_rounds, "time_calls", recorded)
    peers = {"kt-kernel": pool, "torch bf16": _torch_bf16}
    res = peer_rounds.measure(TINY, default, [1, 2], [64, 512], walk_bytes=0, walk_memory_bytes=1 << 30,
                              rounds={64: 2, 512: 2}, calls={64: 2}, peers=peers, log=lambda msg: None)
    assert sorted(built) == [1, 2]  # walk_bytes 0: one copy in each walk
    assert res["threads"] == [1, 2] and res["fixed_threads"] == {"kt-kernel": [1, 2]}
    kt_walks = {id(w): n for w, n, _, _ in batches if w.name.startswith("kt-kernel")}
    assert sorted(kt_walks.values()) == [1, 2]  # two walks, one per pool
    for (a, _, _, end), (b, _, start, _) in zip(batches, batches[1:]):
        if a is not b:
            assert start - end >= peer_rounds.SETTLE_SECONDS
    for record in res["rounds"]:
        for t, rec in record.items():
            assert {label: list(by_n) for label, by_n in rec["samples_ms"].items()} == {
                label: ["1", "2"] for label in rec["order"]}
            for label, by_n in rec["samples_ms"].items():  # each side's time: its fastest count's batch
                medians = {int(n): float(np.median(v)) for n, v in by_n.items()}
                assert rec["ms"][label] == pytest.approx(min(medians.values()))
                assert medians[rec["threads"][label]] == pytest.approx(rec["ms"][label])
    fig = res["figures"]
    assert fig["512"]["kt-kernel"]["peer_threads"] == sorted({rec["512"]["threads"]["kt-kernel"]
                                                              for rec in res["rounds"]})
    assert fig["64"]["torch bf16"]["ours_threads"] == sorted({rec["64"]["threads"]["ktfp8"] for rec in res["rounds"]})
    goals = {g["goal"]: g for g in report.goals([], _limits(), "L", default, None, None, res)}
    note = goals["T=512: faster than kt-kernel AMX BF16"]["note"]
    assert ("each at its fastest of 1/2 thread(s) in the round; kt-kernel AMXBF16_MOE on a worker pool of its own "
            "at each count") in note
    assert "worker pool" not in goals["T=64: faster than PyTorch BF16"]["note"]


def test_peer_step_runs_the_plans_thread_counts(monkeypatch):
    from ktfp8.bench import peer_rounds
    from ktfp8.bench.run import Plan
    default = ktfp8.available_backends()[0]
    seen = {}
    monkeypatch.setattr(peer_rounds, "measure", lambda *args, **kw: seen.update(args=args, kw=kw))
    layer = L.Layer("L", 8, 2, 64, 32)
    peer_rounds.run(Plan(layers=[layer], tokens=[1, 64, 512], threads=[1, 2], backends=[default], walk_bytes=0),
                    layer, default, log=lambda msg: None)
    assert seen["args"][2] == [1, 2] and seen["args"][3] == [64, 512]  # every side tries both counts each round


def test_peer_step_is_skipped_with_its_reason():
    from ktfp8.bench import peer_rounds
    from ktfp8.bench.run import Plan
    default = ktfp8.available_backends()[0]
    plan = dict(layers=[TINY], tokens=[1, 64, 512], threads=[1], backends=[default], walk_bytes=0)
    for change, reason in ((dict(peers=False), "--no-peers"), (dict(layers=[]), "--layer"),
                           (dict(tokens=[1, 4]), "neither T=64 nor T=512"), (dict(backends=[]), "--backends"),
                           (dict(formats=("fp8_per_channel",)), "bf16 not in the plan (--formats)")):
        res = peer_rounds.run(Plan(**{**plan, **change}), TINY, default, log=lambda msg: None)
        assert reason in res["skipped"]


def test_backend_choice_spread_is_the_middle_half_of_the_rounds_and_one_round_its_own_value():
    from ktfp8.bench import backend_choice
    assert backend_choice.middle_half([1.03, 0.97, 1.01, 0.99, 1.05]) == pytest.approx([0.99, 1.03])
    assert backend_choice.middle_half([1.02]) == [1.02, 1.02]


def test_backend_choice_leaves_out_a_backend_the_table_found_3x_slower_or_did_not_time():
    from ktfp8.bench import backend_choice

    def row(side, t, ms, fmt="fp8_per_channel", layer=TINY.name):
        return dict(kind="ktfp8", side=f"ktfp8 {side}", format=fmt, layer=layer, tokens=t, ms=ms, threads=1)
    rows = [row("a", 1, 1.0), row("a", 4, 2.0), row("a", 16, 3.0), row("b", 1, 2.9), row("b", 4, 6.0),
            row("c", 1, 0.5), row("c", 4, 50.0, fmt="bf16"), row("c", 4, 60.0, layer="other"), row("b", 16, 9.5)]
    out = backend_choice.left_out(rows, TINY, ["a", "b", "c"], [1, 4, 16, 64])
    assert set(out) == {4, 16} and set(out[4]) == {"b", "c"} and set(out[16]) == {"b", "c"}
    assert "3.0x the default's 2.00 ms" in out[4]["b"] and "did not time it" in out[4]["c"]
    # no default row at T=64: nobody sits out there


def test_backend_choice_does_not_time_a_backend_at_the_t_it_sits_out():
    from ktfp8.bench import backend_choice
    default = ktfp8.available_backends()[0]
    contenders = [default, "reference"]
    left = {4: {"reference": "slow"}}
    res = backend_choice.measure(TINY, contenders, [1], [1, 4], walk_bytes=0, walk_memory_bytes=1 << 30,
                                 rounds={1: 2, 4: 2}, calls={1: 1}, left=left, log=lambda msg: None)
    for record in res["rounds"]:
        assert set(record["1"]["1"]["ms"]) == set(contenders)
        assert set(record["4"]["1"]["ms"]) == {default} and record["4"]["1"]["order"] == [default]
    assert res["left_out"] == {"4": {"reference": "slow"}}
    assert set(res["figures"]["ratio"]["4"]) == set() and set(res["figures"]["ratio"]["1"]) == {"reference"}
    assert res["figures"]["worst"]["tokens"] == 1
    goal = report.goals([], _limits(), "L", default, None, res)[-1]
    assert goal["measured"] == res["figures"]["worst"]["ratio"] and "reference sat T=4 out" in goal["note"]
    # every other backend sitting every T out: no figure, and the note says why
    res = backend_choice.measure(TINY, contenders, [1], [4], walk_bytes=0, walk_memory_bytes=1 << 30,
                                 rounds={4: 1}, left=left, log=lambda msg: None)
    goal = report.goals([], _limits(), "L", default, None, res)[-1]
    assert goal["measured"] is None and "no other backend in contention" in goal["note"]


@pytest.mark.parametrize("change, reason", [
    (dict(formats=("bf16",)), "fp8_per_channel is not in the plan"),
    (dict(backends=["avx512"]), "the default backend avx2 is not in the plan"),
    (dict(backends=["avx2"]), "only avx2 is in the plan"),
    (dict(layers=[TINY]), "is not in the plan (--layer)"),
])
def test_backend_choice_step_is_skipped_with_the_reason_when_the_plan_leaves_it_out(change, reason):
    from ktfp8.bench import backend_choice
    from ktfp8.bench.run import Plan
    plan = Plan(**{**dict(layers=[L.BENCH_LAYER], tokens=[1], threads=[1], backends=["avx2", "avx512"]), **change})
    result = backend_choice.run(plan, L.BENCH_LAYER, "avx2", log=lambda msg: None)
    assert reason in result["skipped"]
    goal = report.goals([], _limits(), "L", "avx2", None, result)[-1]
    assert goal["measured"] is None and goal["note"] == result["skipped"]


@pytest.mark.parametrize("change, reason", [
    (dict(tokens=[4]), "T=1 is not in the plan"),
    (dict(formats=("bf16",)), "fp8_per_channel is not in the plan"),
    (dict(backends=["reference"]), "is not in the plan (--backends)"),
    (dict(layers=[TINY]), "is not in the plan (--layer)"),
])
def test_interleaved_step_is_skipped_with_the_reason_when_the_plan_leaves_it_out(change, reason):
    from ktfp8.bench import interleaved
    from ktfp8.bench.run import Plan
    plan = Plan(**{**dict(layers=[L.BENCH_LAYER], tokens=[1], threads=[1], backends=["avx2"]), **change})
    result = interleaved.run(plan, L.BENCH_LAYER, "avx2", log=lambda msg: None)
    assert reason in result["skipped"]
    assert all(g["note"] == result["skipped"] for g in report.goals([], _limits(), "L", "avx2", result)[:4])


def test_speedups_pick_the_best_thread_count_of_each_side():
    rows = [_row("ktfp8 avx2", "fp8_per_channel", 1, 4.0, threads=1), _row("ktfp8 avx2", "fp8_per_channel", 1, 2.0),
            _row("ktfp8 avx2", "bf16", 1, 3.0), _row("kt-kernel AVX2FP8_MOE", "fp8_block", 1, 5.0, threads=1),
            _row("kt-kernel AVX2FP8_MOE", "fp8_block", 1, 9.0), _row("torch bf16 F.linear", "bf16", 1, 6.0),
            _row("numpy fp32 (dequantized)", "fp32", 1, 8.0)]
    ups = {s["peer"]: s for s in report.speedups(rows)}
    assert ups["torch bf16 F.linear"]["same_format"] == pytest.approx(2.0)       # 6 / 3
    assert ups["torch bf16 F.linear"]["fp8_per_channel"] == pytest.approx(3.0)   # 6 / 2
    assert ups["numpy fp32 (dequantized)"]["same_format"] == pytest.approx(4.0)  # vs fp8 per-channel
    assert ups["kt-kernel AVX2FP8_MOE"]["same_format"] is None                   # no ktfp8 fp8_block row
    assert ups["kt-kernel AVX2FP8_MOE"]["fp8_per_channel"] == pytest.approx(2.5)  # 5 (1 thr) / 2 (2 thr)


def _cli(tmp_path, *args):
    env = dict(os.environ, KTFP8_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "ktfp8.bench", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_cli_writes_json_text_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    run = _cli(tmp_path, "--quick", "--layer", "8,2,128,64", "--tokens", "1,4,32", "--threads", "1,2")
    assert run.returncode == 0, run.stderr
    res = json.loads((tmp_path / "bench-results.json").read_text())
    assert set(res["limits"]) == {"1", "2"}
    assert res["default_backend"] == ktfp8.available_backends()[0]
    rows = res["results"]
    layer = L.Layer("x", 8, 2, 128, 64)
    ours = [r for r in rows if r["kind"] == "ktfp8"]
    assert "ktfp8 reference" not in {r["side"] for r in ours} or ktfp8.available_backends() == ["reference"]
    # --quick: the default backend in every format, the others in FP8 per-channel only, saying so
    default = f"ktfp8 {res['default_backend']}"
    default_tokens = (1, 4) if default == "ktfp8 reference" else (1, 4, 32)  # REFERENCE_MAX_TOKENS
    assert {(r["format"], r["threads"], r["tokens"]) for r in ours if r["side"] == default} == {
        (f, n, t) for f in L.FORMATS for n in (1, 2) for t in default_tokens}
    others = {f"ktfp8 {b}" for b in res["plan"]["backends"]} - {default}
    assert res["plan"]["other_backend_formats"] == ["fp8_per_channel"]
    for side in others:
        assert {(r["format"], r["threads"], r["tokens"]) for r in ours if r["side"] == side} == {
            ("fp8_per_channel", n, t) for n in (1, 2) for t in (1, 4, 32)}
        assert {s["format"] for s in res["skipped"] if s["side"] == side} == {"fp8_block", "bf16"}
    for r in rows:
        lim = res["limits"][str(r["threads"])]
        assert r["tflops"] == pytest.approx(layer.flops(r["tokens"]) / (r["ms"] / 1e3) / 1e12, rel=1e-9)
        assert r["bw_fraction"] == pytest.approx(r["gbs"] / lim["read_gbs"])
        peak = lim[roofline.UNIT_FIELDS[r["compute_unit"]]]
        floor_s = max(r["active_bytes"] / (lim["read_gbs"] * 1e9), layer.flops(r["tokens"]) / (peak * 1e9))
        assert r["roofline_fraction"] == pytest.approx(floor_s / (r["ms"] / 1e3))
        assert r["ms"] == pytest.approx(float(np.median(r["samples_ms"])))
        # the tiny layer is far below 4x any L3: every side walks the most copies allowed
        assert r["copies"] == (L.MAX_COPIES if L.l3_bytes() else 1)
        assert r["walk_bytes"] == r["copies"] * 8 * 3 * 128 * 64 * L.BYTES_PER_WEIGHT[r["format"]]
    for r in ours:
        assert r["rel_err"] < 1e-2
    # every peer either ran or says why not
    peers_seen = {r["side"] for r in rows if r["kind"] == "peer"} | {s["side"] for s in res["skipped"]}
    assert any(p.startswith("kt-kernel") for p in peers_seen)
    assert all(s["reason"] for s in res["skipped"])
    # not the benchmark layer: the interleaved peer step says so (test_peer_goals_... run it)
    assert res["peer_rounds"] == {"skipped": f"the layer {L.BENCH_LAYER.name!r} is not in the plan (--layer)"}
    png = (tmp_path / "bench-results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    text = (tmp_path / "bench-results.txt").read_text()
    assert "microseconds per token" in text and "of-roof" in text and f"{rows[0]['copies']} distinct cop" in text
    assert f"ktfp8 {res['default_backend']} *" in text
    # ... and the tiny layer's walks say that they are read partly from cache (where the L3 is known)
    assert ("read partly from cache" in text) == bool(L.l3_bytes())
    # no goals on a layer other than the benchmark layer, and the text says why (they used to vanish)
    assert res["goals"] == [] and "goals: not judged, since they are set on the benchmark layer" in text
    assert "bench-results.json" in run.stdout


def test_cli_says_up_front_that_the_plot_needs_matplotlib(monkeypatch, capsys, tmp_path):
    from importlib import util
    from ktfp8.bench import __main__ as cli
    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["--out", str(tmp_path)])
    assert exit_.value.code == 2 and "pip install matplotlib, or pass --no-plot" in capsys.readouterr().err
    assert cli.parse_args(["--out", str(tmp_path), "--no-plot"]).no_plot


def test_all_threads_means_the_cores_this_process_may_use(monkeypatch, tmp_path):
    """Under taskset -c 0 on a 2-core machine the bench times 1 thread, not "2 threads" on one core."""
    import os
    from ktfp8 import backends
    from ktfp8.bench import __main__ as cli
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("KTFP8_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert backends.usable_cores() == 1 and backends.default_threads() == 1
    assert cli.make_plan(cli.parse_args(["--out", str(tmp_path), "--no-plot", "--quick"])).threads == [1]


@pytest.mark.parametrize("args, others", [
    (["--quick"], ("fp8_per_channel",)),                     # the format the default choice is judged in
    (["--quick", "--formats", "bf16,fp8_block"], ("bf16", "fp8_block")),  # asked for: every backend
    ([], L.FORMATS),
])
def test_quick_times_the_other_backends_in_fp8_per_channel_only(tmp_path, args, others):
    from ktfp8.bench import __main__ as cli
    plan = cli.make_plan(cli.parse_args(["--out", str(tmp_path), "--no-plot", *args]))
    assert plan.other_backend_formats == others


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "positive"),
    (["--tokens", "a,b"], "integers"),
    (["--formats", "int4"], "unknown format"),
    (["--backends", "no_such_isa"], "not usable here"),
    (["--layer", "8,9,64,32"], "top_k <= E"),
    (["--layer", "big"], "--layer takes"),
])
def test_cli_refuses_bad_arguments(tmp_path, args, message):
    r = _cli(tmp_path, *args)
    assert r.returncode == 2 and message in r.stderr
    assert not list(tmp_path.iterdir())


# seconds on the old code, which refused neither up front but ended in a MemoryError traceback
_SMALL = ["--quick", "--no-peers", "--no-plot", "--threads", "1", "--formats", "fp8_per_channel"]


@pytest.mark.parametrize("args, message", [
    (["--layer", "1000000,8,2048,768", "--tokens", "1"], "--layer: the weights of 'E=1000000 top-8 H=2048 I=768' take"),
    (["--layer", "4,2,64,32", "--tokens", "1,999999999"], "--tokens: the activations of a call of T=999999999 on"),
    # 300 MB of weights as drawn, 173 GB packed: tiles of 16 rows x 32 K (it passed, then a MemoryError)
    (["--layer", "100000000,8,1,1", "--tokens", "1"], "--layer: the weights of 'E=100000000 top-8 H=1 I=1' take"),
])
def test_cli_refuses_what_cannot_fit_in_memory_before_running(tmp_path, args, message):
    r = _cli(tmp_path, *_SMALL, *args)
    assert r.returncode == 2 and message in r.stderr and "more than the" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "measuring" not in r.stdout


@pytest.mark.parametrize("args, env, message", [
    (["--threads", f"1,{ktfp8.config.max_threads() + 1}"], {},
     f"--threads must be at most {ktfp8.config.max_threads()} (16 per CPU"),
    ([], {"KTFP8_BACKEND": "junk"}, "KTFP8_BACKEND='junk' is not compiled in this build; usable backends: "),
    (["--backends", ktfp8.available_backends()[0]], {"KTFP8_BACKEND": "junk"}, "KTFP8_BACKEND='junk' is not"),
])
def test_cli_refuses_too_many_threads_and_a_bad_backend_variable_before_running(tmp_path, args, env, message):
    """The old code took each, started measuring and ended in a ValueError traceback: --threads above
    max_threads() at the limits, $KTFP8_BACKEND in make_plan or (with --backends) after the limits."""
    argv = [sys.executable, "-m", "ktfp8.bench", "--out", str(tmp_path), *_SMALL, "--layer", "4,2,64,32",
            "--tokens", "1", *args]        # the last --threads wins; seconds, should a check be missing
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, **env), timeout=600)
    assert r.returncode == 2 and f"python -m ktfp8.bench: error: {message}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "measuring" not in r.stdout


def test_a_forced_emulated_default_is_timed(tmp_path, monkeypatch):
    """$KTFP8_BACKEND=avx512_emulated made it the default the table stars and the goals judge, but the
    bench timed only the usable native backends: no starred row, goals about a backend never timed."""
    from ktfp8 import backends
    from ktfp8.bench import __main__ as cli
    emulated = [b for b in backends.compiled_variants() if b.endswith("_emulated")]
    if not emulated:
        pytest.skip("built without the emulated variants (KTFP8_ENABLE_EMULATED=OFF)")
    monkeypatch.setenv("KTFP8_BACKEND", emulated[0])
    plan = cli.make_plan(cli.parse_args(["--out", str(tmp_path), "--no-plot", "--quick"]))
    assert plan.backends == [emulated[0]] + [b for b in ktfp8.available_backends() if b != "reference"]
    monkeypatch.delenv("KTFP8_BACKEND")
    assert cli.make_plan(cli.parse_args(["--out", str(tmp_path), "--no-plot"])).backends == \
        [b for b in ktfp8.available_backends() if b != "reference"]


def test_cli_times_a_repeated_format_backend_or_layer_once(tmp_path):
    """--formats bf16,bf16 (or a repeated backend or layer) used to time it twice: doubled rows in the
    JSON, one of them in the table."""
    from ktfp8.bench import __main__ as cli
    default = ktfp8.available_backends()[0]
    plan = cli.make_plan(cli.parse_args(["--out", str(tmp_path), "--no-plot", "--formats", "bf16,fp8_block,bf16",
                                         "--backends", f"{default},{default}", "--layer", "4,2,64,32",
                                         "--layer", "bench", "--layer", "4,2,64,32"]))
    assert plan.formats == ("bf16", "fp8_block") and plan.backends == [default]
    assert [layer.name for layer in plan.layers] == ["E=4 top-2 H=64 I=32", L.BENCH_LAYER.name]


_TINY = ["--quick", "--no-peers", "--layer", "4,2,64,32", "--tokens", "1", "--threads", "1",
         "--formats", "fp8_per_channel"]   # a few seconds, most of them the limits


def test_cli_interrupted_says_what_it_wrote_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    """Ctrl-C used to end in a KeyboardInterrupt traceback."""
    pytest.importorskip("matplotlib")
    from ktfp8.bench import __main__ as cli
    from ktfp8.bench import plot

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli.Runner, "run", interrupted)
    assert cli.main([*_TINY, "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err == f"python -m ktfp8.bench: interrupted; wrote nothing into {tmp_path}\n"
    assert not list(tmp_path.iterdir())
    monkeypatch.undo()
    monkeypatch.setattr(plot, "save", interrupted)       # while the plot is written, after the other two
    assert cli.main([*_TINY, "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err == (f"python -m ktfp8.bench: interrupted; wrote only bench-results.json, "
                                       f"bench-results.txt into {tmp_path}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-results.json", "bench-results.txt"]


def test_cli_that_cannot_write_its_results_at_the_end_prints_the_table_and_says_so(tmp_path, capsys):
    """A folder in --out's way (made during the run) ended minutes of measurements in an
    IsADirectoryError traceback, the table unprinted (a helper's audit)."""
    (tmp_path / "bench-results.txt").mkdir()
    assert cli_main([*_TINY, "--no-plot", "--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "goals (benchmark layer" in out or "side " in out
    assert err.startswith(f"python -m ktfp8.bench: error: cannot write into {tmp_path}: ")
    assert err.rstrip().endswith("; wrote only bench-results.json")


def test_tokens_per_expert_refuses_what_would_fail_after_the_limits(capsys, monkeypatch):
    """A thread count past the limit, an unusable $KTFP8_BACKEND and a layer or call larger than the
    memory ended in tracebacks after the limits were measured (a helper's audit); a tiny layer is
    mostly padding once packed, so its drawn bytes alone can fit where the packed ones do not."""
    from ktfp8.bench import tokens_per_expert as tpe
    for args, message in ((["--threads", "99999"], "--threads must be at most"),
                          (["--experts", "100000"], "the layer's weights take"),
                          (["--tokens", "100000000", "--experts", "2", "--hidden", "256", "--intermediate", "128"],
                           "--tokens: a call of m=100000000 takes")):
        with pytest.raises(SystemExit) as e:
            tpe.parse_args(args)
        assert e.value.code == 2, args
        assert message in capsys.readouterr().err, args
    tiny = ["--experts", "20000", "--hidden", "1", "--intermediate", "1", "--tokens", "1"]
    drawn = 20000 * 3
    monkeypatch.setattr(tpe, "available_memory", lambda: 100 * drawn)
    with pytest.raises(SystemExit):
        tpe.parse_args(tiny)
    assert "(as drawn and as packed)" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KTFP8_BACKEND", "bogus")
        with pytest.raises(SystemExit):
            tpe.parse_args([])


def test_model_cli_refuses_a_thread_count_torch_cannot_start():
    M = _model_cli()
    with pytest.raises(SystemExit) as e:
        M.main(["--threads", "99999"])
    assert e.value.code == 2


def cli_main(argv):
    from ktfp8.bench import __main__ as cli
    return cli.main(argv)


def test_cli_whose_reader_left_stops_quietly(tmp_path):
    """`python -m ktfp8.bench ... | head -1` used to end in a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as pipe:
        r = subprocess.run([sys.executable, "-m", "ktfp8.bench", *_TINY, "--no-plot", "--out", str(tmp_path)],
                           stdout=pipe, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 1 and r.stderr == ""
    assert not list(tmp_path.iterdir())


def test_cli_started_with_stdout_closed_says_so(tmp_path):
    """`>&-`: print() to a None sys.stdout drops the text, so the run went on and exited 0 having said
    nothing; it stops at its first line, as python -m ktfp8.cpu does."""
    r = subprocess.run([sys.executable, "-m", "ktfp8.bench", *_TINY, "--no-plot", "--out", str(tmp_path)],
                       stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=600, preexec_fn=lambda: os.close(1))
    assert r.returncode == 1
    assert r.stderr == "python -m ktfp8.bench: error: cannot write to standard output: it is closed\n"
    assert not list(tmp_path.iterdir())


def test_cli_refuses_a_missing_output_folder(tmp_path):
    r = _cli(tmp_path / "nope", "--no-peers")
    assert r.returncode == 2 and "not a folder" in r.stderr


def test_cli_refuses_an_output_folder_it_cannot_write_before_running(tmp_path):
    small_run = ["--no-peers", "--no-plot", "--layer", "4,2,64,32", "--tokens", "1", "--threads", "1",
                 "--formats", "fp8_per_channel"]   # seconds, should the check be missing
    r = _cli(tmp_path, *small_run, "--out", "/proc")   # the last --out wins; no file can be made there
    assert r.returncode == 2 and "cannot write into '/proc'" in r.stderr


def test_too_slow_extrapolates_linearly_from_the_last_measurement():
    from ktfp8.bench.run import too_slow
    assert too_slow(None, 2048, 30) is None
    assert too_slow((16, 0.1), 64, 30) is None        # about 0.4 s
    reason = too_slow((4, 0.5), 512, 30)              # about 64 s
    assert reason and "about 64 s" in reason and "T=4" in reason


def test_read_probe_reuses_a_given_buffer(monkeypatch):
    """read_bandwidth(buf=...) reads that buffer (a probe repeated every round allocates it once)."""
    buf = roofline.probe_buffer(1 << 20 | 100, threads=1)
    assert buf.nbytes == 1 << 20 and buf.ctypes.data % 64 == 0  # down to the probe's 128-byte step
    seen = []
    real = roofline._ext.probe_read
    monkeypatch.setattr(roofline._ext, "probe_read", lambda b, n, s: seen.append((b.ctypes.data, s)) or real(b, n, s))
    assert roofline.read_bandwidth(1, repeats=2, buf=buf) > 0
    assert seen == [(buf.ctypes.data, s) for s in roofline.READ_STREAMS] * 2  # the stream counts take turns
    for streams in (0, 65):
        with pytest.raises(ValueError, match="streams must be 1 .. 64"):
            real(buf, 1, streams)


def test_read_bandwidth_is_the_best_stream_count(monkeypatch):
    """One sequential stream a thread under-read the bus: the kernels' several streams read 104 % of
    it on an Emerald Rapids VM.  The probe reports the best stream count's median."""
    buf = roofline.probe_buffer(1 << 20, threads=1)
    seconds = {1: 4e-3, 4: 1e-3}   # one pass of each stream count, on a clock of the test's own
    now = [0.0]
    monkeypatch.setattr(roofline, "READ_STREAMS", (1, 4))
    monkeypatch.setattr(roofline._ext, "probe_read", lambda b, threads, streams: now.append(now.pop() + seconds[streams]))
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: now[0])
    assert roofline.read_bandwidth(1, repeats=3, buf=buf) == pytest.approx(buf.nbytes / 1e-3 / 1e9)


# ---------------------------------------------------------------- python -m ktfp8.bench.model
def _model_cli():
    """ktfp8.bench.model, whose main says first that it needs torch and transformers where they are missing."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ktfp8.bench import model
    return model


_FAKE_ROWS = ([{"side": "eager", "backend": None, "skipped": None, "prefill": 4.0, "decode": 0.5},
               {"side": "ktfp8", "backend": "avx2", "skipped": None, "prefill": 12.0, "decode": 2.0}],
              {"bf16": (8.0, 8.1), "ktfp8": (4.4, 9.2)})


@pytest.mark.parametrize("args, message", [
    (["--layers", "49"], "--layers: Qwen3-30B-A3B has 48 layers, got 49"),
    (["--vocab", "999999999"], "the model needs about 8200.7 GB, more than the"),
    (["--prompt-tokens", "4096"], "--prompt-tokens + --decode-tokens must be at most 4096"),
    (["--layers", "1", "--json", "/nonexistent/x.json"], "--json: '/nonexistent' does not exist"),
    (["--layers", "1", "--json", "/etc/hostname/x.json"], "--json: '/etc/hostname' is not a folder"),
    (["--layers", "1", "--json", "/"], "--json: '/' is a folder"),
])
def test_model_cli_refuses_before_building_the_model(monkeypatch, capsys, args, message):
    """Each used to fail after the model was built and measured (minutes): the --json path in open()
    at the very end, the rest in transformers or the OOM killer."""
    M = _model_cli()

    def built(*a, **k):
        raise AssertionError("the model was built")
    monkeypatch.setattr(M, "run", built)
    with pytest.raises(SystemExit) as exit_:
        M.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_model_cli_writes_the_json_before_the_table_and_stops_quietly_when_the_reader_left(tmp_path, monkeypatch,
                                                                                         capsys):
    """`... --json r.json | head -1` used to end in a BrokenPipeError traceback before the JSON, the
    only record of minutes of measurements, was written."""
    M = _model_cli()

    class ReaderLeft(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(M, "run", lambda *a: _FAKE_ROWS)
    monkeypatch.setattr(sys, "stdout", ReaderLeft())
    assert M.main(["--layers", "1", "--json", str(tmp_path / "r.json")]) == 1
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == _FAKE_ROWS[0]
    assert capsys.readouterr().err == ""
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_model_cli_with_stdout_closed_says_so(tmp_path, monkeypatch, capsys):
    """A closed stdout (sys.stdout None): the table was dropped without a word, exit 0."""
    M = _model_cli()
    monkeypatch.setattr(M, "run", lambda *a: _FAKE_ROWS)
    monkeypatch.setattr(sys, "stdout", None)
    assert M.main(["--layers", "1", "--json", str(tmp_path / "r.json")]) == 1
    assert "cannot write to standard output: it is closed" in capsys.readouterr().err
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == _FAKE_ROWS[0]


def test_model_cli_interrupted_is_one_line(monkeypatch, capsys):
    M = _model_cli()

    def interrupted(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(M, "run", interrupted)
    assert M.main(["--layers", "1"]) == 130
    assert capsys.readouterr().err == "python -m ktfp8.bench.model: interrupted\n"


def test_model_run_with_one_decode_token_has_no_decode_figure(monkeypatch):
    """--decode-tokens 1 used to end in KeyError: 'decode' (decode tokens/s counts the tokens after
    the first) after the model was built; now its decode figure is missing, printed as '-'."""
    M = _model_cli()
    import transformers
    config = transformers.Qwen3MoeConfig(vocab_size=16, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         num_experts=4, num_experts_per_tok=2)
    monkeypatch.setattr(M, "build_model", lambda layers, vocab: transformers.Qwen3MoeForCausalLM(config).eval())
    log = io.StringIO()
    rows, _ = M.run(layers=1, threads=1, prompt_tokens=4, decode_tokens=1, repeats=1, vocab_size=16,
                    sides=("eager", "ktfp8"), log=log)
    assert [r.get("decode") for r in rows] == [None, None] and all(r["prefill"] > 0 for r in rows)
    assert "eager: prefill " in log.getvalue() and "decode - tokens/s" in log.getvalue()
    assert "| - |" in "\n".join(M.table(rows, 1, 1, 4, 16))


class _FakeTime:
    """A perf_counter that moves only when told: the experts below take exactly a quarter second a call."""
    now = 0.0

    def perf_counter(self):
        return self.now


@pytest.mark.parametrize("prompt", [1, 5])
def test_model_experts_clock_splits_the_prefill_from_the_decode_steps(monkeypatch, prompt):
    """The experts' time of each phase, on a 2-layer model whose experts implementation advances the
    bench's clock by 0.25 s a call: 2 calls a forward, so 500 ms a prefill and a decode token, whatever
    the prompt's length (one token too: the first forward is the prefill)."""
    M = _model_cli()
    import torch
    import transformers
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    fake = _FakeTime()
    monkeypatch.setattr(M, "time", fake)

    def quarter_second(self, hidden_states, top_k_index, top_k_weights):
        fake.now += 0.25
        return torch.zeros_like(hidden_states)
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, "ktfp8_test_quarter_second", quarter_second)
    config = transformers.Qwen3MoeConfig(vocab_size=16, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.set_experts_implementation("ktfp8_test_quarter_second")
    best = M.measure(model, list(range(1, prompt + 1)), new_tokens=4, repeats=2)
    assert best["prefill_experts_ms"] == 500.0 and best["decode_experts_ms"] == 500.0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # each repeat starts from zero: a clock over two forwards, reset, then one
    clock = M.ExpertsClock([layer.mlp.experts for layer in model.model.layers])
    with torch.no_grad():
        for _ in range(2):
            model(input_ids=torch.tensor([[1, 2]]))
        assert clock.seconds() == {"prefill": 0.5, "decode": 0.5}
        clock.reset()
        model(input_ids=torch.tensor([[1, 2]]))
    assert clock.seconds() == {"prefill": 0.5, "decode": 0.0}
    clock.remove()


def test_model_goals_give_the_experts_alone_and_the_most_any_experts_could_reach():
    """Figures chosen to be plain: a 512-token prefill takes 1.28 s with eager (768 ms in its experts) and
    0.64 s with ktfp8 (128 ms in its experts, so 512 ms in the rest); a decode token 40 ms with eager
    (30 in its experts) and 16 ms with ktfp8 (6 in its experts, 10 in the rest)."""
    M = _model_cli()
    rows = [{"side": "eager", "backend": None, "skipped": None, "prefill": 400.0, "decode": 25.0,
             "prefill_experts_ms": 768.0, "decode_experts_ms": 30.0},
            {"side": "ktfp8", "backend": "avx2", "skipped": None, "prefill": 800.0, "decode": 62.5,
             "prefill_experts_ms": 128.0, "decode_experts_ms": 6.0}]
    assert M.goals(rows, 512) == [
        "reached: decode 2.50x the fastest transformers BF16 experts (eager), goal >= 1.8x; the experts alone "
        "5.00x (6.00 against 30.00 ms a decode token); the rest of the model took 10.00 ms a decode token, so no "
        "experts implementation could reach more than 4.00x",
        "reached: prefill 2.00x the fastest transformers BF16 experts (eager), goal >= 2.0x; the experts alone "
        "6.00x (128.00 against 768.00 ms a prefill); the rest of the model took 512.00 ms a prefill, so no "
        "experts implementation could reach more than 2.50x"]
    eager_row, ktfp8_row = M.table(rows, 1, 2, 512, 16)[-2:]
    assert eager_row.split(" | ")[1:] == ["400.00", "25.00", "768.00", "30.00", "2.00", "2.50", "6.00", "5.00 |"]
    assert ktfp8_row.split(" | ")[1:] == ["800.00", "62.50", "128.00", "6.00", "-", "-", "-", "- |"]
    bare = [{k: v for k, v in r.items() if not k.endswith("_experts_ms")} for r in rows]     # JSON of older runs
    assert [line.split(";")[0] for line in M.goals(bare, 512)] == M.goals(bare, 512)


# ---------------------------------------------------------------- pytest bench --bench-layers
def _collect(*args):
    # not as an xdist worker (CI runs the suite with -n): pytest-benchmark reads PYTEST_XDIST_WORKER from the
    # environment and then refuses --benchmark-only
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "bench/bench_moe.py", "--benchmark-only", "--collect-only",
                           "-q", "-p", "no:cacheprovider", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)


def test_bench_layers_option_refuses_an_unknown_layer_and_collects_a_repeated_one_once():
    """--bench-layers=nope used to collect 145 cases named 'nope-...' that ran the DeepSeek-V3 slice
    (GBs of weights); --bench-layers=bench,bench collected the benchmark layer's cases twice."""
    pytest.importorskip("pytest_benchmark")
    for bad in ("nope", "", "bench,Bench"):
        r = _collect(f"--bench-layers={bad}")
        assert r.returncode == 4 and "--bench-layers: unknown layer(s)" in r.stderr, (bad, r.stdout, r.stderr)
    once, twice = (_collect(f"--bench-layers={v}") for v in ("bench", "bench,bench"))
    assert once.returncode == twice.returncode == 0
    assert once.stdout.splitlines()[-1].split(" tests collected")[0] == \
        twice.stdout.splitlines()[-1].split(" tests collected")[0]
