"""MoeConfig / QuantConfig: defaults, validation on construction and assignment, from_hf_config.

from_hf_config is checked against config dicts and files written by transformers' own config classes,
so the field names are the ones real checkpoints use."""
import copy
import itertools
import json

import numpy as np
import pytest

import ktfp8
from ktfp8 import MOEConfig, MoeConfig, QuantConfig
from ktfp8 import config as config_module

SIZES = dict(expert_num=64, num_experts_per_tok=8, hidden_size=2048, intermediate_size=768)


def test_defaults_match_api():
    cfg = MoeConfig(64, 8, 2048, 768)
    assert (cfg.expert_num, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size) == (64, 8, 2048, 768)
    assert (cfg.scoring_func, cfg.norm_topk_prob, cfg.n_group, cfg.topk_group) == ("softmax", True, 1, 1)
    assert cfg.routed_scaling_factor == 1.0 and cfg.hidden_act == "silu" and cfg.threads is None
    assert cfg.swiglu_limit is None and MoeConfig(64, 8, 2048, 768, swiglu_limit=7).swiglu_limit == 7.0
    assert cfg.quant_config == QuantConfig("FP8", True, 0)
    assert MOEConfig is MoeConfig and ktfp8.QuantConfig is QuantConfig


def test_each_config_owns_its_quant_config():
    a, b = MoeConfig(**SIZES), MoeConfig(**SIZES)
    a.quant_config.method = "BF16"
    assert b.quant_config.method == "FP8"


def test_routed_expert_num_alias():
    cfg = MoeConfig(64, hidden_size=2048, intermediate_size=768, routed_expert_num=6)
    assert cfg.num_experts_per_tok == 6 and cfg.routed_expert_num == 6
    cfg.routed_expert_num = 4
    assert cfg.num_experts_per_tok == 4
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        cfg.routed_expert_num = 65
    assert MoeConfig(64, 6, 2048, 768, routed_expert_num=6).num_experts_per_tok == 6
    with pytest.raises(ValueError, match="routed_expert_num"):
        MoeConfig(64, 6, 2048, 768, routed_expert_num=8)
    with pytest.raises(TypeError, match="num_experts_per_tok"):
        MoeConfig(64, hidden_size=2048, intermediate_size=768)


