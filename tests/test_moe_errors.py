"""Bad input to MoE answers with a clear exception naming the argument, never a crash."""
import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8.moe import MoE
from moe_oracle import make_experts

E, H, I, K = 4, 64, 32, 2


@pytest.fixture(scope="module")
def moe():
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    experts, _ = make_experts("fp8_per_channel", E, H, I)
    return MoE(cfg, experts)


def good(T=3):
    return (np.zeros((T, H), np.float32), np.zeros((T, K), np.int64), np.ones((T, K), np.float32))


CASES = [
    ("x float64", lambda x, i, w: (x.astype(np.float64), i, w), TypeError, "x must have dtype"),
    ("x 1-D", lambda x, i, w: (x[0], i, w), ValueError, "x must be 2-D"),
    ("x wrong hidden", lambda x, i, w: (np.zeros((3, H + 1), np.float32), i, w), ValueError, r"x must have shape"),
    ("x non-contiguous", lambda x, i, w: (np.zeros((3, 2 * H), np.float32)[:, ::2], i, w), ValueError,
     "x must be C-contiguous"),
    ("x list", lambda x, i, w: (x.tolist(), i, w), TypeError, "x must be a numpy array"),
    ("ids float", lambda x, i, w: (x, i.astype(np.float32), w), TypeError, "topk_ids must have dtype"),
    ("ids too large", lambda x, i, w: (x, i + E, w), ValueError, "expert id 4 >= expert_num 4"),
    ("top-k mismatch", lambda x, i, w: (x, i[:, :1].copy(), w[:, :1].copy()), ValueError,
     r"topk_ids must have shape \[T, num_experts_per_tok\]"),
    ("T mismatch", lambda x, i, w: (x, i[:2].copy(), w), ValueError, "topk_ids must have shape"),
    ("weights float64", lambda x, i, w: (x, i, w.astype(np.float64)), TypeError, "topk_weights must have dtype"),
    ("weights shape", lambda x, i, w: (x, i, w[:, :1].copy()), ValueError, "topk_weights must have shape"),
]


@pytest.mark.parametrize("name,mutate,exc,message", CASES, ids=[c[0] for c in CASES])
def test_bad_call(moe, name, mutate, exc, message):
    with pytest.raises(exc, match=message):
        moe(*mutate(*good()))


def test_out_must_match(moe):
    x, i, w = good()
    with pytest.raises(ValueError, match="out must have the shape of x"):
        moe(x, i, w, out=np.zeros((2, H), np.float32))
    with pytest.raises(TypeError, match="out must have dtype"):
        moe(x, i, w, out=np.zeros((3, H), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        moe(x, i, w, accumulate=True)
    ro = np.zeros((3, H), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        moe(x, i, w, out=ro)


def test_experts_must_match_config():
    experts, _ = make_experts("fp8_per_channel", E, H, I)
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H + 2, intermediate_size=I)
    with pytest.raises(ValueError, match="config says"):
        MoE(cfg, experts)
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    cfg.quant_config.method = "BF16"
    with pytest.raises(ValueError, match="'fp8_per_channel' but config.quant_config asks for 'bf16'"):
        MoE(cfg, experts)
    with pytest.raises(TypeError, match="experts must be ktfp8.ExpertWeights"):
        MoE(cfg, {"gate": 1})


def test_forward_needs_routing(moe):
    x, i, w = good()
    with pytest.raises(ValueError, match="router_logits"):
        moe.forward(x)
    with pytest.raises(ValueError, match="not both"):
        moe.forward(x, i, w, router_logits=np.zeros((3, E), np.float32))


def test_bad_expert_weights():
    from ktfp8.experts import ExpertWeights
    codes = np.zeros((E, I, H), np.uint8)
    down = np.zeros((E, H, I), np.uint8)
    s_in, s_out = np.ones((E, I, 1), np.float32), np.ones((E, H, 1), np.float32)
    with pytest.raises(ValueError, match="format must be one of"):
        ExpertWeights("int4", codes, codes, down, s_in, s_in, s_out)
    with pytest.raises(ValueError, match="ExpertWeights.down has shape"):
        ExpertWeights("fp8_per_channel", codes, codes, codes, s_in, s_in, s_out)
    with pytest.raises(TypeError, match="ExpertWeights.gate must be float8_e4m3fn or uint8"):
        ExpertWeights("fp8_per_channel", codes.astype(np.float32), codes, down, s_in, s_in, s_out)
    with pytest.raises(ValueError, match="ExpertWeights.up_scale has shape"):
        ExpertWeights("fp8_per_channel", codes, codes, down, s_in, s_out, s_out)
    with pytest.raises(ValueError, match="fp8_block needs block"):
        ExpertWeights("fp8_block", codes, codes, down, s_in, s_in, s_out)
