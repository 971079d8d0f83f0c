"""FP8SafeTensorLoader on real Hugging Face checkpoints (tiny random transformers models), converted by
ktfp8.convert or written in other engines' layouts; oracles: safetensors + torch, ml_dtypes, transformers."""
import copy
import json
import math
import mmap
import re
import shutil

import ml_dtypes
import numpy as np
import pytest

from hf_models import (EXPERTS, HIDDEN, MODELS, MOE_INTER, build_model, expert_name, fuse_experts, moe_layers,
                       read_experts, save_model, sqnr_db)
from ktfp8.convert import main as convert
from ktfp8.experts import ExpertMatrices, quantize_experts
from ktfp8.loader import FP8SafeTensorLoader
from ktfp8.moe import MoE
from open_files import open_files_under
from ktfp8.safetensors_io import SafetensorsError, SafetensorsFile, write_file

torch = pytest.importorskip("torch")
E4M3 = ml_dtypes.float8_e4m3fn
ROLES = ("gate", "up", "down")
PER_CHANNEL = '{"method": "FP8", "per_channel": true}'
BLOCK_128 = '{"method": "FP8", "per_channel": false, "group_size": 128}'


@pytest.fixture(scope="module", params=sorted(MODELS))
def hf(request, tmp_path_factory):
    """kind, the float32 model, and its bf16 checkpoint folders: single file and sharded."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model = build_model(kind)
    single = save_model(model, root / "bf16")
    sharded = save_model(model, root / "bf16_sharded", max_shard_size="100KB")
    model = model.float()
    return kind, model, single, sharded


def _convert(src, dst, quant=PER_CHANNEL, input_type="bf16", *extra):
    rc = convert(["--input-type", input_type, "--input-path", str(src), "--output-path", str(dst),
                  "--quant-config", quant, "--threads", "2", *extra])
    assert rc == 0
    return dst


def _memory_mapped(a):
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)) or isinstance(a, memoryview) and isinstance(a.obj, mmap.mmap):
            return True
        a = getattr(a, "base", None)
    return False


def _oracle_per_channel(w):
    """(codes, scale) of per-channel E4M3 quantization by ml_dtypes: scale = amax / 448 (float32)."""
    w = np.asarray(w, np.float32)
    scale = (np.abs(w).max(axis=-1, keepdims=True) / np.float32(448)).astype(np.float32)
    scale[scale == 0] = 1
    codes = np.clip(w / scale, -448, 448).astype(E4M3).view(np.uint8)
    return codes, scale


def _dequant_block(codes, scale, block):
    bn, bk = block
    full = np.repeat(np.repeat(scale, bn, axis=-2), bk, axis=-1)[..., :codes.shape[-2], :codes.shape[-1]]
    return codes.view(E4M3).astype(np.float32) * full


def test_bf16_checkpoints_load_as_stored(hf):
    kind, _, single, sharded = hf
    for folder in (single, sharded):
        loader = FP8SafeTensorLoader(folder)
        assert loader.format == "bf16"
        assert loader.moe_layers() == moe_layers(kind)
        for layer in loader.moe_layers():
            experts = loader.load_experts(layer)
            assert experts.format == "bf16"
            for role in ROLES:
                got = getattr(experts, role)
                np.testing.assert_array_equal(np.asarray(got).astype(np.float32),
                                              read_experts(folder, kind, layer, role))
                # HF writes one layer's experts at equal distances: one view; a sharded folder may split
                # a layer between files: a view per expert (ExpertMatrices).  No copy either way.
                for a in got.matrices if isinstance(got, ExpertMatrices) else (got,):
                    assert not a.flags.writeable and _memory_mapped(a)
    if len(list(sharded.glob("*.safetensors"))) < 2:
        pytest.fail("the sharded fixture should span several files")


def test_fp16_experts_load_as_stored_for_quantize_experts(hf, tmp_path):
    """An FP16 checkpoint: load_experts refuses, pointing to load_expert_tensors, which gives the stored
    float16 weights (every expert, or a range of them) that quantize_experts takes."""
    kind, model, _, _ = hf
    folder = save_model(copy.deepcopy(model), tmp_path / "fp16", dtype="float16")
    loader = FP8SafeTensorLoader(folder)
    assert loader.format == "fp16"
    layer = moe_layers(kind)[0]
    with pytest.raises(ValueError, match=rf"quantize load_expert_tensors\({layer}\) with ktfp8.quantize_experts"):
        loader.load_experts(layer)
    tensors = loader.load_expert_tensors(layer)
    for role, got in zip(ROLES, tensors):
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got.astype(np.float32), read_experts(folder, kind, layer, role))
    for whole, part in zip(tensors, loader.load_expert_tensors(layer, experts=range(1, 3))):
        np.testing.assert_array_equal(part, whole[1:3])
    experts = quantize_experts(*tensors, loader.quant_config)
    for role, w in zip(ROLES, tensors):
        codes, scale = _oracle_per_channel(w)
        np.testing.assert_array_equal(getattr(experts, role), codes)
        np.testing.assert_array_equal(getattr(experts, role + "_scale"), scale)


@pytest.mark.parametrize("sharded", [False, True])
def test_per_channel_conversion_round_trip(hf, tmp_path, sharded):
    kind, _, single, many = hf
    src = many if sharded else single
    out = _convert(src, tmp_path / "fp8", PER_CHANNEL, "bf16", "--max-shard-size", "200KB")
    loader = FP8SafeTensorLoader(out)
    assert loader.format == "fp8_per_channel"
    assert loader.moe_layers() == moe_layers(kind)
    for layer in loader.moe_layers():
        experts = loader.load_experts(layer)
        assert experts.format == "fp8_per_channel"
        for role in ROLES:
            codes, scale = getattr(experts, role), getattr(experts, role + "_scale")
            original = read_experts(src, kind, layer, role)
            want_codes, want_scale = _oracle_per_channel(original)
            np.testing.assert_array_equal(scale, want_scale)
            np.testing.assert_array_equal(codes, want_codes)
            assert _memory_mapped(codes) and _memory_mapped(scale)
            restored = codes.view(E4M3).astype(np.float32) * scale
            assert sqnr_db(original, restored) > 28


def test_closing_the_loader_gives_its_files_back_and_keeps_loaded_experts(hf, tmp_path):
    """close() (or a with block) closes every shard; experts loaded before stay valid (their maps hold
    the files until they are dropped), and a MoE built from them computes as one built while the loader
    was open; reading more is a ValueError, not a reopened file."""
    kind, _, _, many = hf
    out = _convert(many, tmp_path / "fp8", PER_CHANNEL, "bf16", "--max-shard-size", "200KB")
    layer = moe_layers(kind)[0]
    with FP8SafeTensorLoader(out) as loader:
        assert len(open_files_under(out)) > 1            # the shards, open while the loader lives
        experts = loader.load_experts(layer)
        cfg = loader.config
        want = MoE(cfg, experts)
    x = np.random.default_rng(0).standard_normal((3, HIDDEN)).astype(np.float32)
    ids = np.arange(3 * cfg.num_experts_per_tok).reshape(3, -1) % EXPERTS
    w = np.full(ids.shape, 0.5, np.float32)
    np.testing.assert_array_equal(MoE(cfg, experts)(x, ids, w), want(x, ids, w))
    del experts
    assert open_files_under(out) == []
    for read in (lambda: loader.load_experts(layer), lambda: loader.tensor(loader.checkpoint.names()[0])):
        with pytest.raises(ValueError, match="checkpoint is closed"):
            read()
    assert open_files_under(out) == []
    loader.close()                                       # again: nothing to do


def test_block_wise_conversion_round_trip(hf, tmp_path):
    kind, _, single, _ = hf
    out = _convert(single, tmp_path / "fp8b", BLOCK_128, "bf16", "--verify")
    loader = FP8SafeTensorLoader(out)
    assert loader.format == "fp8_block"
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [128, 128]
    for layer in loader.moe_layers():
        experts = loader.load_experts(layer)
        assert experts.block == (128, 128)
        for role in ROLES:
            codes, scale = getattr(experts, role), getattr(experts, role + "_scale")
            original = read_experts(single, kind, layer, role)
            E, n, k = original.shape
            assert scale.shape == (E, math.ceil(n / 128), math.ceil(k / 128))
            # every 128 x 128 block's amax maps to 448 exactly
            for b in range(scale.shape[1]):
                for c in range(scale.shape[2]):
                    amax = np.abs(original[:, b * 128:(b + 1) * 128, c * 128:(c + 1) * 128]).max(axis=(1, 2))
                    np.testing.assert_array_equal(scale[:, b, c], (amax / np.float32(448)).astype(np.float32))
            assert sqnr_db(original, _dequant_block(codes, scale, (128, 128))) > 28


def _write_deepseek_fp8(model, folder, block):
    """A block-wise FP8 checkpoint as DeepSeek-V3 ships it, made with torch (not ktfp8): every Linear
    weight of the decoder layers as float8_e4m3fn + float32 weight_scale_inv; the rest bf16."""
    from safetensors.torch import save_file
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
    tensors = {}
    from safetensors.torch import load_file
    for name, t in load_file(str(folder / "model.safetensors")).items():
        linear = name.endswith(".weight") and t.ndim == 2 and ".layers." in name and "embed" not in name \
            and not name.endswith("mlp.gate.weight") and not name.endswith("block_sparse_moe.gate.weight")
        if not linear:
            tensors[name] = t
            continue
        w = t.float()
        n, k = w.shape
        bn, bk = block
        pad = torch.zeros(math.ceil(n / bn) * bn, math.ceil(k / bk) * bk)
        pad[:n, :k] = w.abs()
        amax = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        tensors[name] = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale.float()
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_block_fp8_input_requantized_per_channel(hf, tmp_path, block):
    kind, model, _, _ = hf
    src = tmp_path / "ds_fp8"
    tensors = _write_deepseek_fp8(model, src, block)
    assert FP8SafeTensorLoader(src).format == "fp8_block"
    out = _convert(src, tmp_path / "pc", PER_CHANNEL, "fp8", "--verify")
    with SafetensorsFile(out / "model.safetensors") as f:
        for name, t in tensors.items():
            if name.endswith("_scale_inv"):
                assert name not in f and name[:-4] in f            # weight_scale_inv -> weight_scale
                continue
            if t.dtype != torch.float8_e4m3fn:
                assert f.read_rows(name).tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()
                continue
            scale_inv = tensors[name + "_scale_inv"].numpy()
            dequant = _dequant_block(t.view(torch.uint8).numpy(), scale_inv, block)
            want_codes, want_scale = _oracle_per_channel(dequant)
            np.testing.assert_array_equal(f.read_rows(name + "_scale"), want_scale)
            np.testing.assert_array_equal(f.read_rows(name), want_codes)
            restored = want_codes.view(E4M3).astype(np.float32) * want_scale
            assert sqnr_db(dequant, restored) > 28
    loader = FP8SafeTensorLoader(out)
    assert loader.format == "fp8_per_channel"
    assert loader.load_experts(moe_layers(kind)[-1]).gate.shape == (loader.load_experts(
        moe_layers(kind)[-1]).expert_num, MOE_INTER, HIDDEN)


def test_block_fp8_input_kept_bit_exact_for_the_same_block(hf, tmp_path):
    kind, model, _, _ = hf
    src = tmp_path / "ds_fp8"
    tensors = _write_deepseek_fp8(model, src, (128, 128))
    out = _convert(src, tmp_path / "blk", BLOCK_128, "fp8", "--verify")
    with SafetensorsFile(out / "model.safetensors") as f:
        for name, t in tensors.items():
            assert f.read_rows(name).tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()


def _rewrite(src_folder, dst_folder, rename=lambda n: n, transform=lambda n, dtype, a: [(n, dtype, a)]):
    """Copies a single-file checkpoint with tensors renamed / transformed (for layouts of other tools)."""
    dst_folder.mkdir()
    out = {}
    with SafetensorsFile(src_folder / "model.safetensors") as f:
        for name, info in f.tensors.items():
            for n, dtype, a in transform(rename(name), info.dtype, f.read_rows(name)):
                out[n] = (dtype, a)
    write_file(dst_folder / "model.safetensors", out, metadata={"format": "pt"})
    shutil.copy(src_folder / "config.json", dst_folder / "config.json")
    return dst_folder


@pytest.mark.parametrize("scale_shape", ["[N]", "[N, 1]"])
def test_compressed_tensors_layout_with_bf16_scales(hf, tmp_path, scale_shape):
    """Per-channel checkpoints of other tools: weight_scale stored as bfloat16, shape [N] or [N, 1]."""
    kind, _, single, _ = hf

    def quantize(name, dtype, a):
        if "experts" not in name or not name.endswith(".weight"):
            return [(name, dtype, a)]
        codes, scale = _oracle_per_channel(a.astype(np.float32))
        scale = scale.astype(ml_dtypes.bfloat16)
        return [(name, "F8_E4M3", codes),
                (name + "_scale", "BF16", scale[:, 0] if scale_shape == "[N]" else scale)]

    folder = _rewrite(single, tmp_path / "ct", transform=quantize)
    loader = FP8SafeTensorLoader(folder)
    assert loader.format == "fp8_per_channel"
    layer = moe_layers(kind)[0]
    experts = loader.load_experts(layer)
    for role in ROLES:
        original = read_experts(single, kind, layer, role)
        codes, scale = _oracle_per_channel(original)
        scale_bf16 = scale.astype(ml_dtypes.bfloat16).astype(np.float32)
        got = getattr(experts, role + "_scale")
        assert got.dtype == np.float32 and got.shape == scale.shape
        np.testing.assert_array_equal(got, scale_bf16)
        np.testing.assert_array_equal(getattr(experts, role), codes)


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
@pytest.mark.parametrize("scale_shape", [[], [1]])
def test_per_tensor_scales_load_as_every_rows_scale(hf, tmp_path, scale_shape, dtype):
    """FP8 checkpoints with one scale per expert matrix (compressed-tensors strategy "tensor", e.g. FP8
    Mixtral releases): a per-channel layout whose rows share one scale, so they load exactly as that."""
    kind, _, single, _ = hf
    np_dtype = np.float32 if dtype == "F32" else ml_dtypes.bfloat16

    def per_tensor(w):
        w = np.asarray(w, np.float32)
        scale = np.float32(np.abs(w).max() / np.float32(448)).astype(np_dtype).astype(np.float32)
        return np.clip(w / scale, -448, 448).astype(E4M3).view(np.uint8), scale

    def quantize(name, dtype_, a):
        if "experts" not in name or not name.endswith(".weight"):
            return [(name, dtype_, a)]
        codes, scale = per_tensor(a)
        return [(name, "F8_E4M3", codes), (name + "_scale", dtype, np.full(scale_shape, scale, np_dtype))]

    experts = FP8SafeTensorLoader(_rewrite(single, tmp_path / "pt", transform=quantize)).load_experts(
        moe_layers(kind)[0])
    for role in ROLES:
        original = read_experts(single, kind, moe_layers(kind)[0], role)
        for e in range(original.shape[0]):
            codes, scale = per_tensor(original[e])
            np.testing.assert_array_equal(getattr(experts, role)[e], codes)
            got = getattr(experts, role + "_scale")[e]
            assert got.shape == (original.shape[1], 1) and (got == scale).all()


def test_language_model_prefix(hf, tmp_path):
    """Multimodal checkpoints put the text model under model.language_model. and config under text_config."""
    kind, _, single, _ = hf
    folder = _rewrite(single, tmp_path / "vl", rename=lambda n: n.replace("model.", "model.language_model.", 1))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "x_vl", "text_config": config}))
    loader = FP8SafeTensorLoader(folder)
    assert loader.moe_layers() == moe_layers(kind)
    layer = moe_layers(kind)[0]
    np.testing.assert_array_equal(loader.load_experts(layer).down.astype(np.float32),
                                  read_experts(single, kind, layer, "down"))
    out = _convert(folder, tmp_path / "vl_fp8")
    assert FP8SafeTensorLoader(out).format == "fp8_per_channel"
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert all(n.startswith(("model.language_model.", "lm_head")) for n in ignore)


def test_loader_errors(hf, tmp_path):
    kind, model, single, _ = hf
    loader = FP8SafeTensorLoader(single)
    with pytest.raises(ValueError, match="has no experts"):
        loader.load_experts(99)
    fp32 = save_model(build_model(kind), tmp_path / "fp32", dtype="float32")
    with pytest.raises(ValueError, match="ktfp8.convert"):
        FP8SafeTensorLoader(fp32).load_experts(moe_layers(kind)[0])
    assert FP8SafeTensorLoader(fp32).format == "fp32"
    layer = moe_layers(kind)[0]
    victim = expert_name(kind, layer, 1, "up")
    holed = _rewrite(single, tmp_path / "holed", transform=lambda n, d, a: [] if n == victim else [(n, d, a)])
    with pytest.raises(SafetensorsError, match=r"up weight missing for experts \[1\]"):
        FP8SafeTensorLoader(holed).load_experts(layer)
    with pytest.raises(SafetensorsError, match="not a directory"):
        FP8SafeTensorLoader(tmp_path / "nowhere")


def test_moe_matches_transformers_block(hf, tmp_path):
    """Converted checkpoint -> loader (experts + MoeConfig) -> ktfp8.route + ktfp8.MoE equals the
    transformers MoE block run on the dequantized weights."""
    import ktfp8
    kind, model, single, _ = hf
    out = _convert(single, tmp_path / "fp8")
    loader = FP8SafeTensorLoader(out)
    cfg = loader.config
    assert (cfg.hidden_size, cfg.intermediate_size) == (HIDDEN, MOE_INTER)
    assert (cfg.quant_config.method, cfg.quant_config.per_channel) == ("FP8", True)
    torch.manual_seed(1)
    for layer in loader.moe_layers():
        experts = loader.load_experts(layer)
        assert cfg.expert_num == experts.expert_num >= EXPERTS
        block = copy.deepcopy(model.model.layers[layer].mlp)
        deq = {r: torch.from_numpy(getattr(experts, r).view(E4M3).astype(np.float32)
                                   * getattr(experts, r + "_scale")) for r in ROLES}
        with torch.no_grad():
            block.experts.gate_up_proj.copy_(torch.cat([deq["gate"], deq["up"]], dim=1))
            block.experts.down_proj.copy_(deq["down"])
            x = torch.randn(1, 7, HIDDEN) * 0.5
            want = block(x)[0]
            if hasattr(block, "shared_experts"):        # DeepSeek: shared experts are not routed experts
                want = want - block.shared_experts(x)[0]
            router = loader.tensor(f"model.layers.{layer}.{'block_sparse_moe' if kind == 'mixtral' else 'mlp'}"
                                   f".gate.weight")
            np.testing.assert_array_equal(router.astype(np.float32), block.gate.weight.numpy())
            logits = x[0].numpy() @ router.astype(np.float32).T
            bias = getattr(block.gate, "e_score_correction_bias", None)
        ids, weights = ktfp8.route(logits, cfg, correction_bias=None if bias is None else bias.numpy())
        got = ktfp8.MoE(cfg, experts)(x[0].numpy(), ids, weights)
        err = np.linalg.norm(got - want.numpy()) / np.linalg.norm(want.numpy())
        assert err < 2e-2, f"layer {layer}: relative error {err}"   # BF16-activation backends: ~4e-3


# -- corrupt or unsupported checkpoints: refused at load, naming the tensor or config.json field ----------
QWEN = "qwen3_moe"


@pytest.fixture(scope="module")
def qwen_folders(tmp_path_factory):
    """One qwen3_moe model as bf16, converted per-channel and block-wise (128): the files tests corrupt."""
    root = tmp_path_factory.mktemp("corrupt")
    bf16 = save_model(build_model(QWEN), root / "bf16")
    return {"bf16": bf16, "per_channel": _convert(bf16, root / "pc"), "block": _convert(bf16, root / "blk", BLOCK_128)}


def _scale_name(fmt, expert, role):
    return expert_name(QWEN, 0, expert, role) + ("_scale" if fmt == "per_channel" else "_scale_inv")


def _with_config(src, dst, edit):
    """A copy of `src` whose config.json is edit(config)."""
    folder = _rewrite(src, dst)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_fused_experts_named_when_a_layer_has_none(qwen_folders, tmp_path):
    """A checkpoint whose routed experts are stored fused (transformers' ...experts.gate_up_proj /
    down_proj, 3-D): the loader reads per-expert tensors only, finds no MoE layer, and says why."""
    src = qwen_folders["bf16"]
    with SafetensorsFile(src / "model.safetensors") as f:
        tensors = {n: (i.dtype, f.read_rows(n)) for n, i in f.tensors.items()}
    fuse_experts(tensors, QWEN, moe_layers(QWEN))
    folder = _rewrite(src, tmp_path / "fused")
    write_file(folder / "model.safetensors", tensors)
    loader = FP8SafeTensorLoader(folder)
    assert loader.moe_layers() == []
    with pytest.raises(ValueError, match=re.escape(
            f"layer 0 has no experts in {folder}; MoE layers: []; its routed experts are stored fused (e.g. "
            f"'model.layers.0.mlp.experts.down_proj' [{EXPERTS}, {HIDDEN}, {MOE_INTER}]), and FP8SafeTensorLoader "
            f"reads per-expert tensors only")):
        loader.load_experts(0)
    with pytest.raises(ValueError, match=r"layer 7 has no experts in .*; MoE layers: \[0, 1\]$"):   # not fused
        FP8SafeTensorLoader(qwen_folders["per_channel"]).load_experts(7)


@pytest.mark.parametrize("fmt", ["per_channel", "block"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -0.5])
def test_non_finite_or_negative_scale_refused(qwen_folders, tmp_path, fmt, value):
    victim = _scale_name(fmt, 1, "up")

    def corrupt(name, dtype, a):
        if name == victim:
            a = a.copy()
            a.flat[1] = value
        return [(name, dtype, a)]

    folder = _rewrite(qwen_folders[fmt], tmp_path / "bad", transform=corrupt)
    with pytest.raises(SafetensorsError, match=re.escape(victim)):
        FP8SafeTensorLoader(folder).load_experts(0)


def test_zero_scale_loads(qwen_folders, tmp_path):
    """Other tools may give an all-zero row scale 0 (ktfp8 writes 1): a valid file, not refused."""
    victim = _scale_name("per_channel", 1, "up")
    folder = _rewrite(qwen_folders["per_channel"], tmp_path / "zero",
                      transform=lambda n, d, a: [(n, d, np.zeros_like(a) if n == victim else a)])
    assert not FP8SafeTensorLoader(folder).load_experts(0).up_scale[1].any()


def test_all_zero_row_converts_and_loads(qwen_folders, tmp_path):
    """ktfp8 gives an all-zero row (or block) scale 1; the scale checks must let it through."""
    victim = expert_name(QWEN, 0, 1, "up")

    def zero_row(name, dtype, a):
        if name == victim:
            a = a.copy()
            a[2] = 0
        return [(name, dtype, a)]

    bf16 = _rewrite(qwen_folders["bf16"], tmp_path / "bf16", transform=zero_row)
    for out, quant in (("pc", PER_CHANNEL), ("blk", BLOCK_128)):
        experts = FP8SafeTensorLoader(_convert(bf16, tmp_path / out, quant)).load_experts(0)
        assert not experts.up[1, 2].any() and np.isfinite(experts.up_scale).all()


@pytest.mark.parametrize("fmt", ["per_channel", "bf16"])
@pytest.mark.parametrize("reshape", [lambda a: a.reshape(-1), lambda a: a[None]], ids=["1-D", "[1, out, in]"])
def test_expert_weight_not_2d_refused(qwen_folders, tmp_path, fmt, reshape):
    gate = expert_name(QWEN, 0, 0, "gate")
    folder = _rewrite(qwen_folders[fmt], tmp_path / "bad", transform=lambda n, d, a: [
        (n, d, reshape(a) if n.startswith("model.layers.0.") and n.endswith("gate_proj.weight") else a)])
    with pytest.raises(SafetensorsError, match=re.escape(gate) + r".*\[out, in\]"):
        FP8SafeTensorLoader(folder).load_experts(0)


def test_a_projection_named_twice_refused(qwen_folders, tmp_path):
    """gate_proj and w1 (Mixtral's name) for one expert, as another tool might write: which one would
    load depended on the file order."""
    gate = expert_name(QWEN, 0, 1, "gate")
    twin = gate.replace(".gate_proj.", ".w1.")
    folder = _rewrite(qwen_folders["per_channel"], tmp_path / "twice", transform=lambda n, d, a: [(n, d, a)] + (
        [(n.replace(".gate_proj.", ".w1."), d, a)] if n.startswith(gate.rsplit(".", 1)[0] + ".") else []))
    with pytest.raises(SafetensorsError, match=re.escape(f"tensors {gate!r} and {twin!r} are both expert 1's gate")):
        FP8SafeTensorLoader(folder).load_experts(0)


@pytest.mark.parametrize("quantization_config, expected", [
    ("fp8", "quantization_config must be an object"),
    ({"weight_block_size": 64}, "weight_block_size must be a list of two positive integers"),
    ({"weight_block_size": "64"}, "weight_block_size must be a list of two positive integers"),
    ({"weight_block_size": [True, True]}, "weight_block_size must be a list of two positive integers"),
    ({"weight_block_size": [64.0, 64.0]}, "weight_block_size must be a list of two positive integers"),
    ({"weight_block_size": [64, 64, 64]}, "weight_block_size must be a list of two positive integers"),
    ({"weight_block_size": [0, 64]}, "weight_block_size must be a list of two positive integers"),
])
def test_malformed_quantization_config_refused(qwen_folders, tmp_path, quantization_config, expected):
    folder = _with_config(qwen_folders["block"], tmp_path / "bad",
                          lambda c: c.update(quantization_config=quantization_config))
    with pytest.raises(ValueError, match=expected) as e:
        FP8SafeTensorLoader(folder).load_experts(0)
    assert "config.json" in str(e.value)


def test_config_json_not_an_object_refused(qwen_folders, tmp_path):
    folder = _rewrite(qwen_folders["block"], tmp_path / "list")
    (folder / "config.json").write_text("[]")
    with pytest.raises(SafetensorsError, match=r"config.json: holds a JSON list, expected an object"):
        FP8SafeTensorLoader(folder)


def test_block_scale_dtype_checked(qwen_folders, tmp_path):
    """weight_scale_inv relabelled I32 was read as integers, cast to float: huge outputs."""
    folder = _rewrite(qwen_folders["block"], tmp_path / "i32", transform=lambda n, d, a: [
        (n, "I32", a.view(np.int32)) if n.startswith("model.layers.0.") and n.endswith("up_proj.weight_scale_inv")
        else (n, d, a)])
    with pytest.raises(SafetensorsError, match=re.escape(_scale_name("block", 0, "up")) + ".*is I32; expected F32"):
        FP8SafeTensorLoader(folder).load_experts(0)


@pytest.mark.parametrize("block, expected", [([32, 64], "non-square blocks are not supported"),
                                              ([33, 33], "must be even")])
def test_block_the_kernels_cannot_run_refused_by_config(qwen_folders, tmp_path, block, expected):
    """The experts still load (python -m ktfp8.convert requantizes them); a MoeConfig for them is refused."""
    folder = _with_config(qwen_folders["block"], tmp_path / "blk", lambda c: c["quantization_config"].update(
        weight_block_size=block))
    loader = FP8SafeTensorLoader(folder)
    assert loader.format == "fp8_block"
    with pytest.raises(ValueError, match=rf"weight_block_size {re.escape(str(block))}.*{expected}"):
        loader.config


def test_per_channel_and_block_layers_refused_by_config(qwen_folders, tmp_path):
    """Layer 0's experts per-channel, layer 1's block-wise: both FP8, but one MoeConfig has one format."""
    folder = _rewrite(qwen_folders["block"], tmp_path / "mixed")
    layer0 = ".layers.0.mlp.experts."
    with SafetensorsFile(qwen_folders["per_channel"] / "model.safetensors") as pc, \
            SafetensorsFile(qwen_folders["block"] / "model.safetensors") as blk:
        tensors = {n: (i.dtype, blk.read_rows(n)) for n, i in blk.tensors.items() if layer0 not in n}
        tensors.update({n: (i.dtype, pc.read_rows(n)) for n, i in pc.tensors.items() if layer0 in n})
    write_file(folder / "model.safetensors", tensors)
    loader = FP8SafeTensorLoader(folder)
    assert [loader.layer_format(layer) for layer in loader.moe_layers()] == ["fp8_per_channel", "fp8_block"]
    with pytest.raises(ValueError, match=r"formats differ across layers \(\{0: 'fp8_per_channel', 1: 'fp8_block'\}\); "
                                         r"mixing per-channel and block-wise FP8.* is not supported"):
        loader.config


def test_expert_indices_with_a_gap_or_a_stray_tensor_say_so(qwen_folders, tmp_path):
    """Experts 0-3 complete and one stray up_proj of expert 7 used to read "gate weight missing for
    experts [4]": the experts were counted by name, not by their highest index.  What loads is unchanged."""
    src, E = qwen_folders["per_channel"], EXPERTS
    stray = expert_name(QWEN, 0, E + 3, "up")

    def stray_up(name, dtype, a):          # expert 2's up weight and scale again, as expert E + 3's
        twin = name.replace(".experts.2.", f".experts.{E + 3}.")
        return [(name, dtype, a)] + ([(twin, dtype, a)] if twin != name and twin.startswith(stray) else [])

    loader = FP8SafeTensorLoader(_rewrite(src, tmp_path / "stray", transform=stray_up))
    assert loader.expert_count(0) == E + 4
    gap = list(range(E, E + 3))
    for experts in (None, range(2)):        # a shard of the complete experts too: the layer is refused
        with pytest.raises(SafetensorsError, match=re.escape(
                f"layer 0: experts {gap} have no gate, up or down weight, yet {stray!r} names expert {E + 3}: "
                f"expert indices run from 0 without a gap (gate weight missing for experts {gap + [E + 3]})")):
            loader.load_experts(0, experts)
    # a scale alone, of an expert without weights
    scale = _scale_name("per_channel", E + 3, "up")
    loader = FP8SafeTensorLoader(_rewrite(src, tmp_path / "scale", transform=lambda n, d, a: [(n, d, a)] + (
        [(scale, d, a)] if n == _scale_name("per_channel", 2, "up") else [])))
    assert loader.expert_count(0) == E
    with pytest.raises(SafetensorsError, match=re.escape(
            f"layer 0: up weight_scale {scale!r} names expert {E + 3}, but the layer's experts (those with "
            f"weights) are 0-{E - 1}")):
        loader.load_experts(0)
    # expert 1 written as expert E: a gap below the highest index
    moved = _rewrite(src, tmp_path / "moved", rename=lambda n: n.replace(".experts.1.", f".experts.{E}."))
    with pytest.raises(SafetensorsError, match=re.escape(
            f"layer 0: experts [1] have no gate, up or down weight, yet {expert_name(QWEN, 0, E, 'gate')!r} "
            f"names expert {E}")):
        FP8SafeTensorLoader(moved).load_experts(0)
    # one projection of one expert missing: named as before
    holed = _rewrite(src, tmp_path / "holed", transform=lambda n, d, a: [] if n == expert_name(QWEN, 0, 1, "up") else
                     [(n, d, a)])
    with pytest.raises(SafetensorsError, match=re.escape("layer 0: up weight missing for experts [1]")):
        FP8SafeTensorLoader(holed).load_experts(0)
