"""Expert parallelism over torch.distributed (gloo, loopback), 2 and 3 ranks in subprocesses
(tests/dist_worker.py), each run bounded in wall-clock time.  Oracle: the single-process MoE over the
whole layer, and the sum of the shards' outputs computed in this process."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from ktfp8.experts import split_experts
from ktfp8.moe import MoE

pytest.importorskip("torch.distributed")
import dist_worker as W  # noqa: E402  (needs the tests folder on sys.path, as conftest sets)
from dist_launch import REPO, free_port, rank_env, run_ranks  # noqa: E402

LIMIT_S = 90       # hard wall-clock bound per launch; each normally takes a few seconds


def _launch(scenario, world, tmp_path):
    return run_ranks(W.main, (scenario, str(tmp_path)), world, LIMIT_S, tmp_path)


@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_equals_one_process(world, tmp_path):
    results = _launch("equal", world, tmp_path)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {rank} failed:\n{out[-3000:]}"
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]
    x, ids, w = W.inputs()
    parts = split_experts(W.E, world)
    for fmt in W.FORMATS:
        experts = W.layer(fmt)
        cfg = W.config(fmt)
        whole = MoE(cfg, experts, threads=1)(x, ids, w)
        whole_bf16 = MoE(cfg, experts, threads=1)(x.astype(ml_dtypes.bfloat16), ids, w).astype(np.float32)
        partials = [MoE(cfg, experts.shard(part), threads=1)(x, ids, w) for part in parts]
        summed = partials[0] + partials[1] + (partials[2] if world == 3 else 0)
        for r, got in enumerate(ranks):
            assert tuple(got[f"{fmt}_range"]) == (parts[r].start, parts[r].stop)
            # every rank holds the same reduced result
            np.testing.assert_array_equal(got[f"{fmt}_f32"], ranks[0][f"{fmt}_f32"])
            # float32 sums of the same partial outputs, grouped as gloo's ring does
            np.testing.assert_allclose(got[f"{fmt}_f32"], summed, rtol=0,
                                       atol=4 * np.finfo(np.float32).eps * np.abs(summed).max())
            np.testing.assert_allclose(got[f"{fmt}_f32"], whole, rtol=0,
                                       atol=8 * np.finfo(np.float32).eps * np.abs(whole).max())
            if world == 2:     # a + b is exact in either order: the in-process sum, bit for bit
                np.testing.assert_array_equal(got[f"{fmt}_f32"], summed)
            # BF16 activations (NumPy and torch): the reduced float32 result rounded once ...
            want_bf16 = got[f"{fmt}_bf16x_f32"].astype(ml_dtypes.bfloat16).view(np.uint16)
            np.testing.assert_array_equal(got[f"{fmt}_bf16"], want_bf16)
            np.testing.assert_array_equal(got[f"{fmt}_tensor_bf16"], want_bf16)
            # ... so within one BF16 rounding step of the single process's BF16 output
            one_bf16 = got[f"{fmt}_bf16"].view(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_allclose(one_bf16, whole_bf16, rtol=2 ** -7,
                                       atol=8 * np.finfo(np.float32).eps * np.abs(whole).max())
            # resident packed experts: this rank's share of the layer
            mine, total = got[f"{fmt}_nbytes"]
            assert mine == pytest.approx(total * len(parts[r]) / W.E, rel=0.02)
    for r, got in enumerate(ranks):
        np.testing.assert_array_equal(got["from_loader_f32"], got[f"{W.FORMATS[0]}_f32"])
        assert tuple(got["from_loader_range"]) == (parts[r].start, parts[r].stop)
    for r in range(world):
        errors = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "ranks disagree on (expert_num, hidden_size" in errors["mismatch"]
        assert str(W.H + 8) in errors["mismatch"]
        assert "ranks disagree on" in errors["activation_mismatch"] and "hidden_act" in errors["activation_mismatch"]
        assert f"world size={world} would leave 1 of them without experts" in errors["too_few_experts"]


def test_ranks_fed_different_inputs_all_refuse_and_the_group_goes_on(tmp_path):
    """Data parallel misuse (each rank its own tokens) would sum shares of different tokens (same
    count) or abort in gloo (different counts): every rank raises instead, naming what differs."""
    world = 2
    results = _launch("differ", world, tmp_path)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {rank} failed:\n{out[-3000:]}"
    x, ids, w = W.inputs()
    whole = MoE(W.config("fp8_per_channel"), W.layer("fp8_per_channel"), threads=1)(x, ids, w)
    for rank in range(world):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case in ("x", "topk_ids", "tokens"):
            assert report[case] is not None, f"rank {rank} summed different {case} without an error"
            assert "needs the same x, topk_ids and topk_weights on every rank" in report[case]
            assert "KTFP8_EXPERT_PARALLEL=0" in report[case]
        assert f"rank 1: [{W.T - 1}, " in report["tokens"]
        for case in ("wide_x", "fortran_x"):     # rank 1's own error; the others' within a fraction of the timeout
            kind, message, seconds = report[case]
            assert seconds < W.TIMEOUT_S / 2, f"rank {rank} waited {seconds:.1f} s on {case}"
            if rank == 1:
                assert kind == "ValueError" and "x" in message
            else:
                assert (kind, message) == ("ExpertParallelError", "rank(s) 1 refused their arguments (their error "
                                                                  "says why), so no rank computed this call")
        np.testing.assert_allclose(np.load(tmp_path / f"rank{rank}.npy"), whole, rtol=0,
                                   atol=8 * np.finfo(np.float32).eps * np.abs(whole).max())


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_lost_rank_is_an_error_within_the_timeout(how, tmp_path):
    world = 2
    results = _launch(how, world, tmp_path)
    if how == "kill":
        assert results[-1][0] == -9
    for rank in range(world - 1):
        rc, out = results[rank]
        assert rc == 0, f"rank {rank} failed:\n{out[-3000:]}"
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["error"] is not None, "the call succeeded without the lost rank"
        assert f"failed on rank {rank} of {world}: a rank died" in report["error"]
        assert report["seconds"] < W.FAIL_TIMEOUT_S + 5
        if how == "stall":
            assert report["seconds"] >= W.FAIL_TIMEOUT_S * 0.9     # waited for it, then gave up


def test_split_experts():
    assert split_experts(64, 1) == [range(0, 64)]
    assert split_experts(64, 2) == [range(0, 32), range(32, 64)]
    assert split_experts(64, 3) == [range(0, 22), range(22, 43), range(43, 64)]
    assert split_experts(7, 7) == [range(e, e + 1) for e in range(7)]
    for E in range(1, 20):
        for n in range(1, E + 1):
            parts = split_experts(E, n)
            assert [e for p in parts for e in p] == list(range(E))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="parts=9 would leave 1 of them without experts"):
        split_experts(8, 9)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="must be a positive int"):
            split_experts(8, bad)


def test_outside_a_process_group_is_a_clear_error(monkeypatch):
    from ktfp8 import distributed
    cfg = W.config("bf16")
    with pytest.raises(RuntimeError, match="not initialised"):
        distributed.ExpertParallelMoE(cfg, W.layer("bf16"))
    for var in distributed.TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node"):
        distributed.init_process_group()
    monkeypatch.setenv(distributed.ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="KTFP8_DIST_TIMEOUT_S must be a positive number"):
        distributed.timeout_seconds()
    with pytest.raises(TypeError, match="config must be a ktfp8.MoeConfig, got dict"):
        distributed.ExpertParallelMoE({"expert_num": 4}, W.layer("bf16"))
    with pytest.raises(TypeError, match="experts must be ktfp8.ExpertWeights, got tuple"):
        distributed.ExpertParallelMoE(cfg, (1, 2, 3))
    for bad in (0, -3, float("nan"), float("inf"), "x", True, 1e10, "99999999999"):
        with pytest.raises(ValueError, match="timeout_s must be a positive"):
            distributed.timeout_seconds(bad)
    assert distributed.timeout_seconds(distributed.MAX_TIMEOUT_S) == 1e8


def test_collectives_default_to_the_timeout_the_group_was_started_with(monkeypatch):
    """init_process_group(timeout_s=7) bounds the rendezvous, and ExpertParallelMoE's collectives waited
    $KTFP8_DIST_TIMEOUT_S or 300 s all the same (its error then named timeout_s=300)."""
    from ktfp8 import distributed
    for name, value in rank_env(0, 1, free_port()).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(distributed.ENV_TIMEOUT, "60")
    assert distributed.init_process_group(timeout_s=7, numa=False) == (0, 1)
    try:
        assert distributed.timeout_seconds() == 7 and distributed.timeout_seconds(2) == 2
        assert distributed.ExpertParallelMoE(W.config("bf16"), W.layer("bf16"), threads=1).timeout_s == 7
    finally:
        distributed.destroy_process_group()
    assert distributed.timeout_seconds() == 60


def test_destroy_process_group_ends_torch_distributed_then_leaves_the_gil(monkeypatch):
    import torch.distributed as dist
    from ktfp8 import distributed
    events = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: events.append("destroy"))
    monkeypatch.setattr(distributed.time, "sleep", lambda s: events.append(("sleep", s)))
    distributed.destroy_process_group()
    assert events == ["destroy", ("sleep", distributed.GLOO_RELEASE_S)]
    events.clear()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)     # nothing to end: only the wait
    distributed.destroy_process_group()
    assert events == [("sleep", distributed.GLOO_RELEASE_S)]


def test_importing_ktfp8_and_its_distributed_module_does_not_import_torch():
    import os
    import subprocess
    import sys
    code = "import sys, ktfp8, ktfp8.distributed; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_expert_parallel_bench_script_runs(tmp_path):
    """bench/expert_parallel.py on 2 ranks, one call: it had stopped running when the bench's routing
    draws gained a third field (a helper re-measuring the README's tables found it)."""
    out = tmp_path / "ep.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "expert_parallel.py"), "--ranks", "2", "--tokens", "1",
                           "--rounds", "1", "--repeat", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.exists() and json.loads(out.read_text())


def _rank_that_fails(rank, world, port, threads, queue):
    if rank == 1:
        raise SystemExit(3)
    queue.put({"rank": rank})


def test_expert_parallel_bench_stops_when_a_rank_dies():
    """The script's launcher stops as soon as a rank has died without a result (it waited 30 minutes)."""
    spec = importlib.util.spec_from_file_location("expert_parallel", os.path.join(REPO, "bench", "expert_parallel.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a rank failed: exit codes \[0, 3\]"):
        module.run(2, 2, _rank_that_fails)
    assert time.monotonic() - start < 30
