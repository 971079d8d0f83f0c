"""Concurrency and resources: one MoE shared by 8 Python threads, MoE objects created and dropped
without RSS growth, and the thread count rules (threads= > config.threads > KTFP8_NUM_THREADS >
OMP_NUM_THREADS > all cores) checked by counting the OpenMP threads a fresh process really starts, and
workers forked after a thread team (one thread, not a hang)."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8 import backends
from ktfp8.moe import MoE
from moe_oracle import make_experts, random_routing
from threads import run_in_threads

TESTS = Path(__file__).resolve().parent
# the tree whose ktfp8 this process imported: the probes below must load the same build (a clang build's
# copy when test_build_options runs these tests from its own folder), not the checkout's
PACKAGE_ROOT = Path(ktfp8.__file__).resolve().parents[1]


def _probe_env(base):
    env = {k: v for k, v in base.items() if k not in ("KTFP8_NUM_THREADS", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), str(TESTS)])
    return env
BACKENDS = backends.usable_variants()
E, H, I, K = 8, 96, 80, 3


def _config(fmt="fp8_per_channel", threads=None):
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I,
                          threads=threads)
    cfg.quant_config.method = "BF16" if fmt == "bf16" else "FP8"
    cfg.quant_config.per_channel = fmt != "fp8_block"
    if fmt == "fp8_block":
        cfg.quant_config.group_size = 64
    return cfg


def _inputs(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        T = int(rng.integers(1, 20))
        ids, w = random_routing(T, E, K, seed=seed * 1000 + i, skip_fraction=0.1)
        x = rng.standard_normal((T, H)).astype(np.float32)
        out.append((x.astype(ml_dtypes.bfloat16) if i % 3 == 2 else x, ids, w))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_eight_threads_share_one_moe(backend):
    """8 Python threads call one MoE for ~3 s (the GIL is released in the kernel, so the C code
    really runs concurrently): every result is bit-identical to the serial result of that input."""
    emulated = backend.endswith("_emulated")
    moe = MoE(_config("fp8_block" if backend == "reference" else "fp8_per_channel"),
              make_experts("fp8_block" if backend == "reference" else "fp8_per_channel", E, H, I, seed=4)[0],
              backend=backend, threads=2)
    per_thread = [_inputs(6, seed=s) for s in range(8)]
    serial = [[moe(*args) for args in inputs] for inputs in per_thread]
    seconds = 1.0 if emulated else 3.0
    calls, failures = [0] * 8, []
    start = threading.Barrier(8)

    def worker(t):
        start.wait()
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            j = i % len(per_thread[t])
            y = moe(*per_thread[t][j])
            if not np.array_equal(y.view(np.uint8), serial[t][j].view(np.uint8)):
                failures.append((t, j))
                return
            i += 1
        calls[t] = i

    run_in_threads(worker, [(t,) for t in range(8)])
    assert not failures, f"results differ from the serial run at (thread, input) {failures[:5]}"
    assert all(c > 0 for c in calls), calls
    print(f"{backend}: {sum(calls)} concurrent calls in {seconds} s")


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan holds freed memory in quarantine: RSS is no measure of leaks there")
@pytest.mark.parametrize("fmt", ["fp8_per_channel", "fp8_block", "bf16"])
def test_create_and_drop_does_not_grow_rss(fmt):
    """150 MoE objects (each 0.2-0.4 MB packed) built, called twice (64 tokens) and dropped: RSS
    stays within a small slack of where it was after a warm-up, so neither packing nor a forward
    (its ~0.1 MB of per-call buffers) leaks."""
    experts, _ = make_experts(fmt, E, H, I, seed=5)
    cfg = _config(fmt)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((64, H)).astype(np.float32)
    ids, w = random_routing(64, E, K, seed=9)
    logits = rng.standard_normal((64, E)).astype(np.float32)

    def cycle(n):
        for _ in range(n):
            moe = MoE(cfg, experts, threads=1)
            moe(x, ids, w)
            moe.forward(x, router_logits=logits)
            del moe

    cycle(30)   # warm-up: allocator pools, OpenMP thread stacks, lazily imported modules
    before = _rss_bytes()
    cycle(150)
    growth = _rss_bytes() - before
    packed = MoE(cfg, experts).nbytes
    # leaking the packed weights alone would be 150 x packed (27+ MB); allow 4 MB of noise
    assert growth < 4 * 2 ** 20, f"RSS grew by {growth / 2 ** 20:.1f} MB over 150 MoE objects of {packed} bytes"


_PROBE = r"""
import json, os, sys
import numpy as np
import ktfp8
from moe_oracle import make_experts, random_routing