@pytest.mark.parametrize("changes, error, field", [
    (dict(num_experts_per_tok=65), ValueError, "num_experts_per_tok"),
    (dict(expert_num=0), ValueError, "expert_num"),
    (dict(hidden_size=-1), ValueError, "hidden_size"),
    (dict(intermediate_size=0), ValueError, "intermediate_size"),
    (dict(num_experts_per_tok=0), ValueError, "num_experts_per_tok"),
    (dict(expert_num=True), TypeError, "expert_num"),
    (dict(hidden_size=2048.0), TypeError, "hidden_size"),
    (dict(intermediate_size="768"), TypeError, "intermediate_size"),
    (dict(n_group=3), ValueError, "n_group"),
    (dict(n_group=0), ValueError, "n_group"),
    (dict(n_group=4, topk_group=5), ValueError, "topk_group"),
    (dict(n_group=8, topk_group=0), ValueError, "topk_group"),
    (dict(n_group=16, topk_group=1), ValueError, "grouped top-k"),   # 1 group of 4 experts < top-8
    (dict(scoring_func="relu"), ValueError, "scoring_func"),
    (dict(scoring_func=None), ValueError, "scoring_func"),
    (dict(norm_topk_prob=1), TypeError, "norm_topk_prob"),
    (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
    (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor"),
    (dict(routed_scaling_factor=True), TypeError, "routed_scaling_factor"),
    (dict(hidden_act="gelu"), ValueError, "hidden_act"),
    (dict(swiglu_limit=0.0), ValueError, "swiglu_limit"),
    (dict(swiglu_limit=-7.0), ValueError, "swiglu_limit"),
    (dict(swiglu_limit=float("inf")), ValueError, "swiglu_limit"),
    (dict(swiglu_limit=1e40), ValueError, "swiglu_limit"),      # inf as a float32
    (dict(swiglu_limit="10"), TypeError, "swiglu_limit"),
    (dict(swiglu_limit=True), TypeError, "swiglu_limit"),
    (dict(threads=0), ValueError, "threads"),
    (dict(threads=2.0), TypeError, "threads"),
    (dict(quant_config="FP8"), TypeError, "quant_config"),
    (dict(quant_config=dict(method="INT4")), ValueError, "method"),
])
def test_invalid_values_raise_at_construction_and_assignment(changes, error, field):
    with pytest.raises(error, match=field):
        MoeConfig(**dict(SIZES, **changes))
    cfg = MoeConfig(**SIZES)
    before = repr(cfg)
    with pytest.raises(error, match=field):
        for name, value in changes.items():   # the last assignment of a combination fails
            setattr(cfg, name, value)
    # A rejected assignment leaves nothing behind but the valid assignments before it.
    if len(changes) == 1:
        assert repr(cfg) == before


def test_valid_assignments_take_effect():
    cfg = MoeConfig(**SIZES)
    cfg.n_group, cfg.topk_group, cfg.scoring_func = 8, 4, "sigmoid"
    cfg.routed_scaling_factor = 2            # ints are accepted and stored as float
    cfg.expert_num = np.int64(256)          # numpy integers too, stored as int
    cfg.threads = 3
    assert (cfg.n_group, cfg.topk_group, cfg.scoring_func) == (8, 4, "sigmoid")
    assert type(cfg.routed_scaling_factor) is float and type(cfg.expert_num) is int and cfg.expert_num == 256
    cfg.quant_config = {"method": "FP8", "per_channel": False}
    assert cfg.quant_config == QuantConfig("FP8", False, 128)


def test_unknown_field_is_rejected():
    cfg = MoeConfig(**SIZES)
    with pytest.raises(AttributeError, match="num_expert_per_tok"):
        cfg.num_expert_per_tok = 4
    with pytest.raises(AttributeError, match="bits"):
        cfg.quant_config.bits = 8


def test_copies_and_equality():
    cfg = MoeConfig(**SIZES, scoring_func="sigmoid", n_group=8, topk_group=4)
    dup = copy.deepcopy(cfg)
    assert dup == cfg and dup.quant_config is not cfg.quant_config
    dup.quant_config.per_channel = False
    assert dup != cfg


# --- QuantConfig ----------------------------------------------------------------------------------

def test_quant_config_construction():
    assert QuantConfig() == QuantConfig("FP8", True, 0)
    assert QuantConfig(per_channel=False).group_size == 128
    assert QuantConfig("FP8", False, 64).group_size == 64
    assert QuantConfig("BF16").method == "BF16"


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(method="fp8"), ValueError, "method"),
    (dict(method="INT8"), ValueError, "method"),
    (dict(per_channel=True, group_size=128), ValueError, "group_size"),
    (dict(per_channel=False, group_size=0), ValueError, "group_size"),
    (dict(per_channel=False, group_size=-128), ValueError, "group_size"),
    (dict(per_channel=1), TypeError, "per_channel"),
    (dict(per_channel=False, group_size=128.0), TypeError, "group_size"),
])
def test_quant_config_invalid(kwargs, error, field):
    with pytest.raises(error, match=field):
        QuantConfig(**kwargs)


SCALE_TARGETS = [(True, 0), (False, 128), (False, 64)]


@pytest.mark.parametrize("method", ["FP8", "BF16"])
@pytest.mark.parametrize("per_channel, group_size", SCALE_TARGETS)
def test_quant_config_assignment_order_does_not_matter(method, per_channel, group_size):
    """The KTransformers field-by-field idiom on a fresh config reaches the same config in every order."""
    for order in itertools.permutations([("method", method), ("per_channel", per_channel),
                                         ("group_size", group_size)]):
        q = MoeConfig(**SIZES).quant_config
        for name, value in order:
            setattr(q, name, value)
        assert q == QuantConfig(method, per_channel, group_size), order


@pytest.mark.parametrize("per_channel, group_size", [(True, 128), (False, 0)])
def test_quant_config_contradiction_raises_in_either_order(per_channel, group_size):
    """Two assignments that contradict each other: ValueError at the second, whichever it is, and the
    config stays as the first left it."""
    values = {"per_channel": per_channel, "group_size": group_size}
    for first, second in (("per_channel", "group_size"), ("group_size", "per_channel")):
        q = QuantConfig()
        setattr(q, first, values[first])
        before = (q.per_channel, q.group_size)
        with pytest.raises(ValueError, match=f"QuantConfig.{second} = .* contradicts {first} = .* set before"):
            setattr(q, second, values[second])
        assert (q.per_channel, q.group_size) == before
        with pytest.raises(ValueError, match="group_size"):
            QuantConfig("FP8", per_channel, group_size)


