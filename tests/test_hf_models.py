"""ktfp8.hf on tiny random models of every supported architecture, both loading paths, against the same
transformers model running its own eager experts on the dequantized FP8 weights (float32 throughout,
so that only the order of float32 additions differs)."""
import re
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

import ktfp8.hf  # noqa: E402
from hf_models import ALL_MODELS, build_model, moe_layers, save_model  # noqa: E402
from hf_oracle import (BLOCK_TOO, eager_model, experts_module, greedy, logits, per_channel_roundtrip,  # noqa: E402
                       model_folders, tiny_model_settings)
from ktfp8.convert import main as convert  # noqa: E402
from ktfp8.generate import main as generate  # noqa: E402
from moe_oracle import nmse  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: E402

NMSE_MAX = 1e-8     # float32 on the same weights: the sums' order alone differs (measured ~1e-12)


@pytest.fixture(autouse=True)
def settings(monkeypatch):
    yield from tiny_model_settings(monkeypatch)      # float32 kernels (except where a test says), 1 thread


@pytest.fixture(params=sorted(ALL_MODELS))
def folders(request, tmp_path_factory):
    return model_folders(request.param, tmp_path_factory)


def _check_against(model, oracle):
    assert nmse(logits(model), logits(oracle)) < NMSE_MAX
    assert greedy(model) == greedy(oracle)


def test_bf16_folder_quantized_per_channel_on_load(folders):
    model = AutoModelForCausalLM.from_pretrained(folders["bf16"], dtype=torch.float32,
                                                 experts_implementation="ktfp8")
    _check_against(model, eager_model(folders["bf16"], folders["kind"]))
    for layer in moe_layers(folders["kind"]):          # the transformers expert weights are released
        ex = experts_module(model, layer)
        assert ex.gate_up_proj.numel() == 0 and ex.down_proj.numel() == 0


def test_fp8_folder_loaded_memory_mapped(folders):
    model = ktfp8.hf.from_pretrained(folders["fp8"], dtype=torch.float32)
    _check_against(model, eager_model(folders["bf16"], folders["kind"], fp8_folder=folders["fp8"]))
    for layer in moe_layers(folders["kind"]):
        assert experts_module(model, layer).gate_up_proj.numel() == 0


@pytest.mark.parametrize("kind", sorted(BLOCK_TOO))
def test_block_wise_both_paths(kind, tmp_path_factory):
    folders = model_folders(kind, tmp_path_factory)
    oracle = eager_model(folders["bf16"], folders["kind"], fp8_folder=folders["fp8_block"])
    _check_against(ktfp8.hf.from_pretrained(folders["fp8_block"], dtype=torch.float32), oracle)
    quantized_on_load = AutoModelForCausalLM.from_pretrained(folders["bf16"], dtype=torch.float32,
                                                             experts_implementation="ktfp8_block")
    _check_against(quantized_on_load, oracle)


def test_bf16_experts_and_bfloat16_activations(tmp_path_factory, monkeypatch):
    """ktfp8_bf16 computes on the checkpoint's own weights: the oracle is the plain transformers model."""
    folders = model_folders("mixtral", tmp_path_factory)
    oracle = AutoModelForCausalLM.from_pretrained(folders["bf16"], dtype=torch.float32,
                                                  experts_implementation="eager")
    model = AutoModelForCausalLM.from_pretrained(folders["bf16"], dtype=torch.float32,
                                                 experts_implementation="ktfp8_bf16")
    _check_against(model, oracle)
    # a bfloat16 model on this CPU's best backend: logits close to transformers' on the same FP8 weights
    monkeypatch.delenv("KTFP8_BACKEND")
    model = ktfp8.hf.from_pretrained(folders["fp8"])
    oracle = eager_model(folders["bf16"], "mixtral", fp8_folder=folders["fp8"]).to(torch.bfloat16)
    assert nmse(logits(model), logits(oracle)) < 1e-3
    assert model.dtype == torch.bfloat16


def _vision_language_oracle(bf16_folder, kind):
    """The float32 AutoModelForImageTextToText model of `bf16_folder`, transformers' eager experts computing
    on the per-channel FP8 quantization of its own expert weights (dequantized with ml_dtypes)."""
    oracle = AutoModelForImageTextToText.from_pretrained(bf16_folder, dtype=torch.float32,
                                                         experts_implementation="eager")
    for layer in moe_layers(kind):
        ex = oracle.model.language_model.layers[layer].mlp.experts
        inter = ex.intermediate_dim
        with torch.no_grad():
            gate_up = ex.gate_up_proj.numpy()
            ex.gate_up_proj.copy_(torch.from_numpy(np.concatenate(
                [per_channel_roundtrip(gate_up[:, :inter]), per_channel_roundtrip(gate_up[:, inter:])], axis=1)))
            ex.down_proj.copy_(torch.from_numpy(per_channel_roundtrip(ex.down_proj.numpy())))
    return oracle