def os_threads():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("Threads:")).split()[1])

cfg_threads = json.loads(sys.argv[1])
explicit = json.loads(sys.argv[2])
reassigned = json.loads(sys.argv[3])
cfg = ktfp8.MoeConfig(expert_num=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=64,
                      threads=cfg_threads)
experts, _ = make_experts("fp8_per_channel", 8, 64, 64, seed=1)
x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
ids, w = random_routing(16, 8, 2, seed=0)
before = os_threads()
moe = ktfp8.MoE(cfg, experts, backend="reference", threads=explicit)
if reassigned is not None:
    moe.threads = reassigned
y = moe(x, ids, w)
# libgomp keeps its pool alive after a parallel region: n threads = the caller + n - 1 workers
print(json.dumps({"threads": moe.threads, "pool": os_threads() - before + 1, "y": y.tobytes().hex(),
                  "package": os.path.dirname(ktfp8.__file__)}))
"""


def _probe(env, cfg_threads=None, explicit=None, reassigned=None):
    full = _probe_env(os.environ)
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cfg_threads), json.dumps(explicit),
                           json.dumps(reassigned)],
                          env=full, cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        assert json.loads(proc.stdout)["package"] == str(PACKAGE_ROOT / "ktfp8")
    return proc


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize("env, cfg_threads, explicit, want", [
    ({"KTFP8_NUM_THREADS": "3"}, None, None, 3),
    ({"OMP_NUM_THREADS": "2"}, None, None, 2),
    ({"OMP_NUM_THREADS": "3,2"}, None, None, 3),                    # nested list: the outer level
    ({"KTFP8_NUM_THREADS": "1", "OMP_NUM_THREADS": "3"}, None, None, 1),
    ({"KTFP8_NUM_THREADS": "1"}, 3, None, 3),                       # config.threads beats the environment
    ({"KTFP8_NUM_THREADS": "1"}, 3, 2, 2),                          # threads= beats config.threads
    ({}, None, None, backends.usable_cores()),                      # affinity, within a cgroup CPU quota
])
def test_thread_count_precedence(env, cfg_threads, explicit, want):
    proc = _probe(env, cfg_threads, explicit)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["threads"] == want
    assert got["pool"] == want, f"OpenMP ran {got['pool']} threads, MoE.threads is {want}"


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize("built, reassigned", [(1, 2), (1, 3)])
def test_assigned_thread_count_is_the_one_that_runs(built, reassigned):
    """moe.threads = n after construction: the next call runs n OpenMP threads (the benchmark
    re-threads one MoE per thread count).  Built on 1 thread, so packing starts no pool: the pool
    counted is the call's (libgomp keeps a larger pool alive, so n < built is not observable)."""
    proc = _probe({}, None, built, reassigned)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["threads"] == reassigned
    assert got["pool"] == reassigned, f"OpenMP ran {got['pool']} threads after moe.threads = {reassigned}"


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_assigning_a_bad_thread_count_raises_and_keeps_the_old_one(bad):
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=5)
    moe = MoE(_config(), experts, threads=2)
    with pytest.raises(ValueError, match="threads must be a positive int or None"):
        moe.threads = bad
    assert moe.threads == 2


def test_assigning_none_gives_the_count_construction_gave(monkeypatch):
    """None: the layer's own MoeConfig.threads, else the environment read again (it skipped the config's
    count and read the environment alone)."""
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=5)
    monkeypatch.setenv("KTFP8_NUM_THREADS", "3")
    cfg = _config()
    cfg.threads = 1
    moe = MoE(cfg, experts, threads=2)
    moe.threads = None
    assert moe.threads == 1
    unset = MoE(_config(), experts, threads=2)
    monkeypatch.setenv("KTFP8_NUM_THREADS", "2")
    unset.threads = None
    assert unset.threads == 2


