"""route() against transformers' own MoE blocks, plus its documented edge cases and input checks.

Each transformers block (tiny random config, torch CPU) runs on random hidden states; a forward hook
on its router captures the router logits, weights and expert ids the block really used. route() gets
those logits (and the block's e_score_correction_bias) and a MoeConfig made by from_hf_config from the
block's config; it must pick the same experts per token and the same weights to float32 rounding."""
import ml_dtypes
import numpy as np
import pytest

from ktfp8 import MoeConfig, route
from ktfp8 import config as config_module

T = 512           # tokens per check: enough rows for grouping / bias to change choices
WEIGHT_RTOL = 1e-6


def _torch_transformers():
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def _run_block(block, hidden_size, dtype=None, seed=0):
    """Random parameters, one forward of the whole block; returns what its router produced:
    logits as numpy (float32 / bfloat16 / float16 like the block's), weights float32, ids int64."""
    torch, _ = _torch_transformers()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            # gate weights give logits of std ~2: a spread like trained routers, no saturation
            std = 0.3 if name.startswith(("gate.", "router.")) else 0.05
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        if dtype is not None:
            block.to(dtype)
        hidden = torch.randn(1, T, hidden_size, generator=gen).to(dtype or torch.float32)
        seen = []
        router = block.gate if hasattr(block, "gate") else block.router      # AFMoE's, Granite's, Jamba's: router
        hook = router.register_forward_hook(lambda module, args, out: seen.append(out))
        block(hidden)
        hook.remove()
    if not (isinstance(seen[0], tuple) and len(seen[0]) == 3):
        pytest.skip("this transformers' routers do not return (logits, weights, ids); 5.x ones do")
    logits, weights, ids = seen[0]
    if logits.dtype == torch.bfloat16:
        logits_np = logits.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        logits_np = logits.numpy()
    return logits_np, weights.float().numpy(), ids.numpy().astype(np.int64)


def _assert_same_routing(ids, weights, hf_ids, hf_weights, rtol=WEIGHT_RTOL, tie_scores=None):
    """Same expert set per token (order within a row is free: DeepSeek's topk is unsorted) and the
    same weight per chosen expert. With tie_scores [T, E], a token may instead choose other experts
    of exactly equal score (torch.topk breaks ties its own way); its weights are then compared in
    score order. Returns the largest absolute weight difference."""
    assert ids.shape == hf_ids.shape and weights.shape == hf_weights.shape
    mine, theirs = np.argsort(ids, axis=1), np.argsort(hf_ids, axis=1)
    ids, weights = np.take_along_axis(ids, mine, 1), np.take_along_axis(weights, mine, 1)
    hf_ids, hf_weights = np.take_along_axis(hf_ids, theirs, 1), np.take_along_axis(hf_weights, theirs, 1)
    differ = (ids != hf_ids).any(axis=1)
    if tie_scores is not None and differ.any():
        scores = tie_scores.astype(np.float32)[differ]
        chosen, hf_chosen = np.take_along_axis(scores, ids[differ], 1), np.take_along_axis(scores, hf_ids[differ], 1)
        np.testing.assert_array_equal(np.sort(chosen, 1), np.sort(hf_chosen, 1))   # only tied swaps
        weights, hf_weights = weights.copy(), hf_weights.copy()
        weights[differ] = np.take_along_axis(weights[differ], np.argsort(chosen, 1, kind="stable"), 1)
        hf_weights[differ] = np.take_along_axis(hf_weights[differ], np.argsort(hf_chosen, 1, kind="stable"), 1)
    else:
        np.testing.assert_array_equal(ids, hf_ids)
    np.testing.assert_allclose(weights, hf_weights, rtol=rtol, atol=1e-7)
    return float(np.abs(weights - hf_weights).max())


