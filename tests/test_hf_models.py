"""ktfp8.hf on tiny random models of every supported architecture, both loading paths, against the same
transformers model running its own eager experts on the dequantized FP8 weights (float32 throughout,
so that only the order of float32 additions differs)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

import ktfp8.hf  # noqa: E402
from hf_models import ALL_MODELS, moe_layers  # noqa: E402
from hf_oracle import (BLOCK_TOO, eager_model, experts_module, greedy, logits, per_channel_roundtrip,  # noqa: E402
                       model_folders, tiny_model_settings)
from moe_oracle import nmse  # noqa: E402
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


def test_prepare_takes_the_whole_vision_language_model(tmp_path_factory):
    """A Qwen3.5-MoE checkpoint as AutoModelForImageTextToText loads it: config model_type qwen3_5_moe, the
    experts in its text model (text_config qwen3_5_moe_text).  prepare takes it and runs what transformers'
    eager experts compute on the same per-channel FP8 weights."""
    folders = model_folders("qwen3_5_moe", tmp_path_factory)
    model = AutoModelForImageTextToText.from_pretrained(folders["bf16"], dtype=torch.float32)
    oracle = AutoModelForImageTextToText.from_pretrained(folders["bf16"], dtype=torch.float32,
                                                         experts_implementation="eager")
    assert model.config.model_type == "qwen3_5_moe" and "qwen3_5_moe" not in ktfp8.hf.SUPPORTED_MODEL_TYPES
    for layer in moe_layers("qwen3_5_moe"):
        ex = oracle.model.language_model.layers[layer].mlp.experts
        inter = ex.intermediate_dim
        with torch.no_grad():
            gate_up = ex.gate_up_proj.numpy()
            ex.gate_up_proj.copy_(torch.from_numpy(np.concatenate(
                [per_channel_roundtrip(gate_up[:, :inter]), per_channel_roundtrip(gate_up[:, inter:])], axis=1)))
            ex.down_proj.copy_(torch.from_numpy(per_channel_roundtrip(ex.down_proj.numpy())))
    assert ktfp8.hf.prepare(model) is model
    assert nmse(logits(model), logits(oracle)) < NMSE_MAX
    for layer in moe_layers("qwen3_5_moe"):
        assert model.model.language_model.layers[layer].mlp.experts.gate_up_proj.numel() == 0