def test_quant_config_unset_field_follows_the_set_one():
    q = QuantConfig()
    q.per_channel = False                      # block-wise, default block 128
    assert q == QuantConfig("FP8", False, 128)
    q.group_size = 64
    assert q == QuantConfig("FP8", False, 64)
    q = QuantConfig()
    q.group_size = 32                          # a block edge: block-wise
    assert q == QuantConfig("FP8", False, 32)
    assert QuantConfig(group_size=64) == QuantConfig("FP8", False, 64)
    assert QuantConfig(group_size=0) == QuantConfig("FP8", True, 0)


def test_quant_config_switching_a_set_config():
    """Values set are never changed behind the user's back; the message shows the one-step switch, and
    group_size = None hands group_size back to the mode."""
    cfg = MoeConfig(**SIZES)
    q = cfg.quant_config
    q.method, q.per_channel, q.group_size = "FP8", True, 0
    with pytest.raises(ValueError, match=r"cfg.quant_config = \{'method': 'FP8', 'per_channel': False, "
                                         r"'group_size': 128\}"):
        q.per_channel = False
    assert q == QuantConfig("FP8", True, 0)
    cfg.quant_config = {"method": "FP8", "per_channel": False, "group_size": 64}
    assert cfg.quant_config == QuantConfig("FP8", False, 64)
    q = cfg.quant_config
    q.group_size = None                        # released: follows the mode
    assert q.group_size == 128
    q.per_channel = True
    assert q == QuantConfig("FP8", True, 0)
    q.group_size = 0
    assert q == QuantConfig("FP8", True, 0)


def test_quant_config_method_checked_on_assignment():
    q = QuantConfig()
    with pytest.raises(ValueError, match="method"):
        q.method = "AMXINT4"
    assert q.method == "FP8"


# --- from_hf_config -------------------------------------------------------------------------------

HEADS = dict(num_attention_heads=4, num_key_value_heads=4)   # transformers checks hidden % heads


def _hf_configs():
    """(family, transformers config, expected MoeConfig fields) for tiny configs of each family."""
    t = pytest.importorskip("transformers")
    sizes = dict(hidden_size=48, num_experts_per_tok=3, **HEADS)
    cases = [
        ("qwen2_moe", t.Qwen2MoeConfig(num_experts=12, moe_intermediate_size=20, intermediate_size=99,
                                       norm_topk_prob=False, **sizes),
         dict(expert_num=12, intermediate_size=20, scoring_func="softmax", norm_topk_prob=False)),
        ("qwen3_moe", t.Qwen3MoeConfig(num_experts=16, moe_intermediate_size=24, intermediate_size=99,
                                       norm_topk_prob=True, **sizes),
         dict(expert_num=16, intermediate_size=24, scoring_func="softmax", norm_topk_prob=True)),
        ("mixtral", t.MixtralConfig(num_local_experts=8, intermediate_size=40, **sizes),
         dict(expert_num=8, intermediate_size=40, scoring_func="softmax", norm_topk_prob=True)),
        ("deepseek_v3", t.DeepseekV3Config(n_routed_experts=32, moe_intermediate_size=16, intermediate_size=99,
                                           n_group=4, topk_group=2, routed_scaling_factor=1.5,
                                           norm_topk_prob=True, **sizes),
         dict(expert_num=32, intermediate_size=16, scoring_func="sigmoid", norm_topk_prob=True, n_group=4,
              topk_group=2, routed_scaling_factor=1.5)),
    ]
    if hasattr(t, "DeepseekV2Config"):
        cases += [
            ("deepseek_v2 greedy", t.DeepseekV2Config(n_routed_experts=16, moe_intermediate_size=16, n_group=4,
                                                      topk_group=2, topk_method="greedy", **sizes),
             dict(expert_num=16, intermediate_size=16, scoring_func="softmax", norm_topk_prob=False)),
            ("deepseek_v2 grouped", t.DeepseekV2Config(n_routed_experts=16, moe_intermediate_size=16, n_group=4,
                                                       topk_group=2, topk_method="group_limited_greedy",
                                                       routed_scaling_factor=16.0, **sizes),
             dict(expert_num=16, intermediate_size=16, scoring_func="softmax", norm_topk_prob=False,
                  n_group=4, topk_group=2, routed_scaling_factor=16.0)),
        ]
    return cases


