"""Tiny random Hugging Face MoE models written by `save_pretrained`: MODELS (Qwen3-MoE, DeepSeek-V3,
Mixtral) for the checkpoint tests, MORE_MODELS (Qwen2-MoE, DeepSeek-V2, OLMoE, GLM-4.5, MiniMax-M2,
GLM-4.7-Flash (glm4_moe_lite), DeepSeek-V3.2, MiniMax, Qwen3-Next, Ernie 4.5, Hunyuan-A13B, Qwen3.5-MoE)
for the ktfp8.hf tests, FUSED_MODELS (Mistral 4, also inside Mistral 3's vision-language wrapper, and
Qwen3-VL-MoE: experts stored fused, loaded with AutoModelForImageTextToText).
Sizes are small but not multiples of 128, so block-wise tails are exercised."""
import hashlib
import os

import numpy as np
import pytest

HIDDEN = 160
MOE_INTER = 96
EXPERTS = 4

# per model: (config class, model class, config kwargs, layers with routed experts,
#             expert tensor name of (layer, expert, role))
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
        num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True), [0, 1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16), [1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=MOE_INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2),
        [0, 1], "model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"),
}
MORE_MODELS = {
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=False), [0, 1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16), [1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=MOE_INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=EXPERTS, num_experts_per_tok=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0), [0, 1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=40, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True), [1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=MOE_INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=40, num_local_experts=EXPERTS,
        num_experts_per_tok=2, bos_token_id=1, eos_token_id=2), [0, 1],
        "model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.8,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16), [1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    # DeepSeek-V3 with its attention's token indexer
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        MODELS["deepseek_v3"][2], head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=2),
        [1], "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=MOE_INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=40, num_local_experts=EXPERTS,
        num_experts_per_tok=2, block_size=8), [0, 1],
        "model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=40, linear_conv_kernel_dim=4, linear_key_head_dim=24, linear_value_head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
        num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True), [0, 1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    # MoE from layer 1 on (moe_layer_start_index); a router bias (moe_statics) under softmax
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=40, moe_num_experts=EXPERTS,
        moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1), [1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    # Hunyuan-A13B's family: the experts' width is intermediate_size, top-k is moe_topk
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=MOE_INTER, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=40, num_experts=EXPERTS, moe_topk=2), [0, 1],
        "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    # the vision-language checkpoint (its layout on the Hub); AutoModelForCausalLM loads its text model
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(
        text_config=dict(
            vocab_size=128, hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, shared_expert_intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
            linear_conv_kernel_dim=4, linear_key_head_dim=24, linear_value_head_dim=24, linear_num_key_heads=2,
            linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"], num_experts=EXPERTS,
            num_experts_per_tok=2),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=HIDDEN,
                           num_position_embeddings=16)), [0, 1],
        "model.language_model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
}
ALL_MODELS = {**MODELS, **MORE_MODELS}
# checkpoints that hold each layer's routed experts fused, which ktfp8.convert splits (expert names: its
# output's); transformers 5.25 loads both with AutoModelForImageTextToText only
MISTRAL4 = dict(
    vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=2,
    topk_group=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=16, head_dim=16)
FUSED_MODELS = {
    # transformers' own layout, gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", MISTRAL4, [0, 1],
                 "model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
    # Mistral 4 as a vision-language model (Mistral Small 4's form): Mistral 3's wrapper, text_config mistral4
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
        text_config=dict(MISTRAL4, model_type="mistral4"),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=16, image_size=32, patch_size=16)), [0, 1],
        "language_model.model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),      # as transformers saves it
    # the vision-language model (its Hub checkpoints hold the experts transposed, [E, H, 2I] and [E, I, H];
    # transformers 5 saves them in its own layout, as for Mistral 4)
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", dict(
        text_config=dict(
            vocab_size=128, hidden_size=HIDDEN, intermediate_size=192, moe_intermediate_size=MOE_INTER,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=40, num_experts=EXPERTS,
            num_experts_per_tok=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                        mrope_section=[8, 6, 6])),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=HIDDEN,
                           num_position_embeddings=16, deepstack_visual_indexes=[0])), [0, 1],
        "model.language_model.layers.{l}.mlp.experts.{e}.{role}_proj.weight"),
}
_ANY_MODEL = {**ALL_MODELS, **FUSED_MODELS}
MIXTRAL_ROLE = {"gate": "w1", "up": "w3", "down": "w2"}


def build_model(kind, seed=0, **config_changes):
    """The random transformers model (float32, eval mode) of `kind`, its config's fields changed as
    `config_changes` says (e.g. moe_topk=[1, 3])."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, kwargs, _, _ = _ANY_MODEL[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**kwargs, **config_changes})
    return spread_expert_rows(getattr(transformers, model_cls)(config).eval())


def spread_expert_rows(model):
    """`model` with each expert weight row scaled by its own e^N(0, 1): init std 0.02 everywhere, where
    trained expert rows differ in scale."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name and p.ndim == 3:
                p.mul_(torch.exp(torch.randn(p.shape[0], p.shape[1], 1)))
    return model


def save_model(model, path, max_shard_size=None, dtype="bfloat16"):
    import torch
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def expert_name(kind, layer, expert, role):
    template = _ANY_MODEL[kind][4]
    return template.format(l=layer, e=expert, role=role, w=MIXTRAL_ROLE[role])


def fuse_experts(tensors, kind, layers, transposed=False):
    """Edits {name: (dtype, array)} in place: the per-expert weights of each of `layers` become one
    `...experts.gate_up_proj` [E, 2I, H] and `...experts.down_proj` [E, H, I], as transformers 5 saves
    them (transposed: [E, H, 2I] and [E, I, H], as Qwen3-VL-MoE's Hub checkpoints hold them)."""
    for layer in layers:
        count = next(e for e in range(10**4) if expert_name(kind, layer, e, "gate") not in tensors)
        w = {role: [tensors.pop(expert_name(kind, layer, e, role)) for e in range(count)]
             for role in ("gate", "up", "down")}
        gate_up = np.stack([np.concatenate([g, u]) for (_, g), (_, u) in zip(w["gate"], w["up"])])
        down = np.stack([d for _, d in w["down"]])
        if transposed:
            gate_up, down = gate_up.transpose(0, 2, 1), down.transpose(0, 2, 1)
        stack = expert_name(kind, layer, 0, "gate").rsplit(".0.", 1)[0]
        tensors[stack + ".gate_up_proj"] = (w["gate"][0][0], np.ascontiguousarray(gate_up))
        tensors[stack + ".down_proj"] = (w["down"][0][0], np.ascontiguousarray(down))


def moe_layers(kind):
    return _ANY_MODEL[kind][3]


def read_experts(folder, kind, layer, role):
    """Expert weights [E, out, in] of `role` read with the safetensors library (the oracle), float32."""
    import torch
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, f)))
    names = []
    e = 0
    while expert_name(kind, layer, e, role) in tensors:
        names.append(expert_name(kind, layer, e, role))
        e += 1
    return torch.stack([tensors[n].float() for n in names]).numpy()


def folder_digest(folder):
    """{relative path: (sha256, size, mtime_ns)} of every file under `folder`."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            st = os.stat(path)
            with open(path, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
            out[os.path.relpath(path, folder)] = (digest, st.st_size, st.st_mtime_ns)
    return out


def sqnr_db(reference, approx):
    reference = np.asarray(reference, np.float64)
    err = reference - np.asarray(approx, np.float64)
    return 10 * np.log10(np.sum(reference ** 2) / np.sum(err ** 2))
