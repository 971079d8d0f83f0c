"""Tiny random models of transformers MoE families built from each family's own config class: its
defaults with small sizes, two layers, and per-layer lists cut to those layers, so that a family needs no
hand-written configuration.  Used for the families ktfp8.hf runs beyond hf_models.py's hand-made ones."""
import torch

from hf_models import spread_expert_rows

LAYERS = 2
# small sizes, set where a family's config class has the field and it is not None there (or it is one of
# EXPERT_COUNTS); LongCat-Flash gets zero-computation experts beside its routed ones (zero_expert_num)
TINY = dict(hidden_size=64, num_experts=8, n_routed_experts=8, num_local_experts=8, moe_num_experts=8,
            num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2, moe_k=2, moe_intermediate_size=32,
            intermediate_size=48, ffn_hidden_size=48, expert_ffn_hidden_size=32, shared_expert_intermediate_size=32,
            head_dim=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, n_group=2, topk_group=1,
            num_expert_group=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, qk_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_head_dim=16, linear_num_heads=4, first_k_dense_replace=0, num_dense_layers=0,
            moe_layer_start_index=0, max_position_embeddings=64, n_shared_experts=1, num_shared_experts=1,
            zero_expert_num=4, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
            attn_layer_offset=1, decoder_sparse_step=1, sliding_window=16)
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_tok", "n_shared_experts")


def _shrink(cfg):
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "num_layers", None)
    for key in ("num_hidden_layers", "num_layers"):
        if isinstance(getattr(cfg, key, None), int):
            setattr(cfg, key, LAYERS)
    for key, value in vars(cfg).copy().items():
        if isinstance(value, list) and layers and len(value) == layers:
            # a per-layer list: the last layer of each kind where it names kinds (attention and linear
            # attention, dense and sparse MLP: the first layers are often dense), else the last layers
            last = {v: i for i, v in enumerate(value)} if all(isinstance(v, str) for v in value) else {}
            picked = sorted(last.values())[-LAYERS:] if len(last) > 1 else range(layers - LAYERS, layers)
            setattr(cfg, key, [value[i] for i in picked])
    if isinstance(getattr(cfg, "mlp_only_layers", None), list):
        cfg.mlp_only_layers = []
    if getattr(cfg, "pad_token_id", None) is not None:
        cfg.pad_token_id = 0
    for key, value in TINY.items():
        # a None elsewhere may mean "off" (no q LoRA, no indexer); an expert count of None means "set me".
        # Read from vars: Gemma 4's config refuses getattr of a field that may differ by layer (head_dim)
        if key in vars(cfg) and not isinstance(vars(cfg)[key], (list, dict)) and (
                vars(cfg)[key] is not None or key in EXPERT_COUNTS):
            setattr(cfg, key, value)
    if getattr(cfg, "qk_rope_head_dim", None) is not None and "head_dim" in vars(cfg):
        cfg.head_dim = cfg.qk_rope_head_dim          # multi-head latent attention: head_dim is the rope part


# what a family's config class refuses otherwise (LFM2-MoE's layer kinds have no default; Gemma 4's and
# DiffusionGemma's experts are off by default, their sizes None); a SwiGLU clamp that bites at these sizes (gate and up
# products of a few tenths)
# (and attention layers that do not share the indexer of a layer cut away)
OVERRIDES = {"zaya": dict(num_experts_per_tok=1),
             "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
             "gemma4_text": dict(enable_moe_block=True, top_k_experts=2, moe_intermediate_size=32,
                                 vocab_size_per_layer_input=128, hidden_size_per_layer_input=16),
             "diffusion_gemma_text": dict(top_k_experts=2, moe_intermediate_size=32),
             "axk2": dict(num_key_value_heads=4), "glm_moe_dsa": dict(num_key_value_heads=4),
             "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16,
                                      layer_types=["linear_attention", "full_attention"]),
             "kolibri1_1": dict(layer_types=["sliding_attention", "indexed_attention"], index_layers=[1],
                                kv_source_layers=[0, 1], index_num_heads=2, index_topk=4),
             # (its text and vision experts' widths, of which its blocks pass one to the experts)
             "ernie4_5_vl_moe_text": dict(moe_intermediate_size=[32, 16]),
             "hy_v4": dict(swiglu_limit=0.05, indexer_types=["full"] * 2),
             "deepseek_v4": dict(swiglu_limit=0.05, layer_types=["heavily_compressed_attention"] * 2,
                                 mlp_layer_types=["moe"] * 2)}


# what must be given to a family's config class when it is made: Gemma 4's derives per-layer fields from
# its layer kinds then (set afterwards, they would disagree)
CONSTRUCTED = {"gemma4_text": dict(num_hidden_layers=LAYERS, layer_types=["sliding_attention", "full_attention"])}


def tiny_config(model_type):
    """The transformers config of `model_type` at its class defaults, made tiny (its text config too)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config = CONFIG_MAPPING[model_type](**CONSTRUCTED.get(model_type, {}))
    text = config.get_text_config()
    for cfg in [config] + ([text] if text is not config else []):
        _shrink(cfg)
        for key, value in OVERRIDES.get(model_type, {}).items():
            setattr(cfg, key, value)
    return config


def build_family_model(model_type, seed=0):
    """A random float32 causal LM of `model_type` (eval mode), expert rows scaled apart like trained
    ones (as hf_models.build_model does)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return spread_expert_rows(AutoModelForCausalLM.from_config(tiny_config(model_type)).eval())


def build_gemma4_vision_language_model(seed=0):
    """A random float32 Gemma 4 vision-language model (Gemma4ForConditionalGeneration, the class of its
    released checkpoints: their experts under model.language_model.): the tiny gemma4_text model as its
    text model, a one-layer vision tower (whose weights the converter copies), no audio tower."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config = CONFIG_MAPPING["gemma4"]()
    config.text_config = tiny_config("gemma4_text")
    config.vision_config = config.sub_configs["vision_config"](
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, position_embedding_size=64)
    torch.manual_seed(seed)
    return spread_expert_rows(AutoModelForImageTextToText.from_config(config).eval())