def _expected(fields):
    return MoeConfig(**dict(dict(num_experts_per_tok=3, hidden_size=48), **fields))


@pytest.mark.parametrize("case", range(6))
def test_from_hf_config_families(case, tmp_path):
    cases = _hf_configs()
    if case >= len(cases):
        pytest.skip("DeepseekV2Config not in this transformers")
    family, hf, fields = cases[case]
    expected = _expected(fields)
    assert MoeConfig.from_hf_config(hf.to_dict()) == expected, family
    assert MoeConfig.from_hf_config(hf) == expected, family             # the config object itself
    hf.save_pretrained(tmp_path)
    assert MoeConfig.from_hf_config(tmp_path) == expected, family       # a model folder
    assert MoeConfig.from_hf_config(str(tmp_path / "config.json")) == expected, family


def test_from_hf_config_original_deepseek_fields():
    """DeepSeek's own config.json spells scoring_func / topk_method out (transformers' classes do not)."""
    v3 = dict(model_type="deepseek_v3", n_routed_experts=256, num_experts_per_tok=8, hidden_size=7168,
              moe_intermediate_size=2048, intermediate_size=18432, n_group=8, topk_group=4,
              routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
              hidden_act="silu")
    cfg = MoeConfig.from_hf_config(v3)
    assert (cfg.expert_num, cfg.intermediate_size, cfg.scoring_func, cfg.n_group, cfg.topk_group) == \
        (256, 2048, "sigmoid", 8, 4)
    assert cfg.routed_scaling_factor == 2.5 and cfg.norm_topk_prob
    v2 = dict(model_type="deepseek_v2", n_routed_experts=160, num_experts_per_tok=6, hidden_size=5120,
              moe_intermediate_size=1536, n_group=8, topk_group=3, routed_scaling_factor=16.0,
              scoring_func="softmax", topk_method="group_limited_greedy", norm_topk_prob=False)
    cfg = MoeConfig.from_hf_config(v2)
    assert (cfg.expert_num, cfg.scoring_func, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob) == \
        (160, "softmax", 8, 3, False)
    with pytest.raises(ValueError, match="topk_method"):
        MoeConfig.from_hf_config(dict(v2, topk_method="noaux_tc"))      # sigmoid method, softmax scores
    with pytest.raises(ValueError, match="topk_method"):
        MoeConfig.from_hf_config(dict(v2, topk_method="mystery"))


@pytest.mark.parametrize("family", sorted({"qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3",
                                            *config_module._NOAUX_TC_FAMILIES, *config_module._SOFTMAX_FAMILIES}))
def test_from_hf_config_missing_routing_fields_take_family_defaults(family):
    """A config.json that leaves routing fields out routes as the family's reference code does:
    compared with transformers' config class defaults for the same sizes."""
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if family not in CONFIG_MAPPING:
        pytest.skip(f"no {family} in this transformers")
    # Dots 3 Note's published config.json holds its text config's fields at the top level
    reference = dict(CONFIG_MAPPING["dots3_note_text" if family == "dots3_note" else family]().to_dict(),
                     model_type=family)
    count_key = next(k for k in config_module._EXPERT_COUNT_KEYS if k in reference)   # Dots1's class: None
    top_k_key = next(k for k in config_module._TOP_K_KEYS if k in reference)
    sizes = {count_key: 64, top_k_key: 4, "hidden_size": 48, "moe_hidden_size": 40,
             "moe_intermediate_size": 32, "intermediate_size": 32}
    sizes = {k: v for k, v in sizes.items() if k in reference}
    minimal = dict(sizes, model_type=family)
    assert MoeConfig.from_hf_config(minimal) == MoeConfig.from_hf_config(dict(reference, **sizes))


def test_from_hf_config_per_layer_lists_of_one_value():
    """Hunyuan-A13B's config.json gives moe_topk and moe_intermediate_size per layer: one value repeated
    is that value (lists that differ are refused, tests/test_bad_inputs.py)."""
    cfg = MoeConfig.from_hf_config(dict(model_type="hunyuan_v1_moe", num_experts=64, moe_topk=[8] * 32,
                                        hidden_size=4096, intermediate_size=3072, moe_intermediate_size=[3072] * 32))
    assert (cfg.expert_num, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size) == (64, 8, 4096, 3072)
    assert (cfg.scoring_func, cfg.norm_topk_prob) == ("softmax", True)