def _changed_rows(a, b):
    return int((np.sort(a, axis=1) != np.sort(b, axis=1)).any(axis=1).sum())


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_moe(norm_topk_prob):
    _, t = _torch_transformers()
    hf = t.Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=8,
                          norm_topk_prob=norm_topk_prob, num_attention_heads=4, num_key_value_heads=4)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    logits, hf_w, hf_ids = _run_block(Qwen3MoeSparseMoeBlock(hf), 32)
    cfg = MoeConfig.from_hf_config(hf)
    assert cfg.norm_topk_prob == norm_topk_prob
    _assert_same_routing(*route(logits, cfg), hf_ids, hf_w)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe(norm_topk_prob):
    _, t = _torch_transformers()
    hf = t.Qwen2MoeConfig(hidden_size=32, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=8,
                          shared_expert_intermediate_size=8, norm_topk_prob=norm_topk_prob,
                          num_attention_heads=4, num_key_value_heads=4)
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    logits, hf_w, hf_ids = _run_block(Qwen2MoeSparseMoeBlock(hf), 32)
    _assert_same_routing(*route(logits, MoeConfig.from_hf_config(hf)), hf_ids, hf_w)


def test_mixtral():
    _, t = _torch_transformers()
    hf = t.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2, intermediate_size=8,
                         num_attention_heads=4, num_key_value_heads=4)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    logits, hf_w, hf_ids = _run_block(MixtralSparseMoeBlock(hf), 32)
    _assert_same_routing(*route(logits, MoeConfig.from_hf_config(hf)), hf_ids, hf_w)


@pytest.mark.parametrize("topk_method, scaling", [("greedy", 1.0), ("group_limited_greedy", 16.0)])
def test_deepseek_v2(topk_method, scaling):
    _, t = _torch_transformers()
    if not hasattr(t, "DeepseekV2Config"):
        pytest.skip("no DeepseekV2 in this transformers")
    hf = t.DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=8,
                            n_shared_experts=1, n_group=4, topk_group=2, topk_method=topk_method,
                            routed_scaling_factor=scaling, num_attention_heads=4, num_key_value_heads=4)
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    logits, hf_w, hf_ids = _run_block(DeepseekV2Moe(hf), 32)
    cfg = MoeConfig.from_hf_config(hf)
    ids, w = route(logits, cfg)
    _assert_same_routing(ids, w, hf_ids, hf_w)
    if topk_method == "group_limited_greedy":   # the group limit really changed choices
        cfg.topk_group, cfg.n_group = 1, 1       # topk_group first: each step stays valid
        assert _changed_rows(route(logits, cfg)[0], ids) > 0


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3(norm_topk_prob):
    torch, t = _torch_transformers()
    hf = t.DeepseekV3Config(hidden_size=32, n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=8,
                            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            norm_topk_prob=norm_topk_prob, num_attention_heads=4, num_key_value_heads=4)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    block = DeepseekV3MoE(hf)
    bias = np.random.default_rng(1).uniform(-0.3, 0.3, 32).astype(np.float32)
    block.gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
    logits, hf_w, hf_ids = _run_block(block, 32)
    cfg = MoeConfig.from_hf_config(hf)
    assert (cfg.scoring_func, cfg.n_group, cfg.topk_group) == ("sigmoid", 4, 2)
    ids, w = route(logits, cfg, correction_bias=bias)
    _assert_same_routing(ids, w, hf_ids, hf_w)
    # Not vacuous: the bias and the group limit each change the choice for some tokens.
    assert _changed_rows(route(logits, cfg)[0], ids) > 0
    cfg.topk_group, cfg.n_group = 1, 1
    assert _changed_rows(route(logits, cfg, correction_bias=bias)[0], ids) > 0


def test_qwen3_vl_moe_text_config():
    """Multimodal: the MoE sizes live in text_config; its router always renormalises."""
    _, t = _torch_transformers()
    if not hasattr(t, "Qwen3VLMoeConfig"):
        pytest.skip("no Qwen3-VL-MoE in this transformers")
    hf = t.Qwen3VLMoeConfig(text_config=dict(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                             moe_intermediate_size=8, num_attention_heads=4,
                                             num_key_value_heads=4))
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock
    logits, hf_w, hf_ids = _run_block(Qwen3VLMoeTextSparseMoeBlock(hf.text_config), 32)
    _assert_same_routing(*route(logits, MoeConfig.from_hf_config(hf)), hf_ids, hf_w)


# families whose published config.json holds their text model's fields at the top level, under the outer
# model_type -> that text model's type (whose block the check builds)
FLAT_TEXT_CONFIGS = {"dots3_note": "dots3_note_text"}


