"""The benchmark suite's own correctness: workloads, the peers' arithmetic, the figures it derives,
and `python -m ktfp8.bench` end to end on a tiny layer (speed itself is measured in bench/, not here)."""
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8.bench import layers as L
from ktfp8.bench import report
from ktfp8.bench.run import oracle_forward
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


def test_decode_routing_never_reuses_the_previous_calls_experts():
    layer = L.BENCH_LAYER
    draws = L.routing_rounds(layer, 4, 6, seed=1)
    for (a, _), (b, _) in zip(draws, draws[1:]):
        assert not set(a.ravel()) & set(b.ravel())
    for ids, w in draws:
        assert all(len(set(row)) == layer.top_k for row in ids)
        np.testing.assert_allclose(w.sum(axis=1), 1, rtol=1e-6)
    # prefill draws from every expert: no artificial concentration of tokens per expert
    big = L.routing_rounds(layer, 64, 2, seed=1)
    assert len(np.unique(big[0][0])) > layer.experts // 2


@pytest.mark.parametrize("fmt", L.FORMATS)
def test_random_experts_are_finite_and_sized_as_the_layer(fmt):
    w = L.random_experts(TINY, fmt)
    assert w.gate.shape == (8, 32, 64) and w.down.shape == (8, 64, 32)
    if fmt != "bf16":
        assert np.isfinite(w.gate.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).all()
    else:
        assert np.isfinite(w.gate.astype(np.float32)).all()


@pytest.mark.parametrize("fmt", L.FORMATS)
def test_bench_oracle_matches_the_test_oracle(fmt):
    experts, (gate, up, down) = make_experts(fmt, 6, 64, 32, seed=3)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    ids, w = random_routing(5, 6, 2, seed=4)
    np.testing.assert_allclose(oracle_forward(experts, x, ids, w), moe_fp64(x, ids, w, gate, up, down),
                               rtol=1e-10, atol=1e-12)


def _check(side, experts, tol):
    x = L.activations(TINY, 5, seed=2)
    ids, w = L.routing_rounds(TINY, 5, 1, seed=2)[0]
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
    monkeypatch.setattr(sides, "available_memory", lambda: 1 << 16)  # 64 KiB
    with pytest.raises(PeerUnavailable, match="more than half the memory"):
        numpy_peer.NumpyFP32MoE(TINY, experts, threads=1)
    with pytest.raises(PeerUnavailable, match="GB copy"):
        check_fits("x", 1 << 16)


def _row(side, kind, fmt, T, ms, threads=1):
    return dict(layer="L", side=side, kind=kind, format=fmt, threads=threads, tokens=T, ms=ms, gbs=1.0,
                bw_fraction=0.5, tflops=1.0, peak_fraction=0.5, rel_err=0.0)


def test_speedups_and_goals_pick_the_best_thread_count_of_each_side():
    rows = [_row("ktfp8 avx2", "ktfp8", "fp8_per_channel", 1, 4.0, threads=1),
            _row("ktfp8 avx2", "ktfp8", "fp8_per_channel", 1, 2.0, threads=2),
            _row("ktfp8 avx2", "ktfp8", "bf16", 1, 3.0, threads=2),
            _row("kt-kernel AVX2FP8_MOE", "peer", "fp8_block", 1, 5.0, threads=1),
            _row("kt-kernel AVX2FP8_MOE", "peer", "fp8_block", 1, 9.0, threads=2),
            _row("torch bf16 F.linear", "peer", "bf16", 1, 6.0, threads=2),
            _row("numpy fp32 (dequantized)", "peer", "fp32", 1, 8.0, threads=2)]
    ups = {s["peer"]: s for s in report.speedups(rows)}
    assert ups["torch bf16 F.linear"]["same_format"] == pytest.approx(2.0)       # 6 / 3
    assert ups["torch bf16 F.linear"]["fp8_per_channel"] == pytest.approx(3.0)   # 6 / 2
    assert ups["numpy fp32 (dequantized)"]["same_format"] == pytest.approx(4.0)  # vs fp8 per-channel
    assert ups["kt-kernel AVX2FP8_MOE"]["same_format"] is None                   # no ktfp8 fp8_block row
    limits = {"1": dict(read_gbs=10.0, fma_gflops=100.0), "2": dict(read_gbs=20.0, fma_gflops=200.0)}
    goals = {g["goal"]: g for g in report.goals(rows, limits, "L")}
    kt = goals["decode T=1: ktfp8 FP8 per-channel faster than kt-kernel FP8"]
    assert kt["measured"] == pytest.approx(2.5) and kt["reached"]                # 5 (1 thr) / 2 (2 thr)
    bw = goals["decode T=1: fraction of measured read bandwidth"]
    assert bw["measured"] == pytest.approx(1.0 / 20.0) and not bw["reached"]
    torch_goal = goals["decode T=1: ktfp8 FP8 per-channel faster than PyTorch BF16"]
    assert torch_goal["measured"] == pytest.approx(3.0) and torch_goal["reached"]
    assert goals["prefill T=512: ktfp8 FP8 per-channel faster than kt-kernel FP8"]["reached"] is None
    text = report.goals_lines(list(goals.values()))
    assert "NOT reached" in text and "not measured" in text


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
    rows = res["results"]
    layer = L.Layer("x", 8, 2, 128, 64)
    ours = [r for r in rows if r["kind"] == "ktfp8"]
    assert {(r["format"], r["threads"], r["tokens"]) for r in ours if r["side"] == "ktfp8 avx2"} >= {
        (f, n, t) for f in L.FORMATS for n in (1, 2) for t in (1, 4, 32)} or "avx2" not in ktfp8.available_backends()
    for r in rows:
        assert r["tflops"] == pytest.approx(layer.flops(r["tokens"]) / (r["ms"] / 1e3) / 1e12, rel=1e-9)
        assert r["bw_fraction"] == pytest.approx(r["gbs"] / res["limits"][str(r["threads"])]["read_gbs"])
        assert r["ms"] == pytest.approx(float(np.median(r["samples_ms"])))
    for r in ours:
        assert r["rel_err"] < 1e-2
    # every peer either ran or says why not
    peers_seen = {r["side"] for r in rows if r["kind"] == "peer"} | {s["side"] for s in res["skipped"]}
    assert any(p.startswith("kt-kernel") for p in peers_seen)
    assert all(s["reason"] for s in res["skipped"])
    png = (tmp_path / "bench-results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    text = (tmp_path / "bench-results.txt").read_text()
    assert "microseconds per token" in text and "ktfp8 avx2" in text
    assert "bench-results.json" in run.stdout


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


def test_cli_refuses_a_missing_output_folder(tmp_path):
    r = _cli(tmp_path / "nope", "--no-peers")
    assert r.returncode == 2 and "not a folder" in r.stderr


def test_too_slow_extrapolates_linearly_from_the_last_measurement():
    from ktfp8.bench.run import too_slow
    assert too_slow(None, 2048, 30) is None
    assert too_slow((16, 0.1), 64, 30) is None        # about 0.4 s
    reason = too_slow((4, 0.5), 512, 30)              # about 64 s
    assert reason and "about 64 s" in reason and "T=4" in reason