def test_prepare_takes_the_whole_vision_language_model(tmp_path_factory):
    """A Qwen3.5-MoE checkpoint as AutoModelForImageTextToText loads it: config model_type qwen3_5_moe, the
    experts in its text model (text_config qwen3_5_moe_text).  prepare takes it and runs what transformers'
    eager experts compute on the same per-channel FP8 weights."""
    folders = model_folders("qwen3_5_moe", tmp_path_factory)
    model = AutoModelForImageTextToText.from_pretrained(folders["bf16"], dtype=torch.float32)
    oracle = _vision_language_oracle(folders["bf16"], "qwen3_5_moe")
    assert model.config.model_type == "qwen3_5_moe" and "qwen3_5_moe" not in ktfp8.hf.SUPPORTED_MODEL_TYPES
    assert ktfp8.hf.prepare(model) is model
    assert nmse(logits(model), logits(oracle)) < NMSE_MAX
    for layer in moe_layers("qwen3_5_moe"):
        assert model.model.language_model.layers[layer].mlp.experts.gate_up_proj.numel() == 0


@pytest.fixture(scope="module")
def qwen3_vl_moe(tmp_path_factory):
    """A Qwen3-VL-MoE BF16 checkpoint as transformers saves it: each layer's experts fused."""
    return save_model(build_model("qwen3_vl_moe"), tmp_path_factory.mktemp("qwen3_vl_moe") / "bf16")


def test_qwen3_vl_moe_quantized_on_load_and_prepared(qwen3_vl_moe):
    """Qwen3-VL-MoE (experts Qwen3VLMoeTextExperts, text_config qwen3_vl_moe_text): AutoModelForImageTextToText
    quantizes its experts on load, and prepare takes the eager-loaded model; both run what transformers' eager
    experts compute on the same per-channel FP8 weights."""
    oracle = _vision_language_oracle(qwen3_vl_moe, "qwen3_vl_moe")
    on_load = AutoModelForImageTextToText.from_pretrained(qwen3_vl_moe, dtype=torch.float32,
                                                          experts_implementation="ktfp8")
    prepared = AutoModelForImageTextToText.from_pretrained(qwen3_vl_moe, dtype=torch.float32)
    assert ktfp8.hf.prepare(prepared) is prepared
    expected = logits(oracle)
    for model in (on_load, prepared):
        assert model.config.model_type == "qwen3_vl_moe"
        assert nmse(logits(model), expected) < NMSE_MAX
        for layer in moe_layers("qwen3_vl_moe"):           # the transformers expert weights are released
            ex = model.model.language_model.layers[layer].mlp.experts
            assert type(ex).__name__ == "Qwen3VLMoeTextExperts"
            assert ex.gate_up_proj.numel() == 0 and ex.down_proj.numel() == 0
    assert greedy(on_load) == greedy(oracle)


def test_qwen3_vl_moe_checkpoint_has_no_fp8_folder_path(qwen3_vl_moe, tmp_path, capsys):
    """Its experts are stored fused, which convert does not read (per-expert tensors only), and
    AutoModelForCausalLM, which from_pretrained and generate load with, has no class for it: each refuses
    with a message that says so and names the way that works, nothing written, no traceback."""
    fused = "'model.language_model.layers.0.mlp.experts.down_proj' [4, 160, 96]"
    works = 'from_pretrained(path, experts_implementation="ktfp8") after `import ktfp8.hf`'
    for extra in ([], ["--all-linear"]):
        out = tmp_path / "fp8"
        assert convert(["--input-type", "bf16", "--input-path", str(qwen3_vl_moe), "--output-path", str(out),
                        *extra]) == 1
        err = capsys.readouterr().err
        assert f"tensor {fused} holds a layer's routed experts fused in one 3-D tensor; python -m ktfp8.convert " \
               f"reads per-expert tensors only" in err and works in err, err
        assert ("refused with --all-linear too" in err) == bool(extra)
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=re.escape(f"its routed experts are stored fused (e.g. {fused}); "
                                                   f"ktfp8.hf.from_pretrained loads FP8 folders written by")):
        ktfp8.hf.from_pretrained(qwen3_vl_moe)
    assert generate(["--model", str(qwen3_vl_moe), "--prompt-ids", "1,2,3"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ktfp8.generate: error: {qwen3_vl_moe}: cannot load the model: model type "
                          f"'qwen3_vl_moe' has no transformers AutoModelForCausalLM class"), err
    assert "AutoModelForImageTextToText.from_pretrained(bf16_path, experts_implementation='ktfp8')" in err
    assert "Traceback" not in err and err.count("\n") == 1
    # the same experts stored per expert (as some FP8 checkpoints hold them) convert, but from_pretrained
    # cannot load the result: AutoModelForCausalLM has no class for qwen3_vl_moe
    per_expert = tmp_path / "per_expert"
    per_expert.mkdir()
    shutil.copy(qwen3_vl_moe / "config.json", per_expert / "config.json")
    tensors = load_file(qwen3_vl_moe / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".experts.gate_up_proj")]:
        stack = name.rsplit(".", 1)[0]
        gate, up = tensors.pop(name).chunk(2, dim=1)
        down = tensors.pop(stack + ".down_proj")
        for e in range(down.shape[0]):
            for role, w in (("gate", gate), ("up", up), ("down", down)):
                tensors[f"{stack}.{e}.{role}_proj.weight"] = w[e].contiguous()
    save_file(tensors, per_expert / "model.safetensors", metadata={"format": "pt"})
    assert convert(["--input-type", "bf16", "--input-path", str(per_expert), "--output-path",
                    str(tmp_path / "fp8")]) == 0
    with pytest.raises(ValueError, match=re.escape("model type 'qwen3_vl_moe' has no transformers "
                                                   "AutoModelForCausalLM class")):
        ktfp8.hf.from_pretrained(tmp_path / "fp8")