def _family_block(family, **fields):
    """(transformers config of `family` at its class defaults but tiny sizes and `fields`, that family's
    MoE block)."""
    torch, _ = _torch_transformers()
    import importlib
    import inspect
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    family = FLAT_TEXT_CONFIGS.get(family, family)
    if family not in CONFIG_MAPPING:
        pytest.skip(f"no {family} in this transformers")
    hf = CONFIG_MAPPING[family]()
    tiny = dict(hidden_size=32, num_experts=16, n_routed_experts=16, num_local_experts=16, num_experts_per_tok=4,
                moe_intermediate_size=8, intermediate_size=8, head_dim=8, num_attention_heads=4,
                num_key_value_heads=4, n_shared_experts=1)    # (Dots1's class leaves n_shared_experts None)
    if getattr(hf, "n_group", None):
        tiny.update(n_group=4, topk_group=2)         # where the family has groups, make them count
    per_layer = getattr(hf, "per_layer_attributes", None) or ()    # Dots 3 Note's attention shapes: not the MoE's
    for key, value in tiny.items():
        # a list (Ernie 4.5 VL's widths of its text and its vision experts) holds the tiny size in each
        if key not in per_layer and hasattr(hf, key):
            current = getattr(hf, key)
            setattr(hf, key, [value] * len(current) if isinstance(current, list) else value)
    for key, value in fields.items():               # a config.json may hold fields its class has not
        setattr(hf, key, value)
    modeling = importlib.import_module(type(hf).__module__.replace(".configuration_", ".modeling_"))
    for cls in vars(modeling).values():              # the module holding both a router and the experts
        if inspect.isclass(cls) and issubclass(cls, torch.nn.Module) and cls.__module__ == modeling.__name__:
            init = inspect.getsource(cls.__init__)
            if ("self.gate" in init or "self.router" in init) and "self.experts" in init:
                # Ernie 4.5 VL's block is built with its experts' width (its text experts' is the first)
                width = "intermediate_size" in inspect.signature(cls).parameters
                return hf, cls(hf, hf.moe_intermediate_size[0]) if width else cls(hf)
    pytest.fail(f"no MoE block found in {modeling.__name__}")


@pytest.mark.parametrize("family", sorted(config_module._NOAUX_TC_FAMILIES + config_module._SOFTMAX_FAMILIES))
def test_every_known_family_routes_as_its_transformers_block(family):
    """The families from_hf_config routes by name, their config.json naming no scoring_func: GLM-4.5,
    MiniMax-M2, ... (DeepSeek-V3's sigmoid with bias and groups), Qwen, OLMoE, ... (softmax)."""
    hf, block, cfg = _check_family(family)
    noaux_tc = family in config_module._NOAUX_TC_FAMILIES
    assert cfg.scoring_func == ("sigmoid" if noaux_tc else "softmax")


@pytest.mark.parametrize("family, fields", [
    ("inkling2_text", {}),                                     # routed_scaling_factor stored as route_scale
    ("unlimited_ocr_text", {}), ("deepseek_ocr2_text", {}),     # DeepSeek-V2's router: never renormalised
    ("cohere2_moe", {"norm_topk_prob": False}),                # softmax: renormalised all the same
    ("cohere2_moe", {"expert_selection_fn": "sigmoid"}),
    ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": False}),
    # routers that renormalise whatever a config.json field their class lacks says
    *[(family, {"norm_topk_prob": False}) for family in ("minimax", "minimax_m2",
                                                          "qwen3_5_moe_text", "qwen3_vl_moe_text")],
    # a stray alias another family's router reads (a helper's audit: every weight x3, or softmax made sigmoid)
    ("qwen3_moe", {"route_scale": 3.0}), ("qwen3_moe", {"router_scaling_factor": 3.0}),
    ("minimax_m2", {"route_scale": 3.0}), ("flint", {"router_scaling_factor": 3.0}), ("hy_v3", {"route_scale": 3.0}),
    ("mixtral", {"expert_selection_fn": "sigmoid"}), ("mistral4", {"expert_selection_fn": "sigmoid"}),
    ("hy_v3", {"router_scaling_factor": 1.7}),
    # the OCR models' DeepSeek-V2 routers never renormalise, whatever a config.json says
    ("unlimited_ocr_text", {"norm_topk_prob": True}), ("deepseek_ocr2_text", {"norm_topk_prob": True}),
    # Cohere2-MoE's block averages the routed sum with its shared experts' by default
    ("cohere2_moe", {"num_shared_experts": 1}),
    ("cohere2_moe", {"num_shared_experts": 1, "shared_expert_combination_strategy": "sum"}),
    # each field the routers of the families added from ktfp8.hf's SUPPORTED_EXPERTS read, off its default
    ("afmoe", {"route_scale": 2.5}), ("afmoe", {"norm_topk_prob": False}),
    ("dots1", {"norm_topk_prob": True, "routed_scaling_factor": 2.5}), ("dots1", {"n_group": 1, "topk_group": 1}),
    *[(family, {"norm_topk_prob": False, "routed_scaling_factor": 2.5})
      for family in ("dots3_note", "dots3_note_text")],
    ("kimi_linear", {"norm_topk_prob": False, "routed_scaling_factor": 1.0}),   # held as moe_renormalize
    ("kimi_linear", {"n_group": 1, "topk_group": 1}),                          # held as num_expert_group
    *[(family, {"norm_topk_prob": False}) for family in ("ernie4_5_vl_moe_text", "granitemoe", "granitemoe_swa",
                                                          "granitemoehybrid", "granitemoeshared")],
    # the released moe_norm_min routes as route() does (a larger one is refused, below)
    ("ernie4_5_moe", {"moe_norm_min": 1e-12}), ("ernie4_5_vl_moe_text", {"moe_norm_min": 1e-12}),
])
def test_routing_fields_read_as_the_family_reads_them(family, fields):
    """Found by a helper's audit: every weight of Inkling-2 8x too small, UnlimitedOCR / DeepSeek-OCR2
    renormalised, Cohere2-MoE's sigmoid read as softmax and its softmax left unnormalised, and
    norm_topk_prob=False obeyed where the family's router does not read it."""
    _check_family(family, **fields)


