"""The whole MoE block against transformers' own modules, on the same (dequantized FP8) weights.

Each module is built from a tiny random config; its expert weights are quantized with ktfp8,
dequantized, and written back, so both sides compute the same layer.  Routing is ktfp8.route on
the router logits the module itself would compute."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ktfp8  # noqa: E402
from ktfp8 import backends  # noqa: E402
from moe_oracle import nmse  # noqa: E402

HIDDEN, INTER, EXPERTS, TOPK, TOKENS = 96, 40, 8, 2, 11


def _qwen3():
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                      num_experts_per_tok=TOPK, norm_topk_prob=True)
    return cfg, m.Qwen3MoeSparseMoeBlock(cfg)


def _mixtral():
    from transformers.models.mixtral import modeling_mixtral as m
    cfg = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                                     num_experts_per_tok=TOPK)
    return cfg, m.MixtralSparseMoeBlock(cfg)


def _deepseek_v3():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    cfg = transformers.DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS,
                                        num_experts_per_tok=TOPK, n_group=4, topk_group=2, n_shared_experts=1,
                                        routed_scaling_factor=2.5, norm_topk_prob=True)
    return cfg, m.DeepseekV3MoE(cfg)


MODELS = {"qwen3_moe": _qwen3, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3}


def _expert_params(block):
    """(gate, up, down) tensors of the module's experts, HF [E, out, in] layout."""
    ex = block.experts
    gate_up = ex.gate_up_proj
    return gate_up[:, :INTER, :], gate_up[:, INTER:, :], ex.down_proj


@pytest.mark.parametrize("backend", backends.usable_variants())
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("method", ["fp8_per_channel", "fp8_block", "bf16"])
def test_block_output_matches_transformers(model, backend, method):
    torch.manual_seed(0)
    hf_cfg, block = MODELS[model]()
    block.eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.copy_(torch.rand(EXPERTS) * 0.1)

    cfg = ktfp8.MoeConfig.from_hf_config(hf_cfg.to_dict())
    cfg.quant_config.method = "BF16" if method == "bf16" else "FP8"
    cfg.quant_config.per_channel = method != "fp8_block"
    cfg.quant_config.group_size = 32 if method == "fp8_block" else 0
    gate, up, down = (t.detach().numpy().astype(np.float32) for t in _expert_params(block))
    experts = ktfp8.quantize_experts(gate, up, down, cfg.quant_config)

    # the module computes on exactly the weights ktfp8 holds
    block_size = (32, 32) if method == "fp8_block" else (128, 128)
    with torch.no_grad():
        for name, target in zip(("gate", "up", "down"), _expert_params(block)):
            w = getattr(experts, name)
            if method == "bf16":
                deq = w.astype(np.float32)
            else:
                deq = ktfp8.fp8.dequantize(w, getattr(experts, name + "_scale"), block=block_size)
            target.copy_(torch.from_numpy(np.ascontiguousarray(deq)))

    x = torch.randn(1, TOKENS, HIDDEN)
    with torch.no_grad():
        want = block(x)[0]
        logits = torch.nn.functional.linear(x[0].float(), block.gate.weight.float()).numpy()
        if hasattr(block, "shared_experts"):
            want = want - block.shared_experts(x)[0]
    bias = getattr(block.gate, "e_score_correction_bias", None)
    ids, weights = ktfp8.route(logits, cfg, correction_bias=None if bias is None else bias.numpy())
    got = ktfp8.MoE(cfg, experts, backend=backend)(x[0].numpy(), ids, weights)
    assert nmse(got, want.numpy()) <= 2e-5
