"""MoE forward on every backend this machine runs, against a float64 oracle and the reference."""
import os
import threading

import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8 import backends
from ktfp8.moe import MoE
from moe_oracle import make_experts, moe_fp64, nmse, random_routing

E, H, I, K = 6, 200, 72, 3  # odd sizes on purpose: no multiple-of-32 anywhere
FORMATS = ["fp8_per_channel", "fp8_block", "bf16"]
BACKENDS = backends.usable_variants()  # every kernel this CPU runs, emulated ones included
FAST = [b for b in BACKENDS if b != "reference"]


def config(fmt, experts=E, hidden=H, inter=I, k=K):
    cfg = ktfp8.MoeConfig(expert_num=experts, num_experts_per_tok=k, hidden_size=hidden,
                          intermediate_size=inter)
    cfg.quant_config.method = "BF16" if fmt == "bf16" else "FP8"
    cfg.quant_config.per_channel = fmt != "fp8_block"
    cfg.quant_config.group_size = 64 if fmt == "fp8_block" else 0
    return cfg


@pytest.fixture(scope="module", params=FORMATS)
def layer(request):
    fmt = request.param
    experts, dense = make_experts(fmt, E, H, I, seed=1)
    return fmt, config(fmt), experts, dense


def _inputs(T, seed=0, skip=0.1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, w = random_routing(T, E, K, seed=seed, skip_fraction=skip)
    return x, ids, w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 5, 33])
def test_matches_fp64_oracle(layer, backend, T):
    fmt, cfg, experts, dense = layer
    x, ids, w = _inputs(T, seed=T)
    y = MoE(cfg, experts, backend=backend)(x, ids, w)
    assert y.dtype == np.float32 and y.shape == (T, H)
    assert nmse(y, moe_fp64(x, ids, w, *dense)) <= 2e-5


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("T", [1, 4, 7, 40])
def test_fast_backend_matches_reference(layer, backend, T):
    """Same rounding points as the fast kernel (activations in its dtype): NMSE <= 1e-6."""
    fmt, cfg, experts, _ = layer
    x, ids, w = _inputs(T, seed=100 + T)
    fast = MoE(cfg, experts, backend=backend)
    ref = MoE(cfg, experts, backend="reference")
    ref._act_dtype = fast._act_dtype
    assert nmse(fast(x, ids, w), ref(x, ids, w)) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_activations(layer, backend):
    fmt, cfg, experts, dense = layer
    x, ids, w = _inputs(9, seed=3)
    xb = x.astype(ml_dtypes.bfloat16)
    y = MoE(cfg, experts, backend=backend)(xb, ids, w)
    assert y.dtype == ml_dtypes.bfloat16
    assert nmse(y.astype(np.float64), moe_fp64(xb.astype(np.float64), ids, w, *dense)) <= 2e-5


@pytest.mark.parametrize("backend", FAST)
def test_many_tokens(backend):
    """Thousands of tokens: every expert gets hundreds of rows (the prefill paths)."""
    if backend.endswith("_emulated"):
        pytest.skip("software emulation is too slow for thousands of tokens; covered at T <= 40")
    fmt = "fp8_per_channel"
    experts, _ = make_experts(fmt, E, H, I, seed=2)
    cfg = config(fmt)
    x, ids, w = _inputs(2000, seed=5)
    fast = MoE(cfg, experts, backend=backend)
    ref = MoE(cfg, experts, backend="reference")
    ref._act_dtype = fast._act_dtype
    assert nmse(fast(x, ids, w), ref(x, ids, w)) <= 1e-6