def test_from_hf_config_per_layer_list_of_several_values_takes_the_layer_given():
    """Lists that differ are refused, telling to pass that layer's value, which then stands (it was refused
    all the same)."""
    hunyuan = dict(model_type="hunyuan_v1_moe", num_experts=64, moe_topk=[8] * 31 + [6], hidden_size=4096,
                   moe_intermediate_size=[3072] * 31 + [1024])
    with pytest.raises(ValueError, match=r"moe_topk is \[8, .*, 6\], not one value .* pass that layer's "
                                         r"num_experts_per_tok=\.\.\."):
        MoeConfig.from_hf_config(hunyuan)
    cfg = MoeConfig.from_hf_config(hunyuan, num_experts_per_tok=6, intermediate_size=1024)
    assert (cfg.num_experts_per_tok, cfg.intermediate_size) == (6, 1024)
    # KTransformers' name of the top-k is the same override
    assert MoeConfig.from_hf_config(hunyuan, routed_expert_num=6, intermediate_size=1024).num_experts_per_tok == 6
    # a given scale is not read (a string there raised TypeError from its product with Cohere2's halving)
    glm = dict(model_type="glm4_moe", n_routed_experts=8, num_experts_per_tok=2, hidden_size=8, moe_intermediate_size=8,
               routed_scaling_factor="2.5")
    assert MoeConfig.from_hf_config(glm, routed_scaling_factor=2.5).routed_scaling_factor == 2.5


def test_from_hf_config_nested_text_config():
    t = pytest.importorskip("transformers")
    text = dict(num_experts=16, num_experts_per_tok=4, hidden_size=32, moe_intermediate_size=24)
    if hasattr(t, "Qwen3VLMoeConfig"):
        cfg = MoeConfig.from_hf_config(t.Qwen3VLMoeConfig(text_config=text).to_dict())
    else:
        cfg = MoeConfig.from_hf_config(dict(model_type="some_vl", vision_config={}, text_config=text))
    assert (cfg.expert_num, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size) == (16, 4, 32, 24)
    cfg = MoeConfig.from_hf_config(dict(model_type="deepseek_vl_v2", language_config=dict(
        text, model_type="deepseek_v2", topk_method="greedy")))
    assert cfg.expert_num == 16 and cfg.n_group == 1


def test_from_hf_config_unknown_family_must_name_its_routing():
    """A model_type ktfp8 has not checked routes however its own code does: guessing softmax would route
    GLM-4.5 (sigmoid, bias, groups) silently wrong, so it must say how, in the file or as an override."""
    sizes = dict(n_routed_experts=16, num_experts_per_tok=4, hidden_size=32, moe_intermediate_size=24,
                 n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="model_type 'novel_moe' names no scoring_func or topk_method"):
        MoeConfig.from_hf_config(dict(sizes, model_type="novel_moe"))
    named = MoeConfig.from_hf_config(dict(sizes, model_type="novel_moe", scoring_func="sigmoid"))
    assert (named.scoring_func, named.n_group, named.topk_group) == ("sigmoid", 4, 2)
    by_method = MoeConfig.from_hf_config(dict(sizes, model_type="novel_moe", topk_method="noaux_tc"))
    assert by_method == named
    assert MoeConfig.from_hf_config(dict(sizes, model_type="novel_moe"), scoring_func="sigmoid") == named
    # GLM-4.5's config.json names neither, yet routes as DeepSeek-V3 (tests/test_routing.py checks how)
    assert MoeConfig.from_hf_config(dict(sizes, model_type="glm4_moe")) == named
    # a hand-written dict without model_type takes MoeConfig's documented defaults
    assert MoeConfig.from_hf_config(sizes).scoring_func == MoeConfig(16, 4, 32, 24).scoring_func == "softmax"


@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next_text", "hy_v4", "hy_v4_vl_text"])
def test_from_hf_config_swiglu_limit_of_the_clamping_families(family):
    """Their experts clamp the SwiGLU as MoeConfig.swiglu_limit does: config.json's value, else the
    transformers config class's default (10), read as that class has it."""
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    default = CONFIG_MAPPING[family]().swiglu_limit
    hf = dict(model_type=family, n_routed_experts=8, num_experts_per_tok=2, hidden_size=64,
              moe_intermediate_size=32)
    routing = dict(scoring_func="sigmoid")     # (DeepSeek-V4's router is refused unless given)
    assert MoeConfig.from_hf_config(hf, **routing).swiglu_limit == default == 10.0
    assert MoeConfig.from_hf_config(dict(hf, swiglu_limit=7), **routing).swiglu_limit == 7.0
    assert MoeConfig.from_hf_config(hf, swiglu_limit=3.0, **routing).swiglu_limit == 3.0


