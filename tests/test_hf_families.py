"""ktfp8.hf on the transformers MoE families beyond hf_models.py's hand-made ones, each built from its own
config class (hf_families.py): both loading paths of a whole model against transformers' eager experts on
the same FP8 weights; and every experts class ktfp8.hf runs, alone, with activations large enough that
DeepSeek-V4's clamped SwiGLU (MoeConfig.swiglu_limit), a clamp after the activation or any other
activation would show."""
import copy
import importlib
import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ktfp8.hf  # noqa: E402
from hf_families import build_family_model, build_gemma4_vision_language_model, tiny_config  # noqa: E402
from hf_models import save_model  # noqa: E402
from hf_oracle import PER_CHANNEL, greedy, logits, per_channel_experts, tiny_model_settings, write_experts  # noqa: E402
from ktfp8.convert import main as convert  # noqa: E402
from ktfp8.hf import experts as hf_experts  # noqa: E402
from moe_oracle import nmse  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

NMSE_MAX = 1e-8     # float32 on the same weights: the sums' order alone differs
# the families whose whole model is built here (each model's experts classes must be ktfp8.hf's for it)
FAMILIES = ("afmoe", "axk1", "axk2", "beam", "cohere2_moe", "deepseek_v4", "dots1", "exaone_moe", "flex_olmo", "flint",
            "gemma4_text", "glm_moe_dsa", "granitemoe", "granitemoehybrid", "granitemoe_swa", "granitemoeshared",
            "hy_v3", "hy_v4", "jamba", "kimi_linear", "kolibri1", "kolibri1_1", "laguna", "lara_mini", "lfm2_moe",
            "longcat_flash", "mellum", "mimo_v2_flash", "minicpm5_moe", "phimoe", "solar_open", "zaya")
# families whose checkpoints python -m ktfp8.convert cannot read (GraniteMoE's experts are stored fused
# under other names, block_sparse_moe.input_linear / output_linear): quantized on load only
ON_LOAD_ONLY = {"granitemoe", "granitemoehybrid", "granitemoeshared"}
# experts classes that clamp their SwiGLU after the activation (Bailing-Hybrid, Step-3.5/3.7), which the kernels
# do not compute: refused, and the oracle below tells them apart (a check that the comparison can fail)
CLAMPED_AFTER = {"bailing_hybrid": "BailingHybridExperts", "step3p7": "Step3p7Experts"}


@pytest.fixture(autouse=True)
def settings(monkeypatch):
    yield from tiny_model_settings(monkeypatch)      # float32 kernels, 1 thread


def _quantized_per_channel(model):
    """`model` (eager experts) with every experts module's weights replaced by their per-channel FP8
    round trip: what the ktfp8 layers compute with."""
    for _, ex, _ in hf_experts.experts_modules(model):
        write_experts(ex, per_channel_experts(ex))
    return model


def _check_against(model, oracle):
    assert nmse(logits(model), logits(oracle)) < NMSE_MAX
    assert greedy(model) == greedy(oracle)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_whole_model_both_loading_paths(model_type, tmp_path):
    bf16 = save_model(build_family_model(model_type), tmp_path / "bf16")
    oracle = _quantized_per_channel(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32,
                                                                         experts_implementation="eager"))
    classes = {type(ex).__name__ for _, ex, _ in hf_experts.experts_modules(oracle)}
    assert classes, "the tiny model has no routed experts"
    assert {hf_experts.SUPPORTED_EXPERTS.get(c) for c in classes} == {model_type}, classes

    on_load = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32, experts_implementation="ktfp8")
    _check_against(on_load, oracle)

    fp8 = tmp_path / "fp8"
    converted = convert(["--input-type", "bf16", "--input-path", str(bf16), "--output-path", str(fp8),
                         "--quant-config", PER_CHANNEL])
    if model_type in ON_LOAD_ONLY:
        assert converted == 1 and not fp8.exists()
        return
    assert converted == 0
    mapped = ktfp8.hf.from_pretrained(fp8, dtype=torch.float32)
    _check_against(mapped, oracle)
    assert all(ex.gate_up_proj.numel() == 0 for _, ex, _ in hf_experts.experts_modules(mapped))