def test_thread_count_does_not_change_results():
    outputs = {json.loads(_probe({"KTFP8_NUM_THREADS": str(n)}).stdout)["y"] for n in (1, 2, 3)}
    assert len(outputs) == 1


_FORK = r"""
import json, multiprocessing as mp, sys, warnings
import numpy as np
import ktfp8
from ktfp8._native import _ext
from moe_oracle import make_experts, random_routing

def forward(_):
    # one 2-thread forward, built from scratch in this process: what it saw, and the OS threads it ran
    cfg = ktfp8.MoeConfig(expert_num=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=64)
    experts, _ = make_experts("fp8_per_channel", 8, 64, 64, seed=1)
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    ids, w = random_routing(16, 8, 2, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = ktfp8.MoE(cfg, experts, backend="reference", threads=2)(x, ids, w)
    with open("/proc/self/status") as f:
        threads = int(next(l for l in f if l.startswith("Threads:")).split()[1])
    return {"capped": _ext.forked_after_teams(), "os_threads": threads, "y": y.tobytes().hex(),
            "warnings": [str(c.message) for c in caught]}

def in_forked_worker():
    with mp.get_context("fork").Pool(1) as pool:
        return pool.apply_async(forward, (0,)).get(timeout=60)

if __name__ == "__main__":
    before = in_forked_worker()  # forked before this process ran any team
    here = forward(0)
    after = in_forked_worker()   # forked after: libgomp's pool threads were not copied
    print(json.dumps({"before": before, "here": here, "after": after, "package": ktfp8.__file__}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_forked_worker_runs_on_one_thread_instead_of_hanging(tmp_path):
    """multiprocessing's "fork" workers: before the parent ran a thread team, a worker runs its own
    two threads; after, OpenMP would wait forever for the parent's pool threads, so the worker runs
    on one thread, warns once, and gives the same bytes."""
    env = _probe_env(os.environ)
    env["KTFP8_NUM_THREADS"] = "2"   # the experts' quantization too: a pool of 2 on any machine
    script = tmp_path / "fork_probe.py"
    script.write_text(_FORK)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=PACKAGE_ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert Path(got["package"]).parents[1] == PACKAGE_ROOT
    assert [got[k]["capped"] for k in ("before", "here", "after")] == [False, False, True]
    assert got["before"]["os_threads"] == 2 and got["before"]["warnings"] == []
    assert got["after"]["os_threads"] == 1
    assert len(got["after"]["warnings"]) == 1 and "runs on 1 thread" in got["after"]["warnings"][0]
    assert got["before"]["y"] == got["here"]["y"] == got["after"]["y"]


@pytest.mark.parametrize("var, value, message", [
    ("KTFP8_NUM_THREADS", "0", "KTFP8_NUM_THREADS='0' must be a positive integer"),
    ("KTFP8_NUM_THREADS", "four", "KTFP8_NUM_THREADS='four' is not an integer"),
    ("OMP_NUM_THREADS", "-2", "OMP_NUM_THREADS='-2' must be a positive integer"),
    ("OMP_NUM_THREADS", "many", "OMP_NUM_THREADS='many' is not an integer"),
    # libgomp ignores such a list (a warning) and runs on every core; ktfp8 took its first count
    ("OMP_NUM_THREADS", "2,abc", "OMP_NUM_THREADS='2,abc' is not a list of positive integers"),
    ("OMP_NUM_THREADS", "2,", "OMP_NUM_THREADS='2,' is not a list of positive integers"),
    ("OMP_NUM_THREADS", "2,0", "OMP_NUM_THREADS='2,0' is not a list of positive integers"),
])
def test_invalid_thread_variables_raise(monkeypatch, var, value, message):
    monkeypatch.delenv("KTFP8_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(var, value)
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=5)
    with pytest.raises(ValueError, match=message):
        MoE(_config(), experts)
