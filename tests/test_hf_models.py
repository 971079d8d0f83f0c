"""ktfp8.hf on tiny random models of every supported architecture, both loading paths, against the same
transformers model running its own eager experts on the dequantized FP8 weights (float32 throughout,
so that only the order of float32 additions differs)."""
import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

import ktfp8.hf  # noqa: E402
import ktfp8.loader  # noqa: E402
from hf_models import (ALL_MODELS, EXPERTS, FUSED_MODELS, HIDDEN, MOE_INTER, build_model, expert_name,  # noqa: E402
                       moe_layers, save_model)
from hf_oracle import (BLOCK_TOO, checkpoint_experts, eager_model, experts_module, greedy, logits,  # noqa: E402
                       model_folders, per_channel_roundtrip, set_experts, tiny_model_settings)
from ktfp8.convert import main as convert  # noqa: E402
from ktfp8.generate import main as generate  # noqa: E402
from ktfp8.hf.experts import SUPPORTED_EXPERTS  # noqa: E402
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


def test_the_multi_token_prediction_block_is_left_out(tmp_path_factory, tmp_path):
    """Qwen3-Next and Qwen3.5 checkpoints hold a multi-token-prediction block under 'mtp.', its experts
    as mtp.layers.0.mlp.experts.<e>.*, beside the decoder's layer 0.  transformers leaves 'mtp.' out of
    the model, and so does the loader: it refused the converted folder (layer 0 under two prefixes).
    The MTP experts here are zeros, so that loading them instead would change the logits."""
    from safetensors.torch import load_file, save_file
    folders = model_folders("qwen3_next", tmp_path_factory)
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    for f in folders["bf16"].iterdir():
        (bf16 / f.name).write_bytes(f.read_bytes())
    tensors = load_file(bf16 / "model.safetensors")
    stack = expert_name("qwen3_next", 0, 0, "gate").split(".0.gate_proj.")[0]
    tensors.update({"mtp." + n[len("model."):]: torch.zeros_like(t) for n, t in tensors.items()
                    if n.startswith(stack + ".")})
    save_file(tensors, bf16 / "model.safetensors", metadata={"format": "pt"})
    assert convert(["--input-type", "bf16", "--input-path", str(bf16), "--output-path", str(tmp_path / "fp8")]) == 0
    assert ktfp8.loader.FP8SafeTensorLoader(tmp_path / "fp8").moe_layers() == moe_layers("qwen3_next")
    _check_against(ktfp8.hf.from_pretrained(tmp_path / "fp8", dtype=torch.float32),
                   eager_model(folders["bf16"], "qwen3_next", fp8_folder=folders["fp8"]))


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
        ex = experts_module(oracle, layer)
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


def _assert_routed_as(ids, weights, hf_ids, hf_weights):
    """ktfp8.route's experts and weights are a transformers router's, in whatever order each lists them."""
    order = np.argsort(hf_ids.numpy(), axis=1)
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.take_along_axis(hf_ids.numpy(), order, 1))
    np.testing.assert_allclose(np.take_along_axis(weights, np.argsort(ids, axis=1), 1),
                               np.take_along_axis(hf_weights.numpy(), order, 1), rtol=1e-6)


@pytest.fixture(scope="module", params=sorted(FUSED_MODELS))
def fused(request, tmp_path_factory):
    """(kind, BF16 checkpoint as transformers saves it: each layer's experts fused in transformers' layout,
    [E, 2I, H] and [E, H, I]; Qwen3-VL-MoE's Hub checkpoints, transposed, are test_convert.py's)."""
    root = tmp_path_factory.mktemp(request.param)
    return request.param, save_model(build_model(request.param), root / "bf16")


