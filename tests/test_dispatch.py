"""The variant registry: resolved once from include/ktfp8/variants.def, test-only code kept apart.

`import ktfp8` and a MoE call never load the test module (ktfp8._native._testing); forcing an
*_emulated variant by name loads it; a level is usable exactly when this CPU has what the table says
it needs (CPUID, the oracle here, read independently of ktfp8 through /proc/cpuinfo-free means: the
features dict is compared against the table's own requirement lists)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ktfp8
from ktfp8 import backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, **env):
    full = {k: v for k, v in os.environ.items() if k != "KTFP8_BACKEND"}
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          cwd=ROOT, env=full, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


MOE_CALL = """
    import sys
    import numpy as np
    import ktfp8
    cfg = ktfp8.MoeConfig(expert_num=4, num_experts_per_tok=2, hidden_size=32, intermediate_size=16)
    rng = np.random.default_rng(0)
    w = [rng.standard_normal(s).astype(np.float32) for s in ((4, 16, 32), (4, 16, 32), (4, 32, 16))]
    moe = ktfp8.MoE(cfg, ktfp8.quantize_experts(*w, cfg.quant_config), threads=1)
    y = moe(np.ones((2, 32), np.float32), np.array([[0, 1], [2, 3]]), np.full((2, 2), 0.5, np.float32))
    ktfp8.fp8.decode(ktfp8.fp8.encode(np.ones(8, np.float32)))
    ktfp8.route(np.ones((1, 4), np.float32), cfg)
    print(moe.backend, "ktfp8._native._testing" in sys.modules)
"""


def test_import_and_a_moe_call_leave_the_test_module_out():
    backend, loaded = run(MOE_CALL).split()
    assert backend == ktfp8.available_backends()[0]
    assert loaded == "False"


def test_forcing_an_emulated_variant_loads_the_test_module():
    if "avx512_emulated" not in backends.usable_variants():
        pytest.skip("this build has no emulated variants (KTFP8_ENABLE_EMULATED=OFF or no SIMDe)")
    backend, loaded = run(MOE_CALL, KTFP8_BACKEND="avx512_emulated").split()
    assert (backend, loaded) == ("avx512_emulated", "True")


def test_emulated_variants_are_never_chosen_automatically():
    assert not any(name.endswith("_emulated") for name in ktfp8.available_backends())
    assert backends.variant(None).name == ktfp8.available_backends()[0]


def test_a_level_is_usable_exactly_when_the_cpu_has_what_it_needs():
    features = ktfp8.cpu_features()
    levels = backends.isa_levels()
    assert list(levels)[-1] == "avx2" and "avx512bf16" in levels
    for level, (needs, usable) in levels.items():
        has_all = all(features[name] for name in needs)
        if "os_amx" in needs:  # tiles also need Linux's permission: usable implies the hardware
            assert not usable or has_all, level
        else:
            assert usable == has_all, level
    # the AVX-512-BF16 unit is compiled with -mavx512vbmi: its level must need VBMI
    assert "avx512_vbmi" in levels["avx512bf16"][0]
    # a level needs everything the level it extends needs
    assert set(levels["avx512"][0]) >= set(levels["avx2"][0])
    assert set(levels["amx"][0]) >= set(levels["avx512bf16"][0]) >= set(levels["avx512"][0])


def test_each_variant_runs_on_its_level():
    levels = backends.isa_levels()
    for name in backends.compiled_variants():
        v = backends._NATIVE.get(name) or backends._emulated_variants()[name]
        assert v.usable == (v.isa == "none" or levels[v.isa][1]), name
        assert v.emulated == name.endswith("_emulated")


def test_a_variant_the_cpu_cannot_run_is_refused_by_name():
    unusable = [n for n in backends.compiled_variants() if n not in backends.usable_variants()]
    if not unusable:
        pytest.skip("this CPU runs every compiled variant")
    with pytest.raises(ValueError, match=f"backend='{unusable[0]}' is compiled but this CPU/OS cannot run it"):
        ktfp8.fp8.encode(np.zeros(4, np.float32), backend=unusable[0])


def test_the_seam_refuses_buffers_of_the_wrong_size():
    """The seam trusts ktfp8.moe's validation but still never reads or writes past a buffer."""
    from ktfp8._native import _ext
    v = backends.variant("reference")
    E, H, I = 2, 32, 16
    shape = (E, H, I, _ext.ktfp8_wformat.KTFP8_FMT_FP8_CHANNEL, 0, 0)
    codes = [np.zeros((E, I, H), np.uint8), np.zeros((E, I, H), np.uint8), np.zeros((E, H, I), np.uint8)]
    scales = [np.ones((E, I, 1), np.float32), np.ones((E, I, 1), np.float32), np.ones((E, H, 1), np.float32)]
    with pytest.raises(ValueError, match=r"gate must be \[2, 16, 32\] of 1-byte elements"):
        _ext.PackedMoE(v, shape, codes[0][:, :, 1:].copy(), *codes[1:], *scales, 1)
    with pytest.raises(ValueError, match="gate must be .* with C-contiguous matrices"):   # rows not adjacent
        _ext.PackedMoE(v, shape, np.zeros((E, I, 2 * H), np.uint8)[:, :, ::2], *codes[1:], *scales, 1)
    with pytest.raises(ValueError, match=r"up\[1\] holds 496 bytes, expected 512"):
        _ext.PackedMoE(v, shape, codes[0], [codes[1][0], codes[1][1, :, 1:].copy()], codes[2], *scales, 1)
    with pytest.raises(TypeError, match="down must be an ndarray .* or a list of 2"):
        _ext.PackedMoE(v, shape, *codes[:2], list(codes[2][:1]), *scales, 1)
    kernel = _ext.PackedMoE(v, shape, *codes, *scales, 1)
    x, ids, w = np.ones((3, H), np.float32), np.zeros((3, 2), np.int64), np.ones((3, 2), np.float32)
    with pytest.raises(ValueError, match="y holds"):
        kernel.forward(x, ids, w, np.empty((2, H), np.float32), False, 0, 1)
    with pytest.raises(ValueError, match="y must be writeable"):
        y = np.empty_like(x)
        y.flags.writeable = False
        kernel.forward(x, ids, w, y, False, 0, 1)
    with pytest.raises(ValueError, match="topk_ids holds"):
        kernel.forward(x, ids[:2], w, np.empty_like(x), False, 0, 1)
