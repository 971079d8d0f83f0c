"""The gate activations ktfp8 computes, named as transformers names them: each name MoeConfig.from_hf_config
maps (config.HF_ACTIVATIONS) is, in transformers' ACT2FN, the function the float64 oracle writes from its
definition; ktfp8.hf tells an experts module's activation from its act_fn's values, and refuses the others."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ktfp8  # noqa: E402
from ktfp8.config import HF_ACTIVATIONS, HIDDEN_ACTS  # noqa: E402
from ktfp8.hf.experts import activation_of  # noqa: E402
from moe_oracle import gate_activation  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402

X = np.linspace(-20, 20, 4001)
# transformers' activations that are none of HIDDEN_ACTS, some close to one (exact GELU, GELU clipped at
# +-10, sigmoid's GELU approximation)
OTHERS = ("gelu", "gelu_10", "quick_gelu", "relu", "relu2", "mish", "tanh", "sigmoid", "linear")


class _Experts(torch.nn.Module):
    def __init__(self, act_fn):
        super().__init__()
        self.act_fn = act_fn


@pytest.mark.parametrize("name", sorted(HF_ACTIVATIONS))
def test_each_mapped_name_is_the_function_ktfp8_computes(name):
    got = ACT2FN[name](torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(got, gate_activation(X, HF_ACTIVATIONS[name]), rtol=1e-6, atol=1e-12)
    assert activation_of(_Experts(ACT2FN[name])) == HF_ACTIVATIONS[name]
    cfg = ktfp8.MoeConfig.from_hf_config(dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                              hidden_size=8, moe_intermediate_size=8, hidden_act=name))
    assert cfg.hidden_act == HF_ACTIVATIONS[name]


@pytest.mark.parametrize("name", OTHERS)
def test_other_activations_are_told_apart(name):
    assert activation_of(_Experts(ACT2FN[name])) is None
    with pytest.raises(ValueError, match=f"hidden_act '{name}' is not an activation ktfp8 computes"):
        ktfp8.MoeConfig.from_hf_config(dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                            hidden_size=8, moe_intermediate_size=8, hidden_act=name))


@pytest.mark.parametrize("act_fn, want", [
    (torch.nn.SiLU(inplace=True), "silu"),                                  # changes its input
    (lambda x: torch.nn.functional.silu(x).float(), "silu"),               # float32: within 1e-7
    (lambda x: torch.nn.functional.silu(x).half(), None),                  # float16: 1e-3 off
    (lambda x: x.sum(), None),                                              # not elementwise
])
def test_activation_read_off_odd_act_fns(act_fn, want):
    """An in-place act_fn was refused as SiLU (x changed before the reference was taken), one returning
    another dtype raised torch's RuntimeError instead of being told apart."""
    assert activation_of(_Experts(act_fn)) == want


def test_the_two_activations_differ_where_the_check_reads_them():
    """The values activation_of compares tell SiLU and the tanh GELU apart (a check that could fail)."""
    silu, gelu = (gate_activation(X, act) for act in HIDDEN_ACTS)
    assert np.abs(silu - gelu).max() > 0.1


def test_gemma_hidden_activation_and_an_override():
    """Gemma's config.json names it hidden_activation; hidden_act= given overrides a name ktfp8 refuses."""
    fields = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, hidden_size=8, moe_intermediate_size=8)
    assert ktfp8.MoeConfig.from_hf_config(dict(fields, hidden_activation="gelu_pytorch_tanh")).hidden_act == \
        "gelu_pytorch_tanh"
    assert ktfp8.MoeConfig.from_hf_config(dict(fields, hidden_act="relu"), hidden_act="silu").hidden_act == "silu"


def test_gemma4_router_is_refused_unless_routing_is_given():
    """Gemma 4's router multiplies by a learned per-expert scale that no MoeConfig field holds: from_hf_config
    says so, rather than route without it; with scoring_func given (routing then unused) it reads the sizes."""
    config = dict(model_type="gemma4_text", num_experts=8, top_k_experts=2, hidden_size=64, moe_intermediate_size=32,
                  hidden_activation="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="per-expert scale"):
        ktfp8.MoeConfig.from_hf_config(config)
    cfg = ktfp8.MoeConfig.from_hf_config(config, scoring_func="softmax")
    assert (cfg.expert_num, cfg.num_experts_per_tok, cfg.intermediate_size, cfg.hidden_act) == \
        (8, 2, 32, "gelu_pytorch_tanh")
