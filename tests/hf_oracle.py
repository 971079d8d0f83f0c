"""Oracles for the ktfp8.hf tests: the same transformers model, run by transformers' own eager experts,
whose expert weights are replaced by the dequantized FP8 ones (dequantized here with ml_dtypes)."""
import os

import ml_dtypes
import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_models import build_model, expert_name, moe_layers, save_model
from ktfp8.convert import main as convert

E4M3 = ml_dtypes.float8_e4m3fn
ROLES = ("gate", "up", "down")
PER_CHANNEL = '{"method": "FP8", "per_channel": true}'
BLOCK_128 = '{"method": "FP8", "per_channel": false, "group_size": 128}'
SHARDED = {"qwen3_moe", "deepseek_v2", "olmoe"}          # saved and converted in several shards
BLOCK_TOO = {"qwen3_moe", "deepseek_v3"}                 # also converted block-wise
FP32_BACKENDS = ("avx512", "avx2", "reference")      # compute in float32, like a float32 oracle
PROMPT = torch.tensor([[3, 17, 42, 99, 5, 64, 7, 120, 33, 2, 81]])


def float32_backend():
    """The best backend of this CPU that computes in float32 (BF16-compute ones round x and h)."""
    import ktfp8
    return next(b for b in ktfp8.available_backends() if b in FP32_BACKENDS)


def tiny_model_settings(monkeypatch):
    """Generator for an autouse fixture.  BF16-compute backends (avx512_bf16, amx) round x and h to
    BF16 by design (API.md): against a float32 oracle they differ by ~1e-5 and may flip a greedy token;
    their accuracy is the kernel tests' business, here the best float32 backend runs.  One thread for
    torch and the kernels: the tiny models gain nothing from more, and on a busy CI machine every
    parallel region waits for its slowest thread (3x the test time measured at load 9 on 2 cores)."""
    monkeypatch.setenv("KTFP8_BACKEND", float32_backend())
    monkeypatch.setenv("KTFP8_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def per_channel_roundtrip(w):
    """w [E, out, in] float32 -> its per-channel E4M3 quantization, dequantized (API.md's rule)."""
    scale = (np.abs(w).max(axis=-1, keepdims=True) / np.float32(448)).astype(np.float32)
    scale[scale == 0] = 1
    return np.clip(w / scale, -448, 448).astype(E4M3).astype(np.float32) * scale


def _tensors(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), framework="pt") as fh:
                out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _dequantize(codes, scale, block=(128, 128)):
    w = codes.view(torch.uint8).numpy().view(E4M3).astype(np.float32)
    s = scale.float().numpy()
    if s.size == w.shape[0]:                                   # per-channel: [out] or [out, 1]
        return w * s.reshape(-1, 1)
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)   # block-wise weight_scale_inv
    return w * full[:w.shape[0], :w.shape[1]]


def checkpoint_experts(folder, kind, layer, count):
    """{role: [E, out, in] float32} of an FP8 folder written by ktfp8.convert, dequantized."""
    tensors = _tensors(folder)
    out = {}
    for role in ROLES:
        mats = []
        for e in range(count):
            name = expert_name(kind, layer, e, role)
            scale = tensors.get(name + "_scale", tensors.get(name + "_scale_inv"))
            mats.append(_dequantize(tensors[name], scale))
        out[role] = np.stack(mats)
    return out


def experts_module(model, layer):
    """The routed experts of `layer` in a causal LM, or in a vision-language model's text model."""
    return getattr(model.model, "language_model", model.model).layers[layer].mlp.experts


def set_experts(model, layer, weights):
    """Writes {role: [E, out, in]} float arrays into the experts module of `layer`."""
    write_experts(experts_module(model, layer), weights)


def write_experts(ex, weights):
    """Writes {role: [E, out, in]} float arrays into experts module `ex`."""
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.from_numpy(np.concatenate([weights["gate"], weights["up"]], axis=1)))
        ex.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(weights["down"])))


def per_channel_experts(ex):
    """{role: [E, out, in] float32}: the per-channel quantization of experts module `ex`'s weights,
    dequantized."""
    inter = ex.intermediate_dim
    gate_up = ex.gate_up_proj.detach().numpy()
    return {"gate": per_channel_roundtrip(gate_up[:, :inter]), "up": per_channel_roundtrip(gate_up[:, inter:]),
            "down": per_channel_roundtrip(ex.down_proj.detach().numpy())}


def eager_model(bf16_folder, kind, fp8_folder=None):
    """The float32 transformers model of `bf16_folder` with transformers' eager experts computing on the
    FP8 weights: those of `fp8_folder`, or else the per-channel quantization of its own weights."""
    model = AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=torch.float32, experts_implementation="eager")
    for layer in moe_layers(kind):
        ex = experts_module(model, layer)
        if fp8_folder is not None:
            weights = checkpoint_experts(fp8_folder, kind, layer, ex.num_experts)
        else:
            weights = per_channel_experts(ex)
        write_experts(ex, weights)
    return model


def logits(model, prompt=PROMPT):
    with torch.inference_mode():
        return model(prompt).logits[0].float().numpy()


def greedy(model, new_tokens=16, prompt=PROMPT):
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _convert(src, dst, quant, sharded):
    shards = ["--max-shard-size", "100KB"] if sharded else []
    assert convert(["--input-type", "bf16", "--input-path", str(src), "--output-path", str(dst),
                    "--quant-config", quant, "--threads", "2", *shards]) == 0
    return dst


_made = {}


def model_folders(kind, tmp_path_factory):
    """{kind, bf16, fp8[, fp8_block]}: the model's folders, written once per test session."""
    if kind not in _made:
        root = tmp_path_factory.mktemp(kind)
        bf16 = save_model(build_model(kind), root / "bf16", max_shard_size="100KB" if kind in SHARDED else None)
        sharded = kind in SHARDED
        out = {"kind": kind, "bf16": bf16, "fp8": _convert(bf16, root / "fp8", PER_CHANNEL, sharded)}
        if kind in BLOCK_TOO:
            out["fp8_block"] = _convert(bf16, root / "fp8_block", BLOCK_128, sharded)
        _made[kind] = out
    return _made[kind]