def test_axk2_with_groups_is_refused():
    """A.X-K2's router masks the experts of the groups it drops with 0, not -inf: with groups, an expert
    outside the kept ones can win (a helper's audit: 58 of 512 tokens routed otherwise with biases below
    0); without groups it routes as DeepSeek-V3 (test_every_known_family_routes_as_its_transformers_block)."""
    fields = dict(model_type="axk2", n_routed_experts=8, num_experts_per_tok=2, hidden_size=8, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="with n_group = 4 keeps its best groups by masking the others' experts"):
        MoeConfig.from_hf_config(dict(fields, n_group=4, topk_group=2))
    assert MoeConfig.from_hf_config(dict(fields, n_group=4, topk_group=2), scoring_func="sigmoid").n_group == 4
    assert MoeConfig.from_hf_config(fields).scoring_func == "sigmoid"


@pytest.mark.parametrize("family", ["ernie4_5_moe", "ernie4_5_vl_moe_text"])
def test_ernie_moe_norm_min_that_can_act_is_refused(family):
    """Ernie 4.5's routers divide the top-k weights by max(their sum, moe_norm_min), route() by their sum: a
    moe_norm_min above the released 1e-12 is refused (the chosen probabilities, picked with a bias, have no floor)."""
    fields = dict(model_type=family, moe_num_experts=8, moe_k=2, hidden_size=8, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="with moe_norm_min = 0.9 divides its top-k weights by their sum clamped"):
        MoeConfig.from_hf_config(dict(fields, moe_norm_min=0.9))
    with pytest.raises(ValueError, match="with moe_norm_min = 1e-11 divides"):
        MoeConfig.from_hf_config(dict(fields, moe_norm_min=1e-11))
    assert MoeConfig.from_hf_config(dict(fields, moe_norm_min=1e-12)).norm_topk_prob
    # not vacuous: at 0.9 the block's weights of some tokens do not sum to 1, as route()'s would
    _, block = _family_block(family, moe_norm_min=0.9)
    _, hf_w, _ = _run_block(block, 32)
    assert (hf_w.reshape(T, -1).sum(axis=1) < 0.89).any()


def test_deepseek_v4_is_refused():
    """DeepSeek-V4 routes its first layers by a token id table and scores by sqrt(softplus(x)) by default: refused
    whatever its config.json names (a scoring_func of sigmoid leaves the hash-routed layers), unless given."""
    fields = dict(model_type="deepseek_v4", n_routed_experts=8, num_experts_per_tok=2, hidden_size=8,
                  moe_intermediate_size=8)
    for given in ({}, {"scoring_func": "sqrtsoftplus"}, {"scoring_func": "sigmoid"}):
        with pytest.raises(ValueError, match=r"'deepseek_v4' routes its first MoE layers .* by a fixed token id"):
            MoeConfig.from_hf_config(dict(fields, **given))
    assert MoeConfig.from_hf_config(fields, scoring_func="sigmoid").expert_num == 8