def test_fused_checkpoint_quantized_on_load_and_prepared(fused):
    """Mistral 4 (Mistral4Experts) and Qwen3-VL-MoE (Qwen3VLMoeTextExperts, text_config qwen3_vl_moe_text):
    AutoModelForImageTextToText quantizes their experts on load, and prepare takes the eager-loaded model;
    both run what transformers' eager experts compute on the same per-channel FP8 weights."""
    kind, folder = fused
    oracle = _vision_language_oracle(folder, kind)
    on_load = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                          experts_implementation="ktfp8")
    prepared = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    assert ktfp8.hf.prepare(prepared) is prepared
    expected = logits(oracle)
    for model in (on_load, prepared):
        assert model.config.model_type == kind
        assert nmse(logits(model), expected) < NMSE_MAX
        for layer in moe_layers(kind):           # the transformers expert weights are released
            ex = experts_module(model, layer)
            assert type(ex).__name__ in SUPPORTED_EXPERTS
            assert ex.gate_up_proj.numel() == 0 and ex.down_proj.numel() == 0
    assert greedy(on_load) == greedy(oracle)


def test_fused_checkpoint_converts_to_an_fp8_folder_the_loader_runs(fused, tmp_path):
    """python -m ktfp8.convert splits the fused experts into per-expert FP8 weights; FP8SafeTensorLoader's
    config and experts, run by ktfp8.route and ktfp8.MoE, give each MoE layer's routing and experts'
    output as the model's router and transformers' eager experts on the same per-channel FP8 weights."""
    kind, folder = fused
    assert convert(["--input-type", "bf16", "--input-path", str(folder), "--output-path", str(tmp_path / "fp8")]) == 0
    loader = ktfp8.loader.FP8SafeTensorLoader(tmp_path / "fp8")
    assert loader.format == "fp8_per_channel" and loader.moe_layers() == moe_layers(kind)
    oracle = _vision_language_oracle(folder, kind)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((9, oracle.config.get_text_config().hidden_size),
                                                                  dtype=np.float32))
    for layer in moe_layers(kind):
        experts = experts_module(oracle, layer)
        gate = getattr(oracle.model, "language_model", oracle.model).layers[layer].mlp.gate
        with torch.no_grad():
            router_logits, hf_weights, hf_ids = gate(x)
            ids, weights = ktfp8.route(router_logits.numpy(), loader.config)
            _assert_routed_as(ids, weights, hf_ids, hf_weights)
            expected = experts(x, torch.from_numpy(ids), torch.from_numpy(weights)).numpy()
        y = ktfp8.MoE(loader.config, loader.load_experts(layer))(x.numpy(), ids, weights)
        assert nmse(y, expected) < NMSE_MAX


def test_fused_checkpoint_fp8_folder_through_from_pretrained_and_generate(fused, tmp_path, capsys):
    """transformers 5.25 has no AutoModelForCausalLM class for either model type: from_pretrained and
    generate load them with AutoModelForImageTextToText.  The FP8 folder convert writes runs as
    transformers' eager experts on its weights; generate prints the greedy tokens of that model from both
    folders.  On the BF16 folder itself from_pretrained says the experts are fused and convert splits them."""
    kind, folder = fused
    fused_tensor = f"'{expert_name(kind, 0, 0, 'down').split('.0.down_proj')[0]}.down_proj' " \
        f"{[EXPERTS, HIDDEN, MOE_INTER]}"
    with pytest.raises(ValueError, match=re.escape(f"its routed experts are stored fused (e.g. {fused_tensor}); "
                                                   f"ktfp8.hf.from_pretrained loads FP8 folders of per-expert "
                                                   f"tensors only (...experts.<e>.gate_proj.weight, up_proj, "
                                                   f"down_proj): python -m ktfp8.convert writes them, also from "
                                                   f"the fused experts of mistral4, qwen3_vl_moe, lara_mini, "
                                                   f"granitemoe_swa, hy_v4, zaya")):
        ktfp8.hf.from_pretrained(folder)
    fp8 = tmp_path / "fp8"
    assert convert(["--input-type", "bf16", "--input-path", str(folder), "--output-path", str(fp8)]) == 0
    model = ktfp8.hf.from_pretrained(fp8, dtype=torch.float32)
    assert type(model).__name__ == FUSED_MODELS[kind][1]
    oracle = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager")
    for layer in moe_layers(kind):
        set_experts(oracle, layer, checkpoint_experts(fp8, kind, layer, experts_module(oracle, layer).num_experts))
        assert experts_module(model, layer).gate_up_proj.numel() == 0
    _check_against(model, oracle)
    capsys.readouterr()
    prompt = "3,17,42,99,5"
    for path in (fp8, folder):
        assert generate(["--model", str(path), "--prompt-ids", prompt, "--max-new-tokens", "8", "--json",
                         "--threads", "1"]) == 0
        ids = json.loads(capsys.readouterr().out)["ids"]
        expected = ktfp8.hf.from_pretrained(fp8) if path == fp8 else ktfp8.hf.prepare(
            AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16))
        with torch.inference_mode():
            out = expected.generate(torch.tensor([[3, 17, 42, 99, 5]]), max_new_tokens=8, do_sample=False,
                                    pad_token_id=0)
        assert ids == out[0, 5:].tolist()[:len(ids)] and len(ids) > 0