def test_zero_tokens(layer):
    _, cfg, experts, _ = layer
    moe = MoE(cfg, experts)
    y = moe(np.zeros((0, H), np.float32), np.zeros((0, K), np.int64), np.zeros((0, K), np.float32))
    assert y.shape == (0, H) and y.dtype == np.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_ids_are_skipped(backend):
    experts, dense = make_experts("fp8_per_channel", E, H, I, seed=4)
    cfg = config("fp8_per_channel")
    x, ids, w = _inputs(6, seed=6, skip=0.0)
    ids[:, 1] = -1
    ids[2, :] = -1  # a token with no expert here at all: its output is exactly zero
    y = MoE(cfg, experts, backend=backend)(x, ids, w)
    assert nmse(y, moe_fp64(x, ids, w, *dense)) <= 2e-5
    assert np.all(y[2] == 0)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_out_and_accumulate(layer, dtype):
    _, cfg, experts, _ = layer
    moe = MoE(cfg, experts)
    x, ids, w = _inputs(5, seed=7)
    x = x.astype(dtype)
    base = np.random.default_rng(8).standard_normal((5, H)).astype(dtype)
    fresh = moe(x, ids, w)
    out = np.full_like(x, 7)
    assert moe(x, ids, w, out=out) is out
    np.testing.assert_array_equal(out, fresh)
    acc = base.copy()
    moe(x, ids, w, out=acc, accumulate=True)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(acc.astype(np.float32), base.astype(np.float32) + fresh.astype(np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_x_stays_in_its_token(backend):
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=9)
    x, ids, w = _inputs(4, seed=9, skip=0.0)
    x[1, 17] = np.nan
    y = MoE(config("fp8_per_channel"), experts, backend=backend)(x, ids, w)
    assert np.isnan(y[1]).all()
    assert np.isfinite(np.delete(y, 1, axis=0)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_weight_code_propagates_like_a_nan_weight(backend):
    experts, dense = make_experts("fp8_per_channel", E, H, I, seed=10)
    experts.down[2, 5, 9] = 0x7F  # NaN code in row 5 of expert 2's down projection
    x, ids, w = _inputs(4, seed=10, skip=0.0)
    ids[:] = [2, 0, 1]
    ids[3] = [0, 1, 3]  # token 3 never meets expert 2
    y = MoE(config("fp8_per_channel"), experts, backend=backend)(x, ids, w)
    assert np.isnan(y[:3, 5]).all()
    assert np.isfinite(np.delete(y[:3], 5, axis=1)).all() and np.isfinite(y[3]).all()


@pytest.mark.parametrize("backend", FAST)
def test_thread_count_does_not_change_results(backend):
    experts, _ = make_experts("fp8_block", E, H, I, seed=11)
    x, ids, w = _inputs(24, seed=11)
    y1 = MoE(config("fp8_block"), experts, backend=backend, threads=1)(x, ids, w)
    y2 = MoE(config("fp8_block"), experts, backend=backend, threads=2)(x, ids, w)
    np.testing.assert_array_equal(y1, y2)


def test_concurrent_calls_match_serial_calls():
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=12)
    moe = MoE(config("fp8_per_channel"), experts)
    inputs = [_inputs(3 + i, seed=20 + i) for i in range(6)]
    serial = [moe(*args) for args in inputs]
    results = [None] * len(inputs)

    def work(i):
        for _ in range(5):
            results[i] = moe(*inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, serial):
        np.testing.assert_array_equal(got, want)


def test_packed_fp8_weights_take_one_byte_each():
    Hs, Is = 256, 128  # tile-aligned, so no padding
    experts, _ = make_experts("fp8_per_channel", E, Hs, Is, seed=13)
    for backend in BACKENDS:
        moe = MoE(config("fp8_per_channel", hidden=Hs, inter=Is), experts, backend=backend)
        weights = E * 3 * Hs * Is
        assert weights <= moe.nbytes <= weights * 1.05, backend


def test_backend_is_best_available_and_env_forces_one(monkeypatch, layer):
    _, cfg, experts, _ = layer
    monkeypatch.delenv("KTFP8_BACKEND", raising=False)
    assert MoE(cfg, experts).backend == ktfp8.available_backends()[0]
    monkeypatch.setenv("KTFP8_BACKEND", "reference")
    assert MoE(cfg, experts).backend == "reference"
    monkeypatch.setenv("KTFP8_BACKEND", "no_such_kernel")
    with pytest.raises(ValueError, match="KTFP8_BACKEND.*usable backends: .*reference"):
        MoE(cfg, experts)


def test_unusable_backend_is_refused(layer):
    _, cfg, experts, _ = layer
    missing = [b for b in ("amx", "avx512_bf16", "avx512", "avx2") if b not in BACKENDS]
    for name in missing:
        with pytest.raises(ValueError, match="usable backends"):
            MoE(cfg, experts, backend=name)


def test_ktransformers_named_classes():
    from ktfp8 import moe as moe_mod
    native = [b for b in ("amx", "avx512_bf16") if b in ktfp8.available_backends()]
    assert moe_mod._HAS_FP8_PERCHANNEL_SUPPORT == bool(native)
    classes = (moe_mod.AMXFP8PerChannel_MOE, moe_mod.AMXFP8_MOE, moe_mod.AMXBF16_MOE)
    assert all(isinstance(cls, type) and issubclass(cls, MoE) for cls in classes)
    experts, dense = make_experts("fp8_per_channel", E, H, I, seed=14)
    if native:
        m = moe_mod.AMXFP8PerChannel_MOE(config("fp8_per_channel"), experts)
        assert m.backend == native[0]
        x, ids, w = _inputs(3)
        assert nmse(m(x, ids, w), moe_fp64(x, ids, w, *dense)) <= 2e-5
    else:
        lacking = [f for f in ("avx512f", "avx512bw", "avx512_bf16", "avx512_vbmi") if not ktfp8.cpu_features()[f]]
        for cls in classes:
            with pytest.raises(RuntimeError, match=f"{cls.__name__} needs the native AVX-512-BF16 path") as e:
                cls(config("fp8_per_channel"), experts)
            assert all(flag in str(e.value) for flag in lacking) and "use ktfp8.MoE(config, experts)" in str(e.value)


def test_ktransformers_named_class_on_a_build_without_native_kernels(monkeypatch):
    """A CPU that has every flag but a build without the kernels: the message says it is the build."""
    from ktfp8 import moe as moe_mod
    monkeypatch.setattr(moe_mod, "_NATIVE_BACKENDS", [])
    monkeypatch.setattr(moe_mod.backends, "cpu_features", lambda: dict.fromkeys(moe_mod._AVX512_BF16_FLAGS, 1))
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=14)
    with pytest.raises(RuntimeError, match="this build did not compile the avx512_bf16 / amx kernels"):
        moe_mod.AMXFP8PerChannel_MOE(config("fp8_per_channel"), experts)


def test_moe_forward_functional_form(layer):
    fmt, cfg, experts, dense = layer
    x, ids, w = _inputs(4, seed=15)
    y = ktfp8.moe_forward(x, experts, ids, w, config=cfg)
    np.testing.assert_array_equal(y, MoE(cfg, experts)(x, ids, w))


def test_forward_with_router_logits(layer):
    fmt, cfg, experts, dense = layer
    rng = np.random.default_rng(16)
    x = rng.standard_normal((5, H)).astype(np.float32)
    logits = rng.standard_normal((5, E)).astype(np.float32)
    moe = MoE(cfg, experts)
    ids, w = ktfp8.route(logits, cfg)
    np.testing.assert_array_equal(moe.forward(x, router_logits=logits), moe(x, ids, w))
