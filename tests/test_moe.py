"""The MoE object: zero tokens, out= and accumulate, threads, concurrent calls, memory, backend choice,
the KTransformers-named classes, the functional and router-logits forms.  What each kernel computes
(every variant x weight format x token count, edge cases) is test_kernels.py's, via kernel_tester."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8 import backends
from ktfp8.experts import MAX_SCALE
from ktfp8.moe import MoE
from kernel_tester import BF16, kernel, moe_config
from moe_oracle import make_experts, moe_fp64, nmse, random_routing
from threads import run_in_threads

E, H, I, K = 6, 200, 72, 3  # odd sizes on purpose: no multiple-of-32 anywhere
FORMATS = ["fp8_per_channel", "fp8_block", "bf16"]
BACKENDS = backends.usable_variants()  # every kernel this CPU runs, emulated ones included
FAST = [b for b in BACKENDS if b != "reference"]


def config(fmt, experts=E, hidden=H, inter=I, k=K):
    return moe_config(fmt, experts, hidden, inter, k, block=64)  # make_experts' default block


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


def test_zero_tokens(layer):
    _, cfg, experts, _ = layer
    moe = MoE(cfg, experts)
    y = moe(np.zeros((0, H), np.float32), np.zeros((0, K), np.int64), np.zeros((0, K), np.float32))
    assert y.shape == (0, H) and y.dtype == np.float32


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


@pytest.mark.parametrize("backend", FAST)
def test_thread_count_does_not_change_results(backend):
    experts, _ = make_experts("fp8_block", E, H, I, seed=11)
    x, ids, w = _inputs(24, seed=11)
    y1 = MoE(config("fp8_block"), experts, backend=backend, threads=1)(x, ids, w)
    y2 = MoE(config("fp8_block"), experts, backend=backend, threads=2)(x, ids, w)
    np.testing.assert_array_equal(y1, y2)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("fmt", FORMATS)
def test_runs_of_tiles_do_not_change_results(backend, fmt):
    """Wide enough that the driver hands out runs of several tiles (items / (8 x threads), the last
    threads x run items in runs a quarter as long), which start at other tiles for every thread
    count, and takes phase 2's runs as groups (experts outer):
    33 column tiles, the last one 8 columns wide, so groups of 4 on 1 thread and of 2 on 2 end in a
    short group.  The outputs stay identical bit for bit, and equal to the float64 MoE."""
    e, h, i = 8, 520, 512
    experts, dense = make_experts(fmt, e, h, i, seed=13)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((24, h)).astype(np.float32)
    ids, w = random_routing(24, e, K, seed=13)
    moe = MoE(config(fmt, experts=e, hidden=h, inter=i), experts, backend=backend, threads=1)
    want = moe(x, ids, w)
    assert nmse(want, moe_fp64(x, ids, w, *dense)) <= 2e-5
    for n in (2, 3, 5):
        moe.threads = n
        np.testing.assert_array_equal(moe(x, ids, w), want, err_msg=f"{n} threads")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_long_call_in_token_blocks(backend, fmt):
    """A call long enough that phase 2 runs in token blocks (moe_driver.c, phase2_block_tokens: 3 blocks
    here for the kernels with two down tiles an item, 2 for those with one, on any machine), each
    expert's pairs cut at the blocks' edges: equal to the float64 MoE, the same bits on 1, 2 and 3
    threads, and out= / accumulate= through every block."""
    e, h, i, T = 6, 40, 32, 4999
    experts, dense = make_experts(fmt, e, h, i, seed=17)
    rng = np.random.default_rng(17)
    x = rng.standard_normal((T, h)).astype(np.float32)
    ids, w = random_routing(T, e, K, seed=17, skip_fraction=0.1)
    moe = MoE(config(fmt, experts=e, hidden=h, inter=i), experts, backend=backend, threads=1)
    want = moe(x, ids, w)
    assert nmse(want, moe_fp64(x, ids, w, *dense)) <= 2e-5
    for n in (2, 3):
        moe.threads = n
        np.testing.assert_array_equal(moe(x, ids, w), want, err_msg=f"{n} threads")
    base = rng.standard_normal((T, h)).astype(np.float32)
    acc = base.copy()
    moe(x, ids, w, out=acc, accumulate=True)
    np.testing.assert_allclose(acc, base + want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_limit_clamps_gate_and_up(backend, fmt):
    """MoeConfig.swiglu_limit L: silu(min(gate, L)) * clamp(up, -L, L), the clamped SwiGLU of DeepSeek-V4,
    on every backend (the driver's epilogue) against float64; L is set where about a third of the gate
    and up products pass it, so that the clamp moves the result (checked against the unclamped MoE)."""
    experts, dense = make_experts(fmt, E, H, I, seed=5)
    x, ids, w = _inputs(23, seed=5)
    x *= 4
    limit = 1.5
    cfg = config(fmt)
    cfg.swiglu_limit = limit
    moe = MoE(cfg, experts, backend=backend, threads=2)
    got = moe(x, ids, w)
    assert nmse(got, moe_fp64(x, ids, w, *dense, swiglu_limit=limit)) <= 2e-5
    assert nmse(got, moe_fp64(x, ids, w, *dense)) > 1e-2
    assert moe.config.swiglu_limit == limit


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gelu_tanh_activation(backend, fmt):
    """MoeConfig.hidden_act "gelu_pytorch_tanh": gelu_tanh(gate) * up, Gemma 4's GeGLU experts, on every
    backend (the driver's epilogue) against float64, alone and under swiglu_limit; the gate products are
    about 2 on average, where the GELU is far from SiLU (checked against the SiLU MoE)."""
    experts, dense = make_experts(fmt, E, H, I, seed=6)
    x, ids, w = _inputs(23, seed=6)
    x *= 2
    cfg = config(fmt)
    cfg.hidden_act = "gelu_pytorch_tanh"
    got = MoE(cfg, experts, backend=backend, threads=2)(x, ids, w)
    assert nmse(got, moe_fp64(x, ids, w, *dense, hidden_act="gelu_pytorch_tanh")) <= 2e-5
    assert nmse(got, moe_fp64(x, ids, w, *dense)) > 1e-3
    cfg.swiglu_limit = 1.5
    clamped = MoE(cfg, experts, backend=backend, threads=2)(x, ids, w)
    assert nmse(clamped, moe_fp64(x, ids, w, *dense, swiglu_limit=1.5, hidden_act="gelu_pytorch_tanh")) <= 2e-5
    assert nmse(clamped, got) > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp8_per_channel", "fp8_block"])
def test_scales_up_to_the_limit_compute_and_larger_ones_are_refused(backend, fmt):
    """An expert scale may be as large as experts.MAX_SCALE (FLT_MAX / 256: the avx512 and avx2 kernels
    multiply their packed scales by 256) and every backend computes it; a larger one is refused when the
    ExpertWeights is built (avx512 and avx2 returned Inf, and NaN for a token of zeros)."""
    experts, dense = make_experts(fmt, E, H, I, seed=3)
    scale = experts.down_scale.copy()
    scale[1, 0, 0] = MAX_SCALE                # expert 1's first output row (first 64 x 64 block)
    huge = dataclasses.replace(experts, down_scale=scale)
    dense[2] = dense[2].copy()
    block = slice(0, 1) if fmt == "fp8_per_channel" else slice(0, 64)
    dense[2][1, block, block if fmt == "fp8_block" else slice(None)] *= MAX_SCALE / np.float64(experts.down_scale[1, 0, 0])
    x, ids, w = _inputs(5, seed=3)
    x *= 1e-8                                 # h about 1e-16: outputs about 1e24, finite
    x[4] = 0.0
    ids[:, 0] = 1
    got = MoE(config(fmt), huge, backend=backend)(x, ids, w)
    assert np.isfinite(got).all() and not got[4].any()
    assert nmse(got, moe_fp64(x, ids, w, *dense)) <= 2e-5
    scale[1, 0, 0] = np.nextafter(np.float32(MAX_SCALE), np.float32(np.inf))
    with pytest.raises(ValueError, match=r"ExpertWeights.down_scale holds .* at \[1, 0, 0\]; \|scale\| must be "
                                         r"at most 1.329e\+36 \(FLT_MAX / 256\)"):
        dataclasses.replace(experts, down_scale=scale)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_reference_gives_a_token_the_same_bits_whatever_the_batch(layer, dtype):
    """`reference` (the README says so) sums each token alone: a token's row of a 40-token call is the
    same token's one-token call, bit for bit.  The fast kernels choose their path by tokens per expert
    and may differ in the last bits."""
    fmt, cfg, experts, _ = layer
    x, ids, w = _inputs(40, seed=4)
    x = x.astype(dtype)
    moe = MoE(cfg, experts, backend="reference")
    y = moe(x, ids, w)
    for t in range(40):
        np.testing.assert_array_equal(moe(x[t:t + 1], ids[t:t + 1], w[t:t + 1])[0], y[t], err_msg=f"token {t}")


def test_concurrent_calls_match_serial_calls():
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=12)
    moe = MoE(config("fp8_per_channel"), experts)
    inputs = [_inputs(3 + i, seed=20 + i) for i in range(6)]
    serial = [moe(*args) for args in inputs]
    results = [None] * len(inputs)

    def work(i):
        for _ in range(5):
            results[i] = moe(*inputs[i])

    run_in_threads(work, [(i,) for i in range(len(inputs))])
    for got, want in zip(results, serial):
        np.testing.assert_array_equal(got, want)


def test_packed_fp8_weights_take_one_byte_each():
    Hs, Is = 256, 128  # tile-aligned, so no padding
    experts, _ = make_experts("fp8_per_channel", E, Hs, Is, seed=13)
    for backend in BACKENDS:
        moe = MoE(config("fp8_per_channel", hidden=Hs, inter=Is), experts, backend=backend)
        weights = E * 3 * Hs * Is
        assert weights <= moe.nbytes <= weights * 1.05, backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tiny", ["x", "h"])
def test_bf16_backends_read_subnormal_activations_as_zero(backend, tiny):
    """`vdpbf16ps` / `tdpbf16ps` read BF16 denormals as zero whatever MXCSR says (as the README says), so
    the BF16 backends (and their emulated twins) give 0 for a token whose x, or whose SiLU product h, is
    below 2^-126; the FP32 backends compute it.  One expert, every weight 1.0 (code 0x38), H = I = 32:
    x = 1e-39, gate/up scale 1e30 gives g = u = 3.2e-8 and y = 32 silu(g) u; x = 1, gate/up scale 1.4e-21,
    down 1e30 gives h about 1e-39 (an FP32 denormal with 20 bits: the FP32 backends keep it)."""
    n, x_value, in_scale, down_scale = (32, 1e-39, 1e30, 1.0) if tiny == "x" else (32, 1.0, 1.4e-21, 1e30)
    codes = np.full((1, n, n), 0x38, np.uint8)
    scale = lambda v: np.full((1, n, 1), v, np.float32)      # noqa: E731
    experts = ktfp8.ExpertWeights("fp8_per_channel", codes, codes, codes, scale(in_scale), scale(in_scale),
                                  scale(down_scale))
    x = np.full((1, n), x_value, np.float32)
    y = MoE(config("fp8_per_channel", 1, n, n, 1), experts, backend=backend)(
        x, np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32))
    dense = [np.ones((1, n, n)) * s for s in (np.float32(in_scale), np.float32(in_scale), np.float32(down_scale))]
    expected = moe_fp64(x, np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32), *dense)
    assert 0 < abs(expected[0, 0]) and np.isfinite(expected).all()
    if kernel(backend).act == BF16:
        assert not y.any()
    else:
        np.testing.assert_allclose(y, expected, rtol=1e-3)


def test_backend_is_best_available_and_env_forces_one(monkeypatch, layer):
    _, cfg, experts, _ = layer
    monkeypatch.delenv("KTFP8_BACKEND", raising=False)
    assert MoE(cfg, experts).backend == ktfp8.available_backends()[0]
    monkeypatch.setenv("KTFP8_BACKEND", "reference")
    assert MoE(cfg, experts).backend == "reference"
    monkeypatch.setenv("KTFP8_BACKEND", "no_such_kernel")
    with pytest.raises(ValueError, match="KTFP8_BACKEND.*usable backends: .*reference") as refused:
        MoE(cfg, experts)
    # the backends available_backends() names, then the test-only twins apart (they were listed among them)
    listed = str(refused.value).split("usable backends: ")[1]
    assert listed.split(" (and, for tests, the emulated twins ")[0] == ", ".join(ktfp8.available_backends())


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


def test_ktransformers_named_class_where_the_os_has_not_enabled_avx512(monkeypatch):
    """A CPU with every AVX-512 flag whose OS leaves AVX-512 state off in XCR0: the message blames the
    OS, not the CPU (it used to say 'this CPU lacks os_avx512')."""
    from ktfp8 import moe as moe_mod
    monkeypatch.setattr(moe_mod, "_NATIVE_BACKENDS", [])
    features = dict.fromkeys(moe_mod._AVX512_BF16_FLAGS, 1)
    features["os_avx512"] = 0
    monkeypatch.setattr(moe_mod.backends, "cpu_features", lambda: features)
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=14)
    with pytest.raises(RuntimeError) as e:
        moe_mod.AMXFP8PerChannel_MOE(config("fp8_per_channel"), experts)
    assert "this CPU lacks" not in str(e.value) and "did not compile" not in str(e.value)
    assert "OS" in str(e.value) and "XCR0" in str(e.value)


def test_ktransformers_named_classes_follow_ktfp8_backend(monkeypatch):
    """$KTFP8_BACKEND naming a native path (or its emulated twin) is the class's backend; naming another
    is refused by name rather than ignored (it was ignored: the class ran its own choice)."""
    from ktfp8 import moe as moe_mod
    monkeypatch.setattr(moe_mod, "_NATIVE_BACKENDS", ["avx512_bf16_emulated"])   # as on a CPU that runs them
    experts, dense = make_experts("fp8_per_channel", E, H, I, seed=14)
    cls = moe_mod.AMXFP8PerChannel_MOE
    monkeypatch.setenv("KTFP8_BACKEND", "amx_emulated")
    m = cls(config("fp8_per_channel"), experts)
    assert m.backend == "amx_emulated"
    x, ids, w = _inputs(3)
    assert nmse(m(x, ids, w), moe_fp64(x, ids, w, *dense)) <= 2e-5
    monkeypatch.setenv("KTFP8_BACKEND", "avx2")
    with pytest.raises(ValueError, match="KTFP8_BACKEND='avx2': AMXFP8PerChannel_MOE runs the amx or avx512_bf16"):
        cls(config("fp8_per_channel"), experts)
    monkeypatch.delenv("KTFP8_BACKEND")
    assert cls(config("fp8_per_channel"), experts).backend == "avx512_bf16_emulated"


def test_ktransformers_named_classes_check_their_inputs(monkeypatch):
    """As on a CPU with the native kernels (their emulated build here): wrong types and another format
    are refused by name, and the class runs the emulated kernel's sums."""
    from ktfp8 import moe as moe_mod
    monkeypatch.setattr(moe_mod, "_NATIVE_BACKENDS", ["avx512_bf16_emulated"])
    experts, dense = make_experts("fp8_per_channel", E, H, I, seed=14)
    cls = moe_mod.AMXFP8PerChannel_MOE
    with pytest.raises(TypeError, match="experts must be ktfp8.ExpertWeights, got NoneType"):
        cls(config("fp8_per_channel"), None)
    with pytest.raises(TypeError, match="config must be a ktfp8.MoeConfig, got dict"):
        cls({}, experts)
    with pytest.raises(ValueError, match="AMXFP8_MOE takes 'fp8_block' experts, got 'fp8_per_channel'"):
        moe_mod.AMXFP8_MOE(config("fp8_per_channel"), experts)
    m = cls(config("fp8_per_channel"), experts)
    x, ids, w = _inputs(3)
    assert m.backend == "avx512_bf16_emulated"
    np.testing.assert_array_equal(m(x, ids, w), MoE(config("fp8_per_channel"), experts,
                                                    backend="avx512_bf16_emulated")(x, ids, w))
    assert nmse(m(x, ids, w), moe_fp64(x, ids, w, *dense)) <= 2e-5


def test_moe_forward_functional_form(layer):
    fmt, cfg, experts, dense = layer
    x, ids, w = _inputs(4, seed=15)
    y = ktfp8.moe_forward(x, experts, ids, w, config=cfg)
    np.testing.assert_array_equal(y, MoE(cfg, experts)(x, ids, w))
    # the call's threads= (API.md: a call's thread count is its own threads= first); results do not
    # depend on the count, so the refusal of a bad one shows that it reaches the layer
    np.testing.assert_array_equal(ktfp8.moe_forward(x, experts, ids, w, config=cfg, threads=1), y)
    with pytest.raises(ValueError, match="threads must be a positive int or None, got 0"):
        ktfp8.moe_forward(x, experts, ids, w, config=cfg, threads=0)


def test_forward_with_router_logits(layer):
    fmt, cfg, experts, dense = layer
    rng = np.random.default_rng(16)
    x = rng.standard_normal((5, H)).astype(np.float32)
    logits = rng.standard_normal((5, E)).astype(np.float32)
    moe = MoE(cfg, experts)
    ids, w = ktfp8.route(logits, cfg)
    np.testing.assert_array_equal(moe.forward(x, router_logits=logits), moe(x, ids, w))


def test_config_changed_after_building_does_not_reach_the_layer(layer):
    """One MoeConfig reused for the next layer, or edited: a built MoE keeps the sizes and routing it
    was built with (before, a larger expert_num let ids past the layer's experts through, skipped)."""
    fmt, _, experts, dense = layer
    cfg = config(fmt)
    moe = MoE(cfg, experts)
    rng = np.random.default_rng(17)
    x, ids, w = _inputs(5, seed=17)
    logits = rng.standard_normal((5, E)).astype(np.float32)
    routed, called = moe.forward(x, router_logits=logits), moe(x, ids, w)
    cfg.expert_num, cfg.num_experts_per_tok, cfg.norm_topk_prob = 2 * E, 1, False
    moe.config.expert_num = 2 * E                   # a copy: editing it changes nothing either
    assert moe.config.expert_num == E and moe.config.num_experts_per_tok == K
    np.testing.assert_array_equal(moe.forward(x, router_logits=logits), routed)
    np.testing.assert_array_equal(moe(x, ids, w), called)
    with pytest.raises(ValueError, match=f"expert id {E} >= expert_num {E}"):
        moe(x, np.where(ids == ids.max(), E, ids), w)


def test_copies_share_the_packed_weights_and_own_their_settings(layer):
    """copy.copy and copy.deepcopy (as copy.deepcopy(model) reaches a layer): the same outputs from
    the same packed bytes, and thread count, copy_to_cpu and config of their own."""
    import copy
    fmt, cfg, experts, dense = layer
    moe = MoE(cfg, experts, threads=2)
    x, ids, w = _inputs(9, seed=23)
    y = moe(x, ids, w)
    for twin in (copy.copy(moe), copy.deepcopy(moe)):
        assert twin.nbytes == moe.nbytes and np.shares_memory(twin._kernel.packed, moe._kernel.packed)
        twin.threads, twin.copy_to_cpu = 1, True
        assert moe.threads == 2 and moe.copy_to_cpu is False
        np.testing.assert_array_equal(twin(x, ids, w), y)
    deep = copy.deepcopy(moe)
    assert deep._config is not moe._config and deep.config.expert_num == E


def test_pickling_a_layer_is_refused_with_what_to_send_instead(layer):
    import pickle
    fmt, cfg, experts, dense = layer
    moe = MoE(cfg, experts)
    with pytest.raises(TypeError, match=r"MoE cannot be pickled: its weights are packed .*pickle its ExpertWeights"):
        pickle.dumps(moe)
    pickle.loads(pickle.dumps(experts))   # what to send instead does pickle


def test_numpy_integers_are_thread_counts(layer):
    """A thread count computed with NumPy (np.int64) is an int like any other, as MoeConfig takes it."""
    fmt, cfg, experts, dense = layer
    moe = MoE(cfg, experts, threads=np.int64(2))
    assert moe.threads == 2 and type(moe.threads) is int
    codes = ktfp8.fp8.encode(np.ones(4, np.float32), threads=np.int32(1))
    np.testing.assert_array_equal(codes, ktfp8.fp8.encode(np.ones(4, np.float32)))