def test_afmoe_scales_by_route_scale_only():
    """AFMoE's router multiplies by route_scale (default 1.0), never by a routed_scaling_factor its config.json
    may carry (the block check cannot show it: transformers' config always holds a route_scale)."""
    _, t = _torch_transformers()
    if not hasattr(t, "AfmoeConfig"):
        pytest.skip("no AFMoE in this transformers")
    fields = dict(num_experts=8, num_experts_per_tok=2, hidden_size=8, moe_intermediate_size=8,
                  routed_scaling_factor=3.0)
    for scale in ({}, {"route_scale": 2.5}):
        cfg = MoeConfig.from_hf_config(dict(fields, model_type="afmoe", **scale))
        assert cfg.routed_scaling_factor == t.AfmoeConfig(**fields, **scale).route_scale == scale.get("route_scale", 1)


def test_kimi_linear_reads_its_own_names_first():
    """Kimi Linear's config class keeps norm_topk_prob, n_group and num_experts_per_tok as moe_renormalize,
    num_expert_group and num_experts_per_token (attribute_map): a config.json holding both names routes by
    those, as transformers reads it."""
    _, t = _torch_transformers()
    if not hasattr(t, "KimiLinearConfig"):
        pytest.skip("no Kimi Linear in this transformers")
    fields = dict(num_experts=16, num_experts_per_token=4, num_experts_per_tok=2, hidden_size=32,
                  moe_intermediate_size=8, norm_topk_prob=True, moe_renormalize=False, n_group=2, num_expert_group=4,
                  topk_group=2)
    hf = t.KimiLinearConfig(**fields)
    cfg = MoeConfig.from_hf_config(dict(fields, model_type="kimi_linear"))
    assert (cfg.norm_topk_prob, cfg.n_group, cfg.num_experts_per_tok) == \
        (hf.norm_topk_prob, hf.n_group, hf.num_experts_per_tok) == (False, 4, 4)


def test_inkling2_reads_routed_scaling_factor_over_route_scale():
    """Inkling-2's config class keeps route_scale as a field and routed_scaling_factor as its attribute_map
    alias, applied last: a config.json holding both scales by routed_scaling_factor (a helper's review: the
    family's own name had been put first for every family, as Kimi Linear's are)."""
    _, t = _torch_transformers()
    if not hasattr(t, "Inkling2TextConfig"):
        pytest.skip("no Inkling-2 in this transformers")
    fields = dict(num_experts=8, num_experts_per_tok=2, hidden_size=8, moe_intermediate_size=8, scoring_func="sigmoid",
                  route_scale=3.0, routed_scaling_factor=5.0)
    cfg = MoeConfig.from_hf_config(dict(fields, model_type="inkling2_text"))
    assert cfg.routed_scaling_factor == t.Inkling2TextConfig.from_dict(fields).route_scale == 5.0


@pytest.mark.parametrize("family", sorted(f for f, (key, _, _) in config_module._UNDESCRIBED_ROUTERS.items()
                                          if key is None))
def test_routers_no_moeconfig_describes_are_refused(family):
    """Gemma 4 and Diffusion Gemma (a learned per-expert scale), Laguna (soft-capped logits, a scale after the
    experts), Muse Spark (its logits times output_multiplier), Kolibri (a bias on the logits), Phi-MoE
    (sparsemixer), LongCat-Flash and Zaya (experts that compute nothing): routed as a known family's router they
    would be silently wrong; with scoring_func given (for calls with the model's own ids and weights) the sizes
    are read."""
    fields = dict(model_type=family, num_experts=8, num_experts_per_tok=2, hidden_size=8, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="which no MoeConfig routing describes"):
        MoeConfig.from_hf_config(fields)
    assert MoeConfig.from_hf_config(fields, scoring_func="sigmoid").expert_num == 8


def _stray_fields(family, key):
    """A config.json value of routing field `key` that would change the routing of a router reading it."""
    noaux_tc = family in config_module._NOAUX_TC_FAMILIES or family == "deepseek_v3"
    return {"scoring_func": {"scoring_func": "sigmoid"}, "norm_topk_prob": {"norm_topk_prob": True},
            "routed_scaling_factor": {"routed_scaling_factor": 3.0},
            "n_group": {"n_group": 4, "topk_group": 2}, "topk_group": {"n_group": 4, "topk_group": 2},
            "topk_method": {"topk_method": "greedy"} if noaux_tc else
            {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}}[key]


