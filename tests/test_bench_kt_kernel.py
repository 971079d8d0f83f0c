"""The kt-kernel benchmark side: KTransformers' own MoE kernels on ktfp8's ExpertWeights, checked
against the float64 oracle, and refusing (PeerUnavailable) what it cannot run correctly."""
import os

import ml_dtypes
import numpy as np
import pytest

from ktfp8.bench.sides import PeerUnavailable
from moe_oracle import make_experts, moe_fp64, nmse, random_routing

try:
    from ktfp8.bench.kt_kernel_peer import KtKernelMoE, kt_kernel_version
    VERSION = kt_kernel_version()
except PeerUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

# sizes every kt-kernel build accepts (AMX: multiples of 32, 128x128 blocks dividing both)
E, H, I, K = 8, 256, 128, 2
FORMATS = ["fp8_per_channel", "fp8_block", "bf16"]


def _inputs(T, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(ml_dtypes.bfloat16)
    ids, w = random_routing(T, E, K, seed=seed, skip_fraction=0.2)
    return x, ids, w


def _threads():
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_oracle_or_says_why_not(fmt):
    experts, dense = make_experts(fmt, E, H, I, seed=1, block=128)
    try:
        side = KtKernelMoE(experts, K, threads=1, max_tokens=8)
    except PeerUnavailable as exc:
        # only per-channel FP8 may be missing, on builds without AMXFP8PerChannel_MOE (AVX2)
        assert fmt == "fp8_per_channel" and "AMXFP8PerChannel_MOE" in str(exc), str(exc)
        return
    try:
        assert side.format == fmt and side.name.startswith("kt-kernel ")
        for T, seed in ((1, 3), (8, 4)):  # kt-kernel has separate decode and batch paths
            x, ids, w = _inputs(T, seed)
            got = side(x, ids, w)
            assert got.shape == (T, H)
            want = moe_fp64(x.astype(np.float64), ids, w, *dense)
            # bf16 output and bf16 gate/up intermediates: relative error ~4e-3
            assert nmse(got, want) < 1e-4, (side.name, T)
    finally:
        side.close()


def test_refuses_sizes_it_would_corrupt_memory_on():
    experts, _ = make_experts("bf16", E, 200, I, seed=1)
    with pytest.raises(PeerUnavailable, match="hidden_size % 16"):
        KtKernelMoE(experts, K, threads=1, max_tokens=4)


def test_validates_calls_and_close_joins_its_threads():
    experts, _ = make_experts("bf16", E, H, I, seed=2)
    before = _threads()
    side = KtKernelMoE(experts, K, threads=2, max_tokens=4)
    assert _threads() > before
    x, ids, w = _inputs(5, seed=5)
    with pytest.raises(ValueError, match="1..4"):
        side(x, ids[:5], w[:5])
    with pytest.raises(ValueError, match="expert_num"):
        side(x[:1], np.full((1, K), E, np.int64), w[:1])
    side.close()
    side.close()
    assert _threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        side(x[:1], ids[:1], w[:1])


def test_layers_share_one_pool_and_the_last_to_close_joins_it():
    """As KTransformers runs a model's layers on one CPUInfer: no second set of spinning workers."""
    (a_w, a_dense), (b_w, b_dense) = (make_experts("bf16", E, H, I, seed=s) for s in (6, 7))
    x, ids, w = _inputs(3, seed=8)
    # one layer built, called and closed first, so that threads a library starts on first use and
    # keeps (an OpenMP pool) are there before the count: this test counts the layers' own workers
    # (about one clean-clone suite run in five counted one more thread at the end than at the start)
    warm = KtKernelMoE(a_w, K, threads=1, max_tokens=4)
    warm(x, ids, w)
    warm.close()
    before = _threads()
    a = KtKernelMoE(a_w, K, threads=1, max_tokens=4)
    with_pool = _threads()
    b = KtKernelMoE(b_w, K, threads=1, max_tokens=4, pool=a, layer_idx=1)
    assert _threads() == with_pool  # no new workers
    with pytest.raises(ValueError, match="same thread count"):
        KtKernelMoE(b_w, K, threads=2, max_tokens=4, pool=a)
    with pytest.raises(ValueError, match="layer_idx"):
        KtKernelMoE(b_w, K, threads=1, max_tokens=4, pool=a, layer_idx=-1)
    for side, dense in ((a, a_dense), (b, b_dense), (a, a_dense)):
        assert nmse(side(x, ids, w), moe_fp64(x.astype(np.float64), ids, w, *dense)) < 1e-4
    a.close()  # the layer that built the pool first: b still runs on it
    assert nmse(b(x, ids, w), moe_fp64(x.astype(np.float64), ids, w, *b_dense)) < 1e-4
    b.close()
    assert _threads() == before
