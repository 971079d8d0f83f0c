"""A call's buffers (include/ktfp8/arena.h): a run of long calls reuses them, a one-off long call
gives its memory back.

A call larger than KTFP8_ARENA_KEEP_BYTES (64 MiB) of h (silu(gate) * up of every (token, expert)
pair, the largest of a call's buffers here) used to map fresh memory and fault it in on every call; a
long prompt prefilled in chunks makes such calls one after another.  The page faults a call takes
(getrusage) and the process's resident memory (/proc) show which buffers were reused and which were
freed."""
import resource

import numpy as np
import pytest

import ktfp8
from kernel_tester import kernel

KEEP_BYTES = 64 << 20
E, K, H, I = 8, 8, 16, 4096
LONG_T = 2048  # 16384 (token, expert) rows of h, 4096 activations each: 128 MiB in BF16, 256 in FP32


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _faults_of(moe, x, ids, w):
    """Page faults of one call into a written output array (a fresh one would add its own)."""
    out = np.zeros_like(x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    moe(x, ids, w, out=out)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(3)
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    experts = ktfp8.quantize_experts(rng.standard_normal((E, I, H), dtype=np.float32),
                                     rng.standard_normal((E, I, H), dtype=np.float32),
                                     rng.standard_normal((E, H, I), dtype=np.float32), cfg.quant_config)
    moe = ktfp8.MoE(cfg, experts, threads=1)

    def call(T):
        ids = np.tile(np.arange(K, dtype=np.int64), (T, 1))  # every token on every expert
        return rng.standard_normal((T, H)).astype(np.float32), ids, np.full((T, K), 1 / K, np.float32)
    return moe, call


def _tokens_for(moe, mib):
    """T whose rows of h (K per token, I activations in the backend's dtype) take about `mib` MiB of
    the call's buffer."""
    return int((mib << 20) / (K * I * np.dtype(kernel(moe.backend).act).itemsize))


@pytest.mark.skipif(not hasattr(resource, "getrusage"), reason="needs getrusage")
def test_a_run_of_long_calls_reuses_its_buffers_and_a_short_call_frees_them(layer):
    moe, call = layer
    short, long = call(4), call(LONG_T)
    moe(*short)
    faults = [_faults_of(moe, *long) for _ in range(3)]
    # counts, not bytes: with transparent huge pages always on, one fault maps 2 MiB
    assert faults[0] >= 32, f"the first long call faulted only {faults}: the test lost its point"
    assert faults[2] * 8 < faults[0], f"page faults of three long calls in a row: {faults}"
    kept = _rss_bytes()
    moe(*short)
    assert kept - _rss_bytes() > KEEP_BYTES, "the short call after the run did not free the long calls' buffer"


def test_a_one_off_long_call_gives_its_memory_back(layer):
    moe, call = layer
    short, long = call(4), call(LONG_T)
    moe(*short)
    moe(*short)
    before = _rss_bytes()
    y = moe(*long)
    assert y.shape == (LONG_T, H) and np.isfinite(y).all()
    del y
    assert _rss_bytes() - before < KEEP_BYTES // 4


@pytest.mark.skipif(not hasattr(resource, "getrusage"), reason="needs getrusage")
def test_calls_just_under_the_limit_keep_their_buffer(layer):
    """Calls of about 48 and 56 MiB in turn: the buffer grows once, to no more than the limit, and
    then serves both.  Grown by half past the limit (72 MiB), it was freed after every call and
    faulted in again by the next."""
    moe, call = layer
    smaller, larger = call(_tokens_for(moe, 48)), call(_tokens_for(moe, 56))
    grow = [_faults_of(moe, *smaller), _faults_of(moe, *larger)]
    assert min(grow) >= 8, f"the first two calls faulted only {grow}: the test lost its point"
    again = [_faults_of(moe, *args) for args in (smaller, larger, smaller, larger)]
    assert max(again) * 8 < min(grow), f"page faults of the first two calls {grow}, then {again}"


THREADS_COME_AND_GO = """
import threading
import numpy as np
import ktfp8

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

E, K, H, I, T = 16, 8, 1024, 512, 512
rng = np.random.default_rng(0)
cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
g, u, d = (rng.standard_normal(s, dtype=np.float32) for s in ((E, I, H), (E, I, H), (E, H, I)))
moe = ktfp8.MoE(cfg, ktfp8.quantize_experts(g, u, d, cfg.quant_config), threads=2)
x = rng.standard_normal((T, H), dtype=np.float32)
ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
w = np.full((T, K), 1 / K, np.float32)
moe(x, ids, w)
before = rss_mib()
for _ in range(30):
    threads = [threading.Thread(target=moe, args=(x, ids, w)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print(rss_mib() - before)
"""


def test_threads_that_come_and_go_give_their_buffers_back():
    """Each Python thread's buffers are freed when it exits, and now leave no memory behind: as malloc's
    chunks they went to glibc's per-thread heaps, which never shrink (30 rounds of 4 threads each making
    one T = 512 call: +148 MiB resident after every thread had exited, now +27-41 MiB, the rest
    NumPy's own arrays)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", THREADS_COME_AND_GO], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout) < 90, f"{float(r.stdout):.0f} MiB more resident after the threads exited"