@pytest.mark.parametrize("family, key", sorted({(family, "n_group" if key == "topk_group" else key)
                                                for family, keys in config_module._NOT_READ.items() for key in keys}))
def test_routing_fields_a_family_does_not_read_are_ignored(family, key):
    """A config.json may carry routing fields its family's router never reads (its config class has none):
    ktfp8 read them, e.g. a Qwen3-MoE config's routed_scaling_factor scaled every weight, a Mixtral's
    n_group grouped its experts, GLM-4.5's topk_method 'greedy' made it softmax (a helper's audit against
    each family's transformers block).  The family's router is the oracle here too."""
    _check_family(family, **_stray_fields(family, key))


# families whose MoE block multiplies the experts' weighted sum by routed_scaling_factor, where the others'
# routers multiply the weights (Beam)
SCALED_AFTER_EXPERTS = ("beam",)


def _check_family(family, **fields):
    """Routes the family's block's logits with MoeConfig.from_hf_config of its config and compares with
    what the block's router chose; returns (config, block, MoeConfig)."""
    torch, _ = _torch_transformers()
    hf, block = _family_block(family, **fields)
    bias = None
    for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
        if name.endswith(("e_score_correction_bias", "expert_bias")):   # on the router or on the block
            bias = np.random.default_rng(3).uniform(-0.3, 0.3, 16).astype(np.float32)
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(bias))
            if getattr(block, "use_expert_bias", True) is False:
                block.use_expert_bias = True
    logits, hf_w, hf_ids = _run_block(block, 32)
    if family in SCALED_AFTER_EXPERTS:      # the same product as scaling each weight, up to rounding
        hf_w = hf_w * hf.routed_scaling_factor
    if family == "cohere2_moe" and hf.num_shared_experts > 0 and hf.shared_expert_combination_strategy == "average":
        hf_w = hf_w * 0.5                   # its block: (routed + shared) / 2
    if bias is not None:          # a bias that is a parameter (Ernie 4.5's) was drawn again by _run_block
        bias = next(t for n, t in [*block.named_parameters(), *block.named_buffers()]
                    if n.endswith(("e_score_correction_bias", "expert_bias"))).detach().numpy().reshape(-1)
    cfg = MoeConfig.from_hf_config(dict(hf.to_dict(), model_type=family))     # FLAT_TEXT_CONFIGS: the outer type
    assert (cfg.expert_num, cfg.hidden_size, cfg.intermediate_size) == tuple(block.experts.down_proj.shape)
    assert bias is None or cfg.scoring_func == "sigmoid" or family.startswith("ernie4_5")   # Ernie: softmax, a bias
    _assert_same_routing(*route(logits.reshape(T, 16), cfg, correction_bias=bias),
                         hf_ids.reshape(T, -1), hf_w.reshape(T, -1))
    return hf, block, cfg


def test_bfloat16_and_float16_logits():
    """bfloat16 model: same experts; transformers rounds Qwen weights to bfloat16, route keeps float32.
    float16 Mixtral: its router works in float32 on the float16 logits, as route does."""
    torch, t = _torch_transformers()
    hf = t.Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=8,
                          norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=4)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    logits, hf_w, hf_ids = _run_block(Qwen3MoeSparseMoeBlock(hf), 32, dtype=torch.bfloat16)
    assert logits.dtype == ml_dtypes.bfloat16
    _assert_same_routing(*route(logits, MoeConfig.from_hf_config(hf)), hf_ids, hf_w, rtol=2.0 ** -8,
                         tie_scores=logits)   # bfloat16 logits tie often: 8-bit mantissa

    hf = t.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2, intermediate_size=8,
                         num_attention_heads=4, num_key_value_heads=4)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    logits, hf_w, hf_ids = _run_block(MixtralSparseMoeBlock(hf), 32, dtype=torch.float16)
    assert logits.dtype == np.float16
    _assert_same_routing(*route(logits, MoeConfig.from_hf_config(hf)), hf_ids, hf_w, tie_scores=logits)


# --- cases no transformers model covers: a float64 brute-force oracle ------------------------------

