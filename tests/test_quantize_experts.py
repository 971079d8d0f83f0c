"""quantize_experts' quant_config and its BF16 range, against ktfp8.fp8.quantize and ml_dtypes."""
import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8 import fp8

E, I, H = 3, 16, 24


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(7)
    return [rng.standard_normal(s).astype(np.float32) for s in ((E, I, H), (E, I, H), (E, H, I))]


@pytest.mark.parametrize("fields", [{"method": "FP8"}, {"method": "FP8", "per_channel": False, "group_size": 8},
                                    {"method": "BF16"}])
def test_a_mapping_quantizes_as_the_quant_config_of_its_fields(weights, fields):
    """The mapping MoeConfig(quant_config=...) takes: the same codes and scales as fp8.quantize gives
    (or the same bfloat16 rounding as ml_dtypes), whatever holds the fields."""
    from_mapping = ktfp8.quantize_experts(*weights, dict(fields))
    from_config = ktfp8.quantize_experts(*weights, ktfp8.QuantConfig(**fields))
    assert from_mapping.format == from_config.format and from_mapping.block == from_config.block
    for role, w in zip(("gate", "up", "down"), weights):
        if fields["method"] == "BF16":
            expected = (w.astype(ml_dtypes.bfloat16), None)
        else:
            block = (fields["group_size"],) * 2 if "group_size" in fields else None
            expected = fp8.quantize(w, per_channel=block is None, block=block or (128, 128))
        for made in (from_mapping, from_config):
            np.testing.assert_array_equal(getattr(made, role), expected[0])
            if expected[1] is not None:
                np.testing.assert_array_equal(getattr(made, f"{role}_scale"), expected[1])


def _float32(bits):
    return np.array([bits], np.uint32).view(np.float32)[0]


# bfloat16's largest (0x7F7F), the float32 below its half step to 0x7F80 (Inf), the half step (rounds to
# even: Inf), 3.4e38 and FLT_MAX, either sign
@pytest.mark.parametrize("value", [_float32(0x7F7F0000), _float32(0x7F7F7FFF), _float32(0x7F7F8000), 3.4e38,
                                   np.finfo(np.float32).max, -3.4e38, _float32(0xFF7F7FFF)])
def test_bf16_keeps_what_bfloat16_holds_and_refuses_what_becomes_inf(weights, value):
    """A float32 weight is taken where ml_dtypes rounds it to a finite bfloat16 (up to bfloat16's largest
    and its half step below, rounding to even), refused where it rounds to Inf."""
    gate, up, down = (w.copy() for w in weights)
    up[1, 2, 3] = value
    finite = bool(np.isfinite(np.float32(value).astype(ml_dtypes.bfloat16)))
    if finite:
        made = ktfp8.quantize_experts(gate, up, down, {"method": "BF16"})
        assert made.up[1, 2, 3] == np.float32(value).astype(ml_dtypes.bfloat16)
    else:
        with pytest.raises(ValueError, match=r"up holds .* at \[1, 2, 3\], beyond bfloat16's largest finite value"):
            ktfp8.quantize_experts(gate, up, down, {"method": "BF16"})


def test_bf16_names_the_layers_index_of_a_shards_weight(weights):
    """experts=range(1, 3) quantizes experts 1 and 2: a weight beyond bfloat16's range in expert 2 is
    named as the layer's expert 2, as the NaN check names it."""
    gate, up, down = (w.copy() for w in weights)
    down[2, 0, 1] = 3.4e38
    with pytest.raises(ValueError, match=r"down holds .* at \[2, 0, 1\], beyond bfloat16's largest finite value"):
        ktfp8.quantize_experts(gate, up, down, {"method": "BF16"}, experts=range(1, 3))


def test_bf16_input_is_held_without_a_copy_and_packs_as_a_copy_would():
    """BF16 weights (a fused gate_up's halves, as ktfp8.hf hands them) were copied once more before
    MoE packed them: a third full-size copy of the experts at the peak of a model's preparation."""
    import tracemalloc
    e, i, h = 4, 256, 512
    rng = np.random.default_rng(5)
    gate_up = rng.standard_normal((e, 2 * i, h), np.float32).astype(ml_dtypes.bfloat16)   # 2 MiB
    gate, up = gate_up[:, :i], gate_up[:, i:]
    down = rng.standard_normal((e, h, i), np.float32).astype(ml_dtypes.bfloat16)
    tracemalloc.start()
    try:
        made = ktfp8.quantize_experts(gate, up, down, {"method": "BF16"}, experts=range(1, 3))
        allocated = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert allocated < 64 << 10, allocated         # a copy: 1.5 MiB
    assert np.shares_memory(made.gate, gate_up) and np.shares_memory(made.up, gate_up)
    assert np.shares_memory(made.down, down)
    copied = ktfp8.quantize_experts(*(np.ascontiguousarray(w) for w in (gate, up, down)), {"method": "BF16"},
                                    experts=range(1, 3))
    cfg = ktfp8.MoeConfig(expert_num=e, num_experts_per_tok=2, hidden_size=h, intermediate_size=i)
    cfg.quant_config.method = "BF16"
    x = rng.standard_normal((5, h), np.float32)
    ids, w = np.array([[1, 2]] * 5), np.full((5, 2), 0.5, np.float32)
    np.testing.assert_array_equal(ktfp8.MoE(cfg, made)(x, ids, w), ktfp8.MoE(cfg, copied)(x, ids, w))