def test_ernie_fp8_folder_routes_with_its_checkpoint_bias(tmp_path):
    """Ernie 4.5 routes by softmax with a correction bias kept in the checkpoint as
    mlp.moe_statics.e_score_correction_bias [1, E]: loader.config and that tensor, reshaped, give route()
    the experts and weights of the model's own router."""
    model = build_model("ernie4_5_moe")
    layer = moe_layers("ernie4_5_moe")[0]
    gate = model.model.layers[layer].mlp.gate
    with torch.no_grad():
        gate.moe_statics.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, EXPERTS)[None])
    bf16 = save_model(model, tmp_path / "bf16", dtype="float32")
    assert convert(["--input-type", "fp32", "--input-path", str(bf16), "--output-path", str(tmp_path / "fp8")]) == 0
    loader = ktfp8.loader.FP8SafeTensorLoader(tmp_path / "fp8")
    bias = loader.tensor(f"model.layers.{layer}.mlp.moe_statics.e_score_correction_bias").reshape(-1)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((64, HIDDEN), dtype=np.float32))
    with torch.no_grad():
        router_logits, hf_weights, hf_ids = gate(x)
    ids, weights = ktfp8.route(router_logits.numpy(), loader.config, correction_bias=bias)
    _assert_routed_as(ids, weights, hf_ids, hf_weights)
    unbiased = ktfp8.route(router_logits.numpy(), loader.config)[0]       # the bias changes choices here
    assert (np.sort(unbiased, axis=1) != np.sort(ids, axis=1)).any()


def test_hunyuan_top_k_listed_per_layer(tmp_path, capsys):
    """Hunyuan-A13B's config.json lists moe_topk per layer, and transformers' HunYuanMoEV1Gate takes
    moe_topk[layer_idx]: each ktfp8 layer takes its own router's top-k (1 and 3 here, so a layer built with
    the other's would refuse the router's output) on all three paths, and generate runs the FP8 folder."""
    kind = "hunyuan_v1_moe"
    bf16 = save_model(build_model(kind, moe_topk=[1, 3]), tmp_path / "bf16")
    fp8 = tmp_path / "fp8"
    assert convert(["--input-type", "bf16", "--input-path", str(bf16), "--output-path", str(fp8),
                    "--threads", "1"]) == 0
    on_load = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32, experts_implementation="ktfp8")
    prepared = ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32))
    from_fp8 = ktfp8.hf.from_pretrained(fp8, dtype=torch.float32)
    quantized_here, fp8_oracle = eager_model(bf16, kind), eager_model(bf16, kind, fp8_folder=fp8)
    assert [layer.mlp.gate.top_k for layer in fp8_oracle.model.layers] == [1, 3]
    for model, oracle in ((on_load, quantized_here), (prepared, quantized_here), (from_fp8, fp8_oracle)):
        _check_against(model, oracle)
        held = [ktfp8.hf.op.layer_of(experts_module(model, layer)._ktfp8_handle).moe.config.num_experts_per_tok
                for layer in moe_layers(kind)]
        assert held == [1, 3]
    capsys.readouterr()
    assert generate(["--model", str(fp8), "--prompt-ids", "3,17,42", "--max-new-tokens", "4", "--json",
                     "--threads", "1"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) > 0