def _oracle(logits, cfg, bias):
    """Straight from the definition, one token at a time, in float64."""
    x = logits.astype(np.float64)
    ids, weights = [], []
    for row in x:
        scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum() if cfg.scoring_func == "softmax" \
            else 1 / (1 + np.exp(-row))
        choice = scores + (0 if bias is None else bias)
        per = cfg.expert_num // cfg.n_group
        groups = [sorted(choice[g * per:(g + 1) * per], reverse=True) for g in range(cfg.n_group)]
        top2_sum = (cfg.group_score or {"softmax": "best", "sigmoid": "top2_sum"}[cfg.scoring_func]) == "top2_sum"
        group_score = [sum(g[:2]) if top2_sum else g[0] for g in groups]
        kept = sorted(range(cfg.n_group), key=lambda g: -group_score[g])[:cfg.topk_group]
        eligible = [e for e in range(cfg.expert_num) if e // per in kept]
        chosen = sorted(eligible, key=lambda e: -choice[e])[:cfg.num_experts_per_tok]
        w = scores[chosen]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        ids.append(chosen)
        weights.append(w * cfg.routed_scaling_factor)
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize("kwargs", [
    dict(scoring_func="softmax", norm_topk_prob=True),                           # softmax + bias (Ernie-4.5 style)
    dict(scoring_func="sigmoid", norm_topk_prob=False, routed_scaling_factor=3.0),  # sigmoid, no groups
    dict(scoring_func="sigmoid", n_group=12, topk_group=5),                      # groups of one expert
    dict(scoring_func="sigmoid", n_group=3, topk_group=2, routed_scaling_factor=2.5),  # DeepSeek-V3 rule
    dict(scoring_func="softmax", n_group=3, topk_group=2, routed_scaling_factor=0.5),
    dict(scoring_func="softmax", n_group=3, topk_group=2, group_score="top2_sum"),  # Mistral 4 rule
    dict(scoring_func="sigmoid", n_group=3, topk_group=2, group_score="best"),
])
def test_against_float64_oracle(kwargs):
    rng = np.random.default_rng(7)
    cfg = MoeConfig(12, 4, 16, 16, **kwargs)
    logits = rng.normal(0, 2, (50, 12)).astype(np.float32)
    bias = rng.uniform(-0.2, 0.2, 12).astype(np.float32)
    ids, w = route(logits, cfg, correction_bias=bias)
    ref_ids, ref_w = _oracle(logits, cfg, bias.astype(np.float64))
    np.testing.assert_array_equal(ids, ref_ids)      # best first, so the order matches too
    np.testing.assert_allclose(w, ref_w, rtol=1e-6)


# --- documented edge cases -------------------------------------------------------------------------

def test_empty_batch():
    cfg = MoeConfig(8, 2, 16, 16)
    ids, w = route(np.zeros((0, 8), np.float32), cfg)
    assert ids.shape == (0, 2) and ids.dtype == np.int64
    assert w.shape == (0, 2) and w.dtype == np.float32


def test_output_types_and_best_first_order():
    cfg = MoeConfig(8, 3, 16, 16, norm_topk_prob=False)
    logits = np.array([[0.0, 3.0, -1.0, 2.0, 5.0, 1.0, 0.5, -2.0]], np.float32)
    ids, w = route(logits, cfg)
    assert ids.dtype == np.int64 and w.dtype == np.float32
    assert ids.tolist() == [[4, 1, 3]]
    p = np.exp(logits[0].astype(np.float64)) / np.exp(logits[0].astype(np.float64)).sum()
    np.testing.assert_allclose(w[0], p[[4, 1, 3]], rtol=1e-6)


def test_ties_go_to_the_lower_expert_id():
    cfg = MoeConfig(8, 3, 16, 16)
    ids, w = route(np.zeros((2, 8), np.float32), cfg)
    assert ids.tolist() == [[0, 1, 2]] * 2
    np.testing.assert_allclose(w, 1 / 3, rtol=1e-6)
    cfg = MoeConfig(8, 2, 16, 16, scoring_func="sigmoid", n_group=4, topk_group=1)
    ids, _ = route(np.zeros((1, 8), np.float32), cfg)
    assert ids.tolist() == [[0, 1]]                  # tied groups too: the first group


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_nan_logits_give_nan_weights_for_that_token_only(scoring_func):
    cfg = MoeConfig(8, 2, 16, 16, scoring_func=scoring_func)
    logits = np.random.default_rng(3).normal(size=(3, 8)).astype(np.float32)
    logits[1, 5] = np.nan
    ids, w = route(logits, cfg)
    assert np.isnan(w[1]).all() and not np.isnan(w[[0, 2]]).any()
    assert ((ids >= 0) & (ids < 8)).all() and len(set(ids[1])) == 2
    clean_ids, clean_w = route(logits[[0, 2]], cfg)
    np.testing.assert_array_equal(ids[[0, 2]], clean_ids)
    np.testing.assert_array_equal(w[[0, 2]], clean_w)


def test_infinite_softmax_logits_as_torch_softmax():
    """A -Inf logit (a masked expert) scores 0 and the rest route as without it; +Inf, or every logit
    -Inf, makes the row's weights NaN (the docstring's rule), as torch's softmax does."""
    torch = pytest.importorskip("torch")
    cfg = MoeConfig(4, 4, 16, 16, norm_topk_prob=False)
    logits = np.array([[0.5, -np.inf, 1.0, 0.2], [np.inf, 0, 0, 0], [-np.inf] * 4], np.float32)
    ids, w = route(logits, cfg)
    want = torch.from_numpy(logits).softmax(-1).numpy()
    assert ids[0].tolist() == [2, 0, 3, 1] and w[0, 3] == 0
    np.testing.assert_allclose(w[0], want[0, ids[0]], rtol=WEIGHT_RTOL)
    assert np.isnan(w[1:]).all() and np.isnan(want[1:]).all()


def test_bfloat16_logits_route_as_their_float32_values():
    cfg = MoeConfig(16, 4, 16, 16, scoring_func="sigmoid", n_group=4, topk_group=2)
    values = np.random.default_rng(5).normal(size=(20, 16)).astype(ml_dtypes.bfloat16)
    for a, b in zip(route(values, cfg), route(values.astype(np.float32), cfg)):
        np.testing.assert_array_equal(a, b)


def test_inputs_are_not_modified_and_strides_do_not_matter():
    cfg = MoeConfig(16, 4, 16, 16, scoring_func="sigmoid")
    logits = np.asfortranarray(np.random.default_rng(6).normal(size=(10, 16)).astype(np.float32))
    bias = np.linspace(-0.1, 0.1, 32)[::2]          # float64 and strided: cast to float32
    kept = logits.copy(), bias.copy()
    ids, w = route(logits, cfg, correction_bias=bias)
    np.testing.assert_array_equal(logits, kept[0])
    np.testing.assert_array_equal(bias, kept[1])
    ids2, w2 = route(np.ascontiguousarray(logits), cfg, correction_bias=bias.astype(np.float32))
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(w, w2)


@pytest.mark.parametrize("logits, bias, error, match", [
    ([[0.0] * 8], None, TypeError, "router_logits"),
    (np.zeros((2, 8), np.float64), None, TypeError, "router_logits"),
    (np.zeros((2, 8), np.int32), None, TypeError, "router_logits"),
    (np.zeros(8, np.float32), None, ValueError, "router_logits"),
    (np.zeros((2, 7), np.float32), None, ValueError, "expert_num=8"),
    (np.zeros((2, 2, 8), np.float32), None, ValueError, "router_logits"),
    (np.zeros((0, 7), np.float32), None, ValueError, "router_logits"),
    (np.zeros((2, 8), np.float32), np.zeros(7, np.float32), ValueError, "correction_bias"),
    (np.zeros((2, 8), np.float32), np.zeros((1, 8), np.float32), ValueError, "correction_bias"),
    (np.zeros((2, 8), np.float32), np.zeros(8, np.int64), TypeError, "correction_bias"),
    (np.zeros((2, 8), np.float32), [0.0] * 8, TypeError, "correction_bias"),
    (np.zeros((2, 8), np.float32), np.full(8, np.inf, np.float32), ValueError, "correction_bias"),
])
def test_bad_inputs(logits, bias, error, match):
    with pytest.raises(error, match=match):
        route(logits, MoeConfig(8, 2, 16, 16), correction_bias=bias)


def test_bad_cfg():
    with pytest.raises(TypeError, match="cfg"):
        route(np.zeros((2, 8), np.float32), {"expert_num": 8})