def test_gemma4_vision_language_model_both_loading_paths(tmp_path):
    """Gemma 4's released checkpoints are its vision-language model, experts fused under
    model.language_model.layers.<n>.experts: quantized on load, and converted then mapped by
    ktfp8.hf.from_pretrained, both against the eager experts on the same FP8 weights."""
    from transformers import AutoModelForImageTextToText
    bf16 = save_model(build_gemma4_vision_language_model(), tmp_path / "bf16")
    oracle = _quantized_per_channel(AutoModelForImageTextToText.from_pretrained(bf16, dtype=torch.float32,
                                                                                experts_implementation="eager"))
    assert [name for name, _, _ in hf_experts.experts_modules(oracle)] == \
        [f"model.language_model.layers.{n}.experts" for n in range(2)]
    on_load = AutoModelForImageTextToText.from_pretrained(bf16, dtype=torch.float32, experts_implementation="ktfp8")
    assert nmse(logits(on_load), logits(oracle)) < NMSE_MAX
    fp8 = tmp_path / "fp8"
    assert convert(["--input-type", "bf16", "--input-path", str(bf16), "--output-path", str(fp8),
                    "--quant-config", PER_CHANNEL]) == 0
    mapped = ktfp8.hf.from_pretrained(fp8, dtype=torch.float32)
    assert type(mapped).__name__ == "Gemma4ForConditionalGeneration"
    assert nmse(logits(mapped), logits(oracle)) < NMSE_MAX


def _experts_alone(cls_name, model_type):
    """(experts module of class `cls_name` built from `model_type`'s tiny config, weights drawn so that
    the gate and up products reach +-50, x, top-k ids and weights)."""
    config = tiny_config(model_type).get_text_config()
    modeling = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    cls = getattr(modeling, cls_name)
    torch.manual_seed(1)
    params = inspect.signature(cls.__init__).parameters
    # Ernie-4.5-VL's blocks give their experts one of the config's widths (text, vision): the text one
    width = {"intermediate_size": config.moe_intermediate_size[0]} if "intermediate_size" in params else {}
    module = cls(config, 0, **width) if "layer_idx" in params else cls(config, **width)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * torch.exp(torch.randn(p.shape[0], p.shape[1], 1)) / p.shape[-1] ** 0.5)
    tokens, experts, top_k = 13, module.num_experts, 2
    x = 20 * torch.randn(tokens, module.hidden_dim)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    return module, x, ids, torch.rand(tokens, top_k)


def _ktfp8_against_eager(module, x, ids, w):
    """NMSE of the module's output under experts_implementation "ktfp8" against its eager output on the
    per-channel FP8 round trip of its weights."""
    theirs = copy.deepcopy(module)
    write_experts(theirs, per_channel_experts(theirs))
    with torch.no_grad():
        theirs.config._experts_implementation = "eager"
        want = theirs(x, ids, w)
        module.config._experts_implementation = "ktfp8"
        got = module(x, ids, w)
    return nmse(got.numpy(), want.numpy())


def _family_of(text_model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return text_model_type if text_model_type in CONFIG_MAPPING else text_model_type.removesuffix("_text")


@pytest.mark.parametrize("cls_name", sorted(hf_experts.SUPPORTED_EXPERTS))
def test_every_supported_experts_class_alone(cls_name):
    module, x, ids, w = _experts_alone(cls_name, _family_of(hf_experts.SUPPORTED_EXPERTS[cls_name]))
    assert _ktfp8_against_eager(module, x, ids, w) < NMSE_MAX


@pytest.mark.parametrize("model_type", sorted(CLAMPED_AFTER))
def test_experts_clamped_after_silu_refused_and_told_apart(model_type, monkeypatch):
    cls_name = CLAMPED_AFTER[model_type]
    module, x, ids, w = _experts_alone(cls_name, _family_of(model_type))
    module.limit = 2.0                      # (their configs' default per-layer limits are 0 or None: none)
    with pytest.raises(ValueError, match=f"{cls_name} .* is not supported"):
        hf_experts.check_supported(module)
    monkeypatch.setitem(hf_experts.SUPPORTED_EXPERTS, cls_name, model_type)     # past the refusal
    assert _ktfp8_against_eager(module, x, ids, w) > 1e-3
