"""ktfp8's results do not depend on the caller's floating-point mode.

A library built with -ffast-math (kt-kernel's extension is one) sets FTZ and DAZ in MXCSR when it is
loaded, which flushes subnormals to zero.  E4M3's subnormal codes come from and decode to float
subnormals, so every kernel must run in IEEE mode on each of its threads and hand the caller's mode
back.  The expected values are computed in IEEE mode by ml_dtypes (the oracle never calls ktfp8)."""
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from ktfp8 import backends, fp8
from ktfp8._native import _ext

DAZ_FTZ = 0x0040 | 0x8000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fast_math_mode():
    """This thread in FTZ + DAZ, as after loading a -ffast-math library; restored afterwards."""
    before = _ext.mxcsr()
    _ext.set_mxcsr(before | DAZ_FTZ)
    try:
        yield before | DAZ_FTZ
    finally:
        _ext.set_mxcsr(before)


def _subnormal_inputs():
    """float32 values whose E4M3 codes are subnormal (|x| < 2^-6), plus float32 subnormals."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 2.0**-8).astype(np.float32)
    x[:16] = np.float32(2.0**-130) * np.arange(16)  # float32 subnormals: they encode to zero
    return x


def _oracle_codes(x):
    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


@pytest.mark.parametrize("backend", backends.usable_variants())
def test_codec_ignores_the_callers_ftz_daz(backend, fast_math_mode):
    _ext.set_mxcsr(fast_math_mode & ~DAZ_FTZ)  # inputs and expected values in IEEE mode
    x = _subnormal_inputs()
    expected_codes = _oracle_codes(x)
    expected_values = expected_codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(2.0**-10)
    _ext.set_mxcsr(fast_math_mode)
    codes = fp8.encode(x, backend=backend, threads=2)
    assert (codes & 0x7F).any() and ((codes & 0x78) == 0).any(), "no subnormal codes: the test lost its point"
    np.testing.assert_array_equal(codes, expected_codes)
    scale = np.full((1, 1), 2.0**-10, np.float32)  # subnormal E4M3 times this lands on float subnormals
    values = fp8.dequantize(codes.reshape(1, -1), scale, backend=backend, threads=2).ravel()
    np.testing.assert_array_equal(values.view(np.uint32), expected_values.view(np.uint32))
    assert _ext.mxcsr() & DAZ_FTZ == DAZ_FTZ, "the caller's mode must be handed back"


def test_worker_threads_started_in_fast_math_mode_still_compute_in_ieee():
    """OpenMP workers inherit the mode of the thread that starts them: start them in FTZ + DAZ."""
    script = textwrap.dedent("""
        import numpy as np, ml_dtypes
        from ktfp8 import fp8, backends
        from ktfp8._native import _ext
        ieee = _ext.mxcsr()
        _ext.set_mxcsr(ieee | 0x8040)  # before the first parallel region: workers are born flushing
        x = (np.random.default_rng(1).standard_normal(1 << 20) * 2.0**-9).astype(np.float32)
        codes, scale = fp8.quantize(x.reshape(256, -1), per_channel=True, threads=4)
        _ext.set_mxcsr(ieee)
        expected = np.clip(x.reshape(256, -1) / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        assert np.array_equal(codes, expected.view(np.uint8)), "subnormal codes flushed"
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("backend", backends.usable_variants())
def test_moe_forward_ignores_the_callers_ftz_daz(backend, fast_math_mode):
    """Gate and up weights whose dequantized values (and scales) are float subnormals, met by huge
    activations so that the products are normal: under DAZ they would all read as zeros."""
    from moe_oracle import make_experts, random_routing
    from ktfp8.experts import ExpertWeights
    from ktfp8.moe import MoE
    import ktfp8
    _ext.set_mxcsr(fast_math_mode & ~DAZ_FTZ)  # inputs and expected output in IEEE mode
    experts, _ = make_experts("fp8_per_channel", 4, 64, 32, seed=5)
    tiny = [s * np.float32(2.0**-120) for s in (experts.gate_scale, experts.up_scale)]
    assert 0 < min(t.min() for t in tiny) and max(t.max() for t in tiny) < np.finfo(np.float32).tiny
    experts = ExpertWeights("fp8_per_channel", experts.gate, experts.up, experts.down, *tiny, experts.down_scale)
    cfg = ktfp8.MoeConfig(expert_num=4, num_experts_per_tok=2, hidden_size=64, intermediate_size=32)
    cfg.quant_config.method, cfg.quant_config.per_channel, cfg.quant_config.group_size = "FP8", True, 0
    x = (np.random.default_rng(2).standard_normal((3, 64)) * 2.0**110).astype(np.float32)
    ids, w = random_routing(3, 4, 2, seed=6)
    expected = MoE(cfg, experts, backend=backend, threads=2)(x, ids, w)
    _ext.set_mxcsr(fast_math_mode)
    got = MoE(cfg, experts, backend=backend, threads=2)(x, ids, w)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 1e-30
    np.testing.assert_array_equal(got, expected)


def test_route_ignores_the_callers_ftz_daz(fast_math_mode):
    """Softmax weights of experts far behind the best are float subnormals (exp(-95) ~ 5e-42); the
    oracle is float64 softmax rounded to float32, computed in IEEE mode."""
    import ktfp8
    cfg = ktfp8.MoeConfig(expert_num=4, num_experts_per_tok=3, hidden_size=8, intermediate_size=8)
    logits = np.array([[0.0, -95.0, -96.0, -200.0], [-93.0, 0.0, -97.0, -99.5]], np.float32)
    _ext.set_mxcsr(fast_math_mode & ~DAZ_FTZ)
    e = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    expected = np.sort(e / e.sum(axis=1, keepdims=True), axis=1)[:, ::-1][:, :3].astype(np.float32)
    assert ((expected > 0) & (expected < np.finfo(np.float32).tiny)).any(), "no subnormal weight: no point"
    _ext.set_mxcsr(fast_math_mode)
    ids, weights = ktfp8.route(logits, cfg)
    assert _ext.mxcsr() & DAZ_FTZ == DAZ_FTZ, "the caller's mode must be handed back"
    np.testing.assert_allclose(weights, expected, rtol=1e-5, atol=0)
    np.testing.assert_array_equal(ids, [[0, 1, 2], [1, 0, 2]])