@pytest.mark.parametrize("fields", [dict(swiglu_limit=7.0, swiglu_alpha=1.702),         # GPT-OSS's form
                                    dict(swiglu_limits=[0.0, 7.0]),                     # Step-3.5: after silu
                                    dict(expert_swiglu_limit_list=[0, 7])])              # Bailing
def test_from_hf_config_refuses_other_swiglu_clamps(fields):
    """Another family's clamp is not MoeConfig.swiglu_limit's (after the activation, per layer, with an
    alpha): read without it, the layer would be silently wrong; an explicit swiglu_limit= decides."""
    hf = dict(model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, hidden_size=64,
              intermediate_size=32, scoring_func="softmax", **fields)
    with pytest.raises(ValueError, match=f"sets {next(iter(fields))} = .*: its experts clamp their SwiGLU, which "
                                         f"ktfp8 computes only as DeepSeek-V4 does"):
        MoeConfig.from_hf_config(hf)
    assert MoeConfig.from_hf_config(hf, swiglu_limit=None).swiglu_limit is None
    assert MoeConfig.from_hf_config(dict(hf, **{k: [0, 0] for k, v in fields.items() if isinstance(v, list)},
                                         **{k: None for k, v in fields.items() if not isinstance(v, list)})
                                    ).swiglu_limit is None            # lists of 0: no clamp


def test_from_hf_config_overrides():
    hf = dict(num_experts=16, num_experts_per_tok=4, hidden_size=32, moe_intermediate_size=24)
    cfg = MoeConfig.from_hf_config(hf, threads=2, quant_config=QuantConfig("BF16"))
    assert cfg.threads == 2 and cfg.quant_config.method == "BF16"


@pytest.mark.parametrize("drop, field", [("num_experts", "num_experts / n_routed_experts / num_local_experts"),
                                         ("num_experts_per_tok", "num_experts_per_tok"),
                                         ("hidden_size", "hidden_size"),
                                         ("moe_intermediate_size", "moe_intermediate_size / intermediate_size")])
def test_from_hf_config_missing_fields(drop, field):
    hf = dict(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, hidden_size=32,
              moe_intermediate_size=24)
    del hf[drop]
    with pytest.raises(ValueError, match=field):
        MoeConfig.from_hf_config(hf)


def test_from_hf_config_bad_values_and_sources(tmp_path):
    hf = dict(num_experts=16, num_experts_per_tok=4, hidden_size=32, moe_intermediate_size=24)
    with pytest.raises(ValueError, match="hidden_act"):
        MoeConfig.from_hf_config(dict(hf, hidden_act="gelu"))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoeConfig.from_hf_config(dict(hf, num_experts_per_tok=17))
    with pytest.raises(FileNotFoundError, match="config.json"):
        MoeConfig.from_hf_config(tmp_path)                              # a folder without config.json
    with pytest.raises(FileNotFoundError, match="nowhere"):
        MoeConfig.from_hf_config(tmp_path / "nowhere.json")
    (tmp_path / "broken.json").write_text("{\"num_experts\": 16,")
    with pytest.raises(ValueError, match="JSON"):
        MoeConfig.from_hf_config(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text(json.dumps([hf]))
    with pytest.raises(ValueError, match="list"):
        MoeConfig.from_hf_config(tmp_path / "list.json")
    with pytest.raises(TypeError, match="path_or_dict"):
        MoeConfig.from_hf_config(42)


def test_from_hf_config_ernie_vl_widths_are_named_per_modality():
    """Ernie 4.5 VL's moe_intermediate_size holds its text experts' width and its vision experts' (not one per
    layer, as the general refusal of a list said): the refusal names both, and either can be given."""
    fields = dict(model_type="ernie4_5_vl_moe_text", moe_num_experts=64, moe_k=6, hidden_size=2560,
                  moe_intermediate_size=[1536, 512])
    with pytest.raises(ValueError, match=r"is \[1536, 512\], its text experts' and its vision experts' widths; .* "
                                         r"pass intermediate_size=1536 \(text\) or intermediate_size=512 \(vision\)"):
        MoeConfig.from_hf_config(fields)
    assert MoeConfig.from_hf_config(fields, intermediate_size=512).intermediate_size == 512
