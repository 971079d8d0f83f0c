"""The catalogue of bad inputs: every one tried at every public entry point, with the exception (or
command-line exit status) it gets and a fragment of its message.  One table, one test per row.

The README's "Errors" section is this table rendered (`PYTHONPATH=. python tests/test_bad_inputs.py`
prints it); test_readme_table_is_current keeps the two in step."""
import json
import math
import os
import re
import shutil
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8 import distributed, fp8, numa
from ktfp8.convert import main as convert_main
from ktfp8.cpu import main as cpu_main
from ktfp8.experts import ExpertWeights
from ktfp8.loader import FP8SafeTensorLoader
from ktfp8.safetensors_io import SafetensorsError, write_file

REPO = Path(__file__).resolve().parents[1]
E, H, I, K = 4, 64, 32, 2
F32, BF16, U8 = np.float32, ml_dtypes.bfloat16, np.uint8


@dataclass(frozen=True)
class Case:
    entry: str                       # the public entry point
    bad: str                         # what is wrong with the input
    run: Callable                    # run(ctx) makes the call
    expect: Union[type, int]         # exception type, or the exit status of a command-line tool
    message: str                     # fragment of the message (stderr for a command-line tool)


class Ctx:
    """Valid objects to spoil one thing of: a config, experts, a MoE, a checkpoint folder."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.cfg = self.config()
        rng = np.random.default_rng(0)
        self.w = {n: (rng.standard_normal(s) / 8).astype(F32)
                  for n, s in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I)))}
        self.experts = ktfp8.quantize_experts(self.w["gate"], self.w["up"], self.w["down"], self.cfg.quant_config)
        self.moe = ktfp8.MoE(self.cfg, self.experts, backend="reference")
        self.x = rng.standard_normal((3, H)).astype(F32)
        self.ids = np.array([[0, 1], [2, -1], [3, 3]], np.int64)
        self.tw = np.ones((3, K), F32)
        self.ckpt = self.checkpoint(tmp / "ckpt")

    @staticmethod
    def config(**kw):
        return ktfp8.MoeConfig(**dict(dict(expert_num=E, num_experts_per_tok=K, hidden_size=H,
                                           intermediate_size=I), **kw))

    def block_config(self, group_size):
        cfg = self.config()
        cfg.quant_config.per_channel = False
        cfg.quant_config.group_size = group_size
        return cfg

    def checkpoint(self, folder):
        """A valid FP8 per-channel checkpoint: config.json + one shard with layer 0's experts."""
        folder.mkdir(parents=True)
        tensors = {}
        for e in range(E):
            for role, codes, scale in (("gate", self.experts.gate, self.experts.gate_scale),
                                       ("up", self.experts.up, self.experts.up_scale),
                                       ("down", self.experts.down, self.experts.down_scale)):
                name = f"model.layers.0.mlp.experts.{e}.{role}_proj"
                tensors[name + ".weight"] = ("F8_E4M3", codes[e])
                tensors[name + ".weight_scale"] = ("F32", scale[e])
        write_file(folder / "model.safetensors", tensors)
        (folder / "config.json").write_text(json.dumps({
            "model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": K, "hidden_size": H,
            "moe_intermediate_size": I}))
        return folder

    def copy(self, name):
        return Path(shutil.copytree(self.ckpt, self.tmp / name))

    def odd_block_experts(self):
        """Block-wise experts with 8 x 7 blocks, quantized with fp8.quantize: QuantConfig refuses odd edges."""
        q = [ktfp8.fp8.quantize(self.w[n], per_channel=False, block=(8, 7)) for n in ("gate", "up", "down")]
        return ExpertWeights("fp8_block", *(codes for codes, _ in q), *(scale for _, scale in q), block=(8, 7))

    def experts_with(self, **changes):
        fields = dict(format=self.experts.format, gate=self.experts.gate, up=self.experts.up,
                      down=self.experts.down, gate_scale=self.experts.gate_scale,
                      up_scale=self.experts.up_scale, down_scale=self.experts.down_scale, block=None)
        fields.update(changes)
        return ExpertWeights(**fields)

    def call(self, **changes):
        args = dict(x=self.x, topk_ids=self.ids, topk_weights=self.tw)
        args.update(changes)
        return self.moe(**args)


def _truncated_shard(c):
    folder = c.copy("truncated")
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])
    return FP8SafeTensorLoader(folder)


def _bad_index(c, text):
    folder = c.copy("index" + str(abs(hash(text)) % 10_000))
    (folder / "model.safetensors.index.json").write_text(text)
    return FP8SafeTensorLoader(folder)


def _deep_json(path):
    path.write_text("[" * 100_000)
    return path


def _deep_header(c):
    folder = c.copy("deep_header")
    raw = b"{" + b'"a":{' * 50_000
    (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    return FP8SafeTensorLoader(folder)


def _edited_checkpoint(c, name, edit):
    """load_experts(0) of a copy of the checkpoint whose shard's tensors {name: (dtype, array)} went
    through edit(tensors) (which changes the dict in place)."""
    folder = c.copy(name)
    shard = folder / "model.safetensors"
    tensors = _read_all(shard)
    edit(tensors)
    write_file(shard, tensors)
    return FP8SafeTensorLoader(folder).load_experts(0)


def _nan_scale(tensors):
    tensors[_expert(1, "up") + "_scale"][1][2] = np.nan


def _one_in_bf16(tensors):
    tensors[_expert(1, "up")] = ("BF16", np.zeros((I, H), BF16))


def _weights_as_int8(tensors):
    for name, (_, codes) in list(tensors.items()):
        if name.endswith(".weight"):
            tensors[name] = ("I8", codes.view(np.int8))


def _without(suffix):
    """An edit deleting every tensor whose name ends with `suffix`."""
    def edit(tensors):
        for name in [n for n in tensors if n.endswith(suffix)]:
            del tensors[name]
    return edit


def _row_short(tensors):
    dtype, codes = tensors[_expert(2, "gate")]
    tensors[_expert(2, "gate")] = (dtype, codes[:-1])


def _two_scales_a_row(tensors):
    for e in range(E):
        tensors[_expert(e, "gate") + "_scale"] = ("F32", np.ones((I, 2), F32))


def _block_scales_of_2x2(tensors):
    """weight_scale_inv of 2 x 2 blocks where the default 128 x 128 blocks make one per matrix."""
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        del tensors[name]
        tensors[name + "_inv"] = ("F32", np.ones((2, 2), F32))


def _in_two_shards(c):
    """A folder without an index whose two shards both hold expert 0's gate weight."""
    folder = c.copy("in_two_shards")
    tensors = _read_all(folder / "model.safetensors")
    write_file(folder / "a.safetensors", {_expert(0, "gate"): tensors[_expert(0, "gate")]})
    (folder / "model.safetensors").rename(folder / "b.safetensors")
    return FP8SafeTensorLoader(folder)


def _without_config(c):
    folder = c.copy("noconfig")
    (folder / "config.json").unlink()
    return FP8SafeTensorLoader(folder).config


def _convert(c, *args, input_type="fp8", out="out"):
    argv = ["--input-type", input_type, "--input-path", str(c.ckpt), "--output-path", str(c.tmp / out)]
    return convert_main([a for a in argv if a is not None] + list(args))


def _under_a_file(c):
    (c.tmp / "a_file").write_text("not a folder")
    return _convert_bf16(c, "bf16_under_a_file", lambda tensors, config: None, out="a_file/sub/out")


def _convert_bf16(c, name, edit, out="o", add_files=lambda folder: None):
    """Converts a BF16 checkpoint of the catalogue's experts (layer 0) after edit(tensors, config) changed
    its {name: (dtype, array)} and config.json dict and add_files(folder) added files, into c.tmp / out."""
    folder = c.tmp / name
    folder.mkdir()
    tensors = {_expert(e, role): ("BF16", c.w[role][e].astype(BF16)) for e in range(E) for role in c.w}
    config = {"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": K, "hidden_size": H,
              "moe_intermediate_size": I}
    edit(tensors, config)
    write_file(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps(config))
    add_files(folder)
    return convert_main(["--input-type", "bf16", "--input-path", str(folder), "--output-path", str(c.tmp / out)])


def _convert_block_fp8(c, name, bad_scale=None, extra=(), nan_code=False, args=()):
    """Converts (with `args`) a block-wise FP8 checkpoint (32 x 32 blocks, weight_scale_inv) of the
    catalogue's experts whose expert 1 gate_proj scale holds bad_scale at [0, 1] (if given) and its
    codes the NaN code 0xFF there (nan_code), plus the tensors `extra`."""
    folder = c.tmp / name
    folder.mkdir()
    tensors = {}
    for e in range(E):
        for role in c.w:
            codes, scale = fp8.quantize(c.w[role][e], per_channel=False, block=(32, 32))
            tensors[_expert(e, role)] = ("F8_E4M3", codes)
            tensors[_expert(e, role) + "_scale_inv"] = ("F32", scale)
    if bad_scale is not None:
        tensors[_expert(1, "gate") + "_scale_inv"][1][0, 1] = bad_scale
    if nan_code:
        tensors[_expert(1, "gate")][1][0, 1] = 0xFF
    tensors.update(extra)
    write_file(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": K, "hidden_size": H,
        "moe_intermediate_size": I, "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}))
    return convert_main(["--input-type", "fp8", "--input-path", str(folder), "--output-path", str(c.tmp / "o"),
                         *args])


def _with_other_file(c, name, target):
    """Converts a BF16 checkpoint whose tokenizer.json is a symlink to `target`."""
    return _convert_bf16(c, name, lambda tensors, config: None,
                         add_files=lambda folder: (folder / "tokenizer.json").symlink_to(target))


def _freed(t):
    t.untyped_storage().resize_(0)
    return t


def _two_tensor(t):
    from torch.testing._internal.two_tensor import TwoTensor
    return TwoTensor(t, t.clone())


def _nested_rows(torch):
    """3 rows of H as a nested tensor of the default (strided) layout, which had reached torch's
    "Internal error: NestedTensorImpl doesn't support sizes"."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)        # "nested tensors are in prototype stage"
        return torch.nested.nested_tensor([torch.zeros(H)] * 3)


def _expert(e, role):
    return f"model.layers.0.mlp.experts.{e}.{role}_proj.weight"


def _wider_gate(tensors, config):
    tensors[_expert(1, "gate")] = ("BF16", np.zeros((I + 8, H), BF16))


def _without_sizes(tensors, config):
    del config["hidden_size"], config["moe_intermediate_size"]
    tensors[_expert(3, "down")] = ("BF16", np.zeros((H, I - 8), BF16))


def _fused(tensors, config):
    """Layer 0's experts as transformers 5 saves them: one gate_up_proj [E, 2I, H] and one down_proj [E, H, I]."""
    w = {role: np.stack([tensors.pop(_expert(e, role))[1] for e in range(E)]) for role in ("gate", "up", "down")}
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = ("BF16", np.concatenate([w["gate"], w["up"]], axis=1))
    tensors["model.layers.0.mlp.experts.down_proj"] = ("BF16", w["down"])


def _non_empty(c, *args):
    (c.tmp / "full").mkdir(exist_ok=True)
    (c.tmp / "full" / "mine.txt").write_text("keep")
    return _convert(c, *args, out="full")


def _into_working_dir(c, monkeypatch):
    (c.tmp / "here").mkdir(exist_ok=True)
    monkeypatch.chdir(c.tmp / "here")
    return convert_main(["--input-type", "fp8", "--input-path", str(c.ckpt), "--output-path", "."])


_into_working_dir.needs_env = True   # needs monkeypatch, to chdir back


def _with_env(var, value, fn):
    def run(c, monkeypatch):
        monkeypatch.setenv(var, value)
        return fn(c)
    run.needs_env = True
    return run


def _tensor(make):
    """make(torch): a tensor case, skipped where torch is not installed."""
    return make(pytest.importorskip("torch"))


def _cuda(a):
    """Array `a` in a tensor that reports device cuda:0 (tests/torch_fakes.py)."""
    return _tensor(lambda torch: __import__("torch_fakes").cuda_tensor(torch.from_numpy(a)))


ROUTER = lambda c: np.zeros((3, E), F32)  # noqa: E731
cfg = Ctx.config

# ktfp8.hf and python -m ktfp8.generate need torch and transformers: imported by the cases that use them
def _spoilt(w, index, value):
    """A copy of `w` with `value` at `index`."""
    w = w.copy()
    w[index] = value
    return w


def _hf():
    import ktfp8.hf
    return ktfp8.hf


def _generate(c, *args):
    from ktfp8.generate import main
    return main(list(args))


def _with_config(c, name, **changes):
    folder = c.copy(name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def _bf16_experts_folder(c):
    folder = c.tmp / "bf16_experts"
    folder.mkdir()
    tensors = {_expert(e, role): ("BF16", c.w[role][e].astype(BF16)) for e in range(E) for role in c.w}
    write_file(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text((c.ckpt / "config.json").read_text())
    return _hf().from_pretrained(folder)


def _fp8_attention(c):
    folder = c.copy("fp8_attention")
    shard = folder / "model.safetensors"
    tensors = {n: (d, a) for n, (d, a) in _read_all(shard).items()}
    tensors["model.layers.0.self_attn.q_proj.weight"] = ("F8_E4M3", np.zeros((H, H), U8))
    write_file(shard, tensors)
    return _hf().from_pretrained(folder)


def _read_all(path):
    from ktfp8.safetensors_io import SafetensorsFile
    f = SafetensorsFile(path)
    return {n: (f.info(n).dtype, np.array(f.memmap(n))) for n in f.tensors}


def _bench(c, *args):
    from ktfp8.bench.__main__ import main
    return main(list(args))


_SMALL_BENCH = ["--quick", "--no-peers", "--no-plot", "--threads", "1", "--formats", "fp8_per_channel"]


def _bench_model(c, *args):
    from ktfp8.bench.model import main
    return main(list(args))


def _tiny_qwen3_moe(**config_fields):
    import transformers
    config = transformers.Qwen3MoeConfig(vocab_size=16, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         num_experts=4, num_experts_per_tok=2, **config_fields)
    return transformers.Qwen3MoeForCausalLM(config)


def _vocab_changed(c, fp8):
    """A whole tiny Qwen3-MoE folder, as saved in BF16 or converted to FP8 per-channel, whose
    config.json then says vocab_size 12 where its embeddings and lm_head hold 16 rows."""
    source = _whole_bf16_source(c)
    folder = c.tmp / ("whole_fp8" if fp8 else "whole_bf16_vocab")
    if fp8:
        convert_main(["--input-type", "bf16", "--input-path", str(source), "--output-path", str(folder)])
    else:
        shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 12}))
    return folder


def _fewer_experts(c):
    """The whole tiny Qwen3-MoE converted to FP8 per-channel, then without expert 3 of layer 0."""
    from ktfp8.safetensors_io import SafetensorsFile
    folder = c.tmp / "whole_fp8_fewer"
    convert_main(["--input-type", "bf16", "--input-path", str(_whole_bf16_source(c)), "--output-path", str(folder)])
    with SafetensorsFile(folder / "model.safetensors") as f:
        kept = {n: (f.tensors[n].dtype, f.read_rows(n)) for n in f.keys() if ".experts.3." not in n}
    write_file(folder / "model.safetensors", kept)
    return _hf().from_pretrained(folder)


def _whole_bf16_source(c):
    """The whole tiny Qwen3-MoE saved in BF16 (made once)."""
    import torch
    source = c.tmp / "whole_bf16"
    if not source.exists():
        _tiny_qwen3_moe().to(torch.bfloat16).save_pretrained(source)
    return source


def _whole_bf16(c, name, edit):
    """A copy of the whole tiny Qwen3-MoE BF16 folder after edit(folder)."""
    folder = Path(shutil.copytree(_whole_bf16_source(c), c.tmp / name))
    edit(folder)
    return folder


def _garbage_bin(folder):
    """The weights as a pytorch_model.bin that torch.load cannot read, and no safetensors."""
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02not a pickle" * 64)


def _prepared_qwen3_moe():
    return _hf().prepare(_tiny_qwen3_moe())


def _switched_back(c):
    import torch
    model = _prepared_qwen3_moe()
    model.set_experts_implementation("eager")
    return model(torch.tensor([[1, 2, 3]]))


def _nan_at_first_forward(c):
    """A NaN in an expert weight of a model whose experts ktfp8 quantizes at its first forward."""
    import torch
    model = _tiny_qwen3_moe()
    with torch.no_grad():
        model.model.layers[0].mlp.experts.gate_up_proj[2, 3, 4] = float("nan")
    model.set_experts_implementation("ktfp8")
    with torch.no_grad():
        return model(torch.tensor([[1, 2, 3]]))


def _forward_mode_ad(c):
    import torch
    import torch.autograd.forward_ad as fw_ad
    model = _prepared_qwen3_moe()
    model.set_attn_implementation("eager")          # (sdpa has no forward-mode AD)
    embeds = model.get_input_embeddings()(torch.tensor([[1, 2, 3]])).detach()
    with fw_ad.dual_level(), torch.no_grad():
        return model(inputs_embeds=fw_ad.make_dual(embeds, torch.ones_like(embeds)))


def _half_after_first_forward(c):
    import torch
    model = _prepared_qwen3_moe()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
        return model.half()(torch.tensor([[1, 2, 3]]))


def _float16_model(c):
    torch = pytest.importorskip("torch")
    return _hf().prepare(_tiny_qwen3_moe().to(torch.float16))


def _tiny_llama():
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))


def _stray_expert(c, index=7):
    """Layer 0's experts 0-3 complete, and one stray up_proj (weight and scale) of expert `index`."""
    def edit(tensors):
        for suffix in ("", "_scale"):
            tensors[_expert(index, "up") + suffix] = tensors[_expert(2, "up") + suffix]
    return _edited_checkpoint(c, f"stray_expert{index}", edit)


def _fifo_shard(c):
    """A named pipe among the shards of a folder with neither an index nor a model.safetensors (every
    *.safetensors is a shard then)."""
    folder = c.copy("fifo")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    os.mkfifo(folder / "extra.safetensors")
    return _within(30, lambda: FP8SafeTensorLoader(folder))


def _within(seconds, fn):
    """fn() in a thread, so that a call that blocks (opening a pipe waits for a writer) fails the case
    after `seconds` instead of hanging the suite."""
    outcome = {}

    def call():
        try:
            outcome["value"] = fn()
        except BaseException as e:      # re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _symlink_loop(c):
    (c.tmp / "loop").symlink_to("loop")
    return _convert(c, out="loop")


def _closed_numa_moe(c):
    import os
    layer = numa.NumaMoE(c.cfg, c.experts, nodes=[numa.NumaNode(0, (min(os.sched_getaffinity(0)),))])
    layer.close()
    return layer(c.x, c.ids, c.tw)


def _pin_in_thread(cpus):
    """numa.pin(cpus) in a thread of its own: should it pin by mistake, the test process keeps its CPUs."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(numa.pin, cpus).result()


CASES = [
    # ---------------------------------------------------------------- MoeConfig / QuantConfig
    Case("MoeConfig", "expert_num=0", lambda c: cfg(expert_num=0, num_experts_per_tok=1), ValueError,
         "MoeConfig.expert_num must be >= 1"),
    Case("MoeConfig", "hidden_size=-1", lambda c: cfg(hidden_size=-1), ValueError, "hidden_size must be >= 1"),
    Case("MoeConfig", "num_experts_per_tok > expert_num", lambda c: cfg(num_experts_per_tok=E + 1), ValueError,
         "num_experts_per_tok (5) must be <= expert_num (4)"),
    Case("MoeConfig", "a bool as a size (expert_num=True)", lambda c: cfg(expert_num=True), TypeError,
         "expert_num must be an int"),
    Case("MoeConfig", "a float as a size (hidden_size=64.0)", lambda c: cfg(hidden_size=64.0), TypeError,
         "hidden_size must be an int"),
    Case("MoeConfig", "expert_num=2**70 (a bogus config.json: the first call's C conversion overflowed)",
         lambda c: cfg(expert_num=2**70), ValueError,
         "MoeConfig.expert_num must be at most 2147483647, got 1180591620717411303424"),
    Case("MoeConfig", "a size left out", lambda c: ktfp8.MoeConfig(E, K, H), TypeError,
         "MoeConfig needs intermediate_size"),
    Case("MoeConfig", "unknown scoring_func", lambda c: cfg(scoring_func="tanh"), ValueError,
         "scoring_func must be one of 'softmax', 'sigmoid'"),
    Case("MoeConfig", "unknown group_score", lambda c: cfg(group_score="mean"), ValueError,
         "group_score must be one of 'best', 'top2_sum'"),
    Case("MoeConfig", "hidden_act neither silu nor the tanh GELU", lambda c: cfg(hidden_act="gelu"), ValueError,
         "hidden_act must be one of 'silu'"),
    Case("MoeConfig", "n_group not dividing expert_num", lambda c: cfg(n_group=3), ValueError,
         "n_group (3) must divide expert_num (4)"),
    Case("MoeConfig", "topk_group > n_group", lambda c: cfg(n_group=2, topk_group=3), ValueError,
         "topk_group (3) must be <= n_group (2)"),
    Case("MoeConfig", "routed_scaling_factor NaN", lambda c: cfg(routed_scaling_factor=math.nan), ValueError,
         "routed_scaling_factor must be finite and > 0"),
    Case("MoeConfig", "routed_scaling_factor 10**400 (an int no float holds)",
         lambda c: cfg(routed_scaling_factor=10**400), ValueError, "routed_scaling_factor must be finite and > 0"),
    Case("MoeConfig", "routed_scaling_factor 1e40 (inf as a float32)", lambda c: cfg(routed_scaling_factor=1e40),
         ValueError, "routed_scaling_factor must be finite and > 0 in float32, got 1e+40"),
    Case("MoeConfig", "routed_scaling_factor 1e-50 (0 as a float32)", lambda c: cfg(routed_scaling_factor=1e-50),
         ValueError, "routed_scaling_factor must be finite and > 0 in float32, got 1e-50"),
    Case("MoeConfig", "swiglu_limit=0", lambda c: cfg(swiglu_limit=0), ValueError,
         "MoeConfig.swiglu_limit must be None or finite and > 0 in float32, got 0"),
    Case("MoeConfig", "swiglu_limit='10'", lambda c: cfg(swiglu_limit="10"), TypeError,
         "MoeConfig.swiglu_limit must be None or a number, got str '10'"),
    Case("MoeConfig.from_hf_config", "hidden_act 'relu'",
         lambda c: ktfp8.MoeConfig.from_hf_config(dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                                       hidden_size=8, moe_intermediate_size=8, hidden_act="relu")),
         ValueError, "hidden_act 'relu' is not an activation ktfp8 computes; known: 'silu', 'swish'"),
    Case("MoeConfig.from_hf_config", "a GPT-OSS-style SwiGLU clamp (swiglu_alpha) ktfp8 does not compute",
         lambda c: ktfp8.MoeConfig.from_hf_config(dict(model_type="gpt_oss", num_local_experts=4,
                                                       num_experts_per_tok=2, hidden_size=8, intermediate_size=8,
                                                       scoring_func="softmax", swiglu_alpha=1.702)), ValueError,
         "sets swiglu_alpha = 1.702: its experts clamp their SwiGLU, which ktfp8 computes only as DeepSeek-V4 does"),
    Case("MoeConfig", "threads=0", lambda c: cfg(threads=0), ValueError, "MoeConfig.threads must be >= 1"),
    Case("MoeConfig", "threads=100000", lambda c: cfg(threads=100_000), ValueError,
         "MoeConfig.threads must be at most"),
    Case("MoeConfig", "quant_config a string", lambda c: cfg(quant_config="FP8"), TypeError,
         "quant_config must be a QuantConfig or a mapping"),
    Case("MoeConfig", "routed_expert_num disagreeing with num_experts_per_tok",
         lambda c: cfg(routed_expert_num=1), ValueError, "disagree"),
    Case("MoeConfig (assignment)", "num_experts_per_tok = 99",
         lambda c: setattr(cfg(), "num_experts_per_tok", 99), ValueError, "must be <= expert_num"),
    Case("MoeConfig (assignment)", "unknown field", lambda c: setattr(cfg(), "num_expert", 8), AttributeError,
         "MoeConfig has no field 'num_expert'"),
    Case("QuantConfig", "method='INT4'", lambda c: ktfp8.QuantConfig("INT4"), ValueError,
         "QuantConfig.method must be one of 'FP8', 'BF16'"),
    Case("QuantConfig", "per_channel with group_size=128", lambda c: ktfp8.QuantConfig("FP8", True, 128),
         ValueError, "group_size must be 0 with per_channel=True"),
    Case("QuantConfig", "block-wise with group_size=0", lambda c: ktfp8.QuantConfig("FP8", False, 0),
         ValueError, "group_size must be > 0"),
    Case("QuantConfig", "block-wise with an odd group_size", lambda c: ktfp8.QuantConfig("FP8", False, 127),
         ValueError, "QuantConfig.group_size must be even, got 127"),
    Case("QuantConfig (assignment)", "group_size = 2**40 (past the kernels' 32-bit block edges)",
         lambda c: setattr(ktfp8.QuantConfig(), "group_size", 2**40), ValueError,
         "QuantConfig.group_size must be at most 2147483647"),
    Case("QuantConfig (assignment)", "group_size = 15 on a block-wise config",
         lambda c: setattr(ktfp8.QuantConfig("FP8", per_channel=False), "group_size", 15), ValueError,
         "QuantConfig.group_size must be even, got 15"),
    Case("QuantConfig (assignment)", "group_size = 128 after per_channel = True",
         lambda c: setattr(ktfp8.QuantConfig("FP8", per_channel=True), "group_size", 128), ValueError,
         "QuantConfig.group_size = 128 contradicts per_channel = True set before"),
    Case("QuantConfig", "per_channel='yes'", lambda c: ktfp8.QuantConfig("FP8", "yes"), TypeError,
         "per_channel must be a bool"),
    Case("MoeConfig.from_hf_config", "a path with no config.json",
         lambda c: ktfp8.MoeConfig.from_hf_config(c.tmp / "nowhere"), FileNotFoundError,
         "no Hugging Face config"),
    Case("MoeConfig.from_hf_config", "model_type a list (a raw TypeError: unhashable type)",
         lambda c: ktfp8.MoeConfig.from_hf_config({"model_type": ["qwen3_moe"], "num_experts": 4}), ValueError,
         "model_type must be a string, got list ['qwen3_moe']"),
    Case("MoeConfig.from_hf_config", "no expert count field",
         lambda c: ktfp8.MoeConfig.from_hf_config({"hidden_size": 8}), ValueError,
         "has no num_experts / n_routed_experts / num_local_experts / moe_num_experts field"),
    Case("MoeConfig.from_hf_config", "a per-layer list whose values differ (moe_topk, Hunyuan-A13B's key)",
         lambda c: ktfp8.MoeConfig.from_hf_config({"model_type": "hunyuan_v1_moe", "num_experts": 4,
                                                   "moe_topk": [2, 2, 3], "hidden_size": 8,
                                                   "intermediate_size": 8}),
         ValueError, "moe_topk is [2, 2, 3], not one value for every layer; a MoeConfig is one layer: pass that "
                     "layer's num_experts_per_tok=..."),
    Case("MoeConfig.from_hf_config", "unknown topk_method",
         lambda c: ktfp8.MoeConfig.from_hf_config({"num_experts": 4, "num_experts_per_tok": 2,
                                                   "hidden_size": 8, "intermediate_size": 8,
                                                   "topk_method": "random"}),
         ValueError, "unsupported topk_method 'random'"),
    Case("MoeConfig.from_hf_config", "a model_type it does not know, naming no scoring_func",
         lambda c: ktfp8.MoeConfig.from_hf_config({"model_type": "novel_moe", "num_experts": 4,
                                                   "num_experts_per_tok": 2, "hidden_size": 8,
                                                   "intermediate_size": 8}),
         ValueError, "model_type 'novel_moe' names no scoring_func or topk_method"),
    Case("MoeConfig.from_hf_config", "a config.json nested 100000 deep",
         lambda c: ktfp8.MoeConfig.from_hf_config(_deep_json(c.tmp / "deep.json")), ValueError,
         "is not a readable JSON config"),
    Case("MoeConfig.from_hf_config", "an int", lambda c: ktfp8.MoeConfig.from_hf_config(42), TypeError,
         "path_or_dict must be a dict"),
    # ---------------------------------------------------------------- route
    Case("route", "float64 logits", lambda c: ktfp8.route(np.zeros((3, E)), c.cfg), TypeError,
         "router_logits must be a numpy array or a torch tensor of float32, bfloat16 or float16, got float64"),
    Case("route", "logits [T, E+1]", lambda c: ktfp8.route(np.zeros((3, E + 1), F32), c.cfg), ValueError,
         "router_logits must have shape [T, expert_num=4]"),
    Case("route", "a dict as cfg", lambda c: ktfp8.route(ROUTER(c), {"expert_num": E}), TypeError,
         "cfg must be a ktfp8.MoeConfig"),
    Case("route", "correction_bias of the wrong length",
         lambda c: ktfp8.route(ROUTER(c), c.cfg, correction_bias=np.zeros(E + 1, F32)), ValueError,
         "correction_bias must have shape [expert_num=4]"),
    Case("route", "correction_bias with Inf",
         lambda c: ktfp8.route(ROUTER(c), c.cfg, correction_bias=np.full(E, np.inf, F32)), ValueError,
         "correction_bias must be finite"),
    Case("route", "correction_bias a list", lambda c: ktfp8.route(ROUTER(c), c.cfg, correction_bias=[0] * E),
         TypeError, "correction_bias must be None or a numpy float array"),
    Case("route", "logits a CUDA tensor", lambda c: ktfp8.route(_cuda(ROUTER(c)), c.cfg), ValueError,
         "router_logits is a tensor on device 'cuda:0'; ktfp8 computes on the CPU: pass router_logits.cpu()"),
    # ---------------------------------------------------------------- ktfp8.fp8
    Case("fp8.encode", "a list", lambda c: fp8.encode([1.0]), TypeError, "x must be a numpy array"),
    Case("fp8.encode", "int32 array", lambda c: fp8.encode(np.zeros(4, np.int32)), TypeError,
         "x must have dtype float32, bfloat16 or float16, got int32"),
    Case("fp8.encode", "backend='nope'", lambda c: fp8.encode(np.zeros(4, F32), backend="nope"), ValueError,
         "backend='nope' is not compiled in this build; usable backends:"),
    Case("fp8.encode", "backend=3", lambda c: fp8.encode(np.zeros(4, F32), backend=3), TypeError,
         "backend must be a str"),
    Case("fp8.encode", "threads=0", lambda c: fp8.encode(np.zeros(4, F32), threads=0), ValueError,
         "threads must be a positive int or None"),
    Case("fp8.encode", "KTFP8_BACKEND=nope in the environment",
         _with_env("KTFP8_BACKEND", "nope", lambda c: fp8.encode(np.zeros(4, F32))), ValueError,
         "KTFP8_BACKEND='nope' is not compiled"),
    Case("fp8.encode", "KTFP8_NUM_THREADS=zero in the environment",
         _with_env("KTFP8_NUM_THREADS", "zero", lambda c: fp8.encode(np.zeros(4, F32))), ValueError,
         "KTFP8_NUM_THREADS='zero' is not an integer"),
    Case("fp8.encode", "a float8_e4m3fnuz tensor",
         lambda c: fp8.encode(_tensor(lambda torch: torch.zeros(4, dtype=torch.float8_e4m3fnuz))), TypeError,
         "x has dtype torch.float8_e4m3fnuz, which NumPy cannot hold"),
    Case("fp8.decode", "a list of codes", lambda c: fp8.decode([1, 2]), TypeError,
         "codes must be a numpy array or a torch tensor of uint8 or float8_e4m3fn codes, got list"),
    Case("fp8.decode", "float32 codes", lambda c: fp8.decode(np.zeros(4, F32)), TypeError,
         "codes must have dtype uint8 or float8_e4m3fn, got float32"),
    Case("fp8.decode", "a float32 tensor as codes", lambda c: fp8.decode(_tensor(lambda torch: torch.zeros(4))),
         TypeError, "codes must have dtype uint8 or float8_e4m3fn, got float32"),
    Case("fp8.decode", "dtype=float16", lambda c: fp8.decode(np.zeros(4, U8), np.float16), ValueError,
         "dtype must be np.float32 or ml_dtypes.bfloat16, got float16"),
    Case("fp8.decode", "dtype='nonsense'", lambda c: fp8.decode(np.zeros(4, U8), "nonsense"), TypeError,
         "dtype must be np.float32 or ml_dtypes.bfloat16"),
    Case("fp8.decode", "dtype=None (NumPy would read float64)", lambda c: fp8.decode(np.zeros(4, U8), None),
         TypeError, "dtype must be np.float32 or ml_dtypes.bfloat16, got None"),
    Case("MoE.__call__", "x a nested tensor",
         lambda c: c.call(x=_tensor(_nested_rows)), TypeError,
         "x must be a dense tensor, got a nested tensor"),
    Case("MoE.__call__", "x a ZeroTensor (forward-mode AD's zero tangent: no memory)",
         lambda c: c.call(x=_tensor(lambda torch: torch._efficientzerotensor((3, H)))), TypeError,
         "x is a ZeroTensor, which has no memory; pass torch.zeros_like(x)"),
    Case("MoE.__call__", "x a tensor whose storage was resized to nothing (a parameter FSDP freed)",
         lambda c: c.call(x=_tensor(lambda torch: _freed(torch.tensor(c.x)))), TypeError,
         f"x's storage holds 0 bytes, less than the tensor spans ({3 * H * 4})"),
    Case("MoE.__call__", "topk_weights a tensor subclass NumPy cannot view (TwoTensor)",
         lambda c: c.call(topk_weights=_tensor(lambda torch: _two_tensor(torch.from_numpy(c.tw)))), TypeError,
         "topk_weights is a TwoTensor whose memory NumPy cannot view"),
    Case("fp8.quantize", "a 1-D array", lambda c: fp8.quantize(np.zeros(8, F32)), ValueError,
         "w must be 2-D [out, in] or 3-D [experts, out, in]"),
    Case("fp8.quantize", "an empty matrix", lambda c: fp8.quantize(np.zeros((0, 8), F32)), ValueError,
         "w must not be empty"),
    Case("fp8.quantize", "block=(0, 128)", lambda c: fp8.quantize(np.ones((4, 4), F32), False, (0, 128)),
         ValueError, "block sizes must be positive"),
    Case("fp8.quantize", "block=(2**70, 64)",
         lambda c: fp8.quantize(np.ones((4, 4), F32), False, (2**70, 64)), ValueError,
         "block sizes must be positive and at most 2147483647"),
    Case("fp8.quantize", "block='128'", lambda c: fp8.quantize(np.ones((4, 4), F32), False, "128"), TypeError,
         "block must be an int or a pair of ints"),
    Case("fp8.quantize", "per_channel=1", lambda c: fp8.quantize(np.ones((4, 4), F32), 1), TypeError,
         "per_channel must be True or False"),
    Case("fp8.quantize", "a sparse tensor", lambda c: fp8.quantize(_tensor(lambda torch: torch.eye(4).to_sparse())),
         TypeError, "w must be a dense tensor, got layout torch.sparse_coo"),
    Case("fp8.dequantize", "scale of neither shape",
         lambda c: fp8.dequantize(np.zeros((4, 8), U8), np.ones((4, 2), F32)), ValueError,
         "scale has shape (4, 2); for codes of shape (4, 8) expected (4, 1)"),
    Case("fp8.dequantize", "int64 scale", lambda c: fp8.dequantize(np.zeros((4, 8), U8), np.ones((4, 1), np.int64)),
         TypeError, "scale must have dtype float32"),
    # ---------------------------------------------------------------- quantize_experts / ExpertWeights
    Case("quantize_experts", "the MoeConfig as quant_config",
         lambda c: ktfp8.quantize_experts(c.w["gate"], c.w["up"], c.w["down"], c.cfg), TypeError,
         "quant_config must be a QuantConfig or a mapping of its fields, got MoeConfig (a MoeConfig holds one: "
         "cfg.quant_config)"),
    Case("quantize_experts", "quant_config a mapping with method 'INT4'",
         lambda c: ktfp8.quantize_experts(c.w["gate"], c.w["up"], c.w["down"], {"method": "INT4"}), ValueError,
         "QuantConfig.method must be one of 'FP8', 'BF16', got 'INT4'"),
    Case("quantize_experts", "a float32 weight beyond bfloat16's range, BF16",
         lambda c: ktfp8.quantize_experts(c.w["gate"], c.w["up"], _spoilt(c.w["down"], (2, 1, 0), 3.4e38),
                                          ktfp8.QuantConfig("BF16")), ValueError,
         "down holds 3.3999999521443642e+38 at [2, 1, 0], beyond bfloat16's largest finite value 3.3895e+38"),
    Case("quantize_experts", "float64 weights, FP8",
         lambda c: ktfp8.quantize_experts(c.w["gate"], c.w["up"].astype(np.float64), c.w["down"],
                                          c.cfg.quant_config), TypeError,
         "up must have dtype float32, bfloat16 or float16, got float64"),
    Case("quantize_experts", "int32 weights, BF16",
         lambda c: ktfp8.quantize_experts(c.w["gate"].astype(np.int32), c.w["up"], c.w["down"],
                                          ktfp8.QuantConfig("BF16")), TypeError,
         "gate must have dtype float32, bfloat16 or float16, got int32"),
    Case("quantize_experts", "an Inf among the weights, FP8",
         lambda c: ktfp8.quantize_experts(c.w["gate"], _spoilt(c.w["up"], (1, 2, 3), np.inf), c.w["down"],
                                          c.cfg.quant_config), ValueError,
         "up holds inf at [1, 2, 3]; only finite weights can be quantized"),
    Case("quantize_experts", "a NaN among bfloat16 weights, BF16",
         lambda c: ktfp8.quantize_experts(_spoilt(c.w["gate"], (3, 0, 5), np.nan).astype(BF16), c.w["up"],
                                          c.w["down"], ktfp8.QuantConfig("BF16")), ValueError,
         "gate holds nan at [3, 0, 5]; only finite weights can be quantized"),
    Case("quantize_experts", "experts=range(0, 1) with 2-D matrices",
         lambda c: ktfp8.quantize_experts(c.w["gate"][0], c.w["up"][0], c.w["down"][0], c.cfg.quant_config,
                                          experts=range(0, 1)), ValueError,
         "experts= needs gate, up and down as 3-D [experts, out, in] stacks of one expert count"),
    Case("quantize_experts", "down a list",
         lambda c: ktfp8.quantize_experts(c.w["gate"], c.w["up"], c.w["down"].tolist(), ktfp8.QuantConfig("BF16")),
         TypeError, "down must be a numpy array or a torch tensor (float32, bfloat16 or float16), got list"),
    Case("quantize_experts", "gate 2-D",
         lambda c: ktfp8.quantize_experts(c.w["gate"][0], c.w["up"][0], c.w["down"][0], c.cfg.quant_config),
         ValueError, "ExpertWeights.gate must be a 3-D numpy array"),
    Case("ExpertWeights", "format='int4'", lambda c: c.experts_with(format="int4"), ValueError,
         "ExpertWeights.format must be one of"),
    Case("ExpertWeights", "total_experts=2**70 (the first call's C conversion overflowed)",
         lambda c: c.experts_with(total_experts=2**70), ValueError,
         "ExpertWeights.total_experts must be a non-negative int at most 2147483647, got 1180591620717411303424"),
    Case("ExpertWeights", "fp8 with float32 weights", lambda c: c.experts_with(gate=c.w["gate"]), TypeError,
         "ExpertWeights.gate must be float8_e4m3fn or uint8 codes, got float32"),
    Case("ExpertWeights", "up of another shape", lambda c: c.experts_with(up=c.experts.up[:, :-1]), ValueError,
         "ExpertWeights.up has shape (4, 31, 64), expected (4, 32, 64) like gate"),
    Case("ExpertWeights", "no experts (gate [0, I, H])",
         lambda c: c.experts_with(**{n: getattr(c.experts, n)[:0] for n in ("gate", "up", "down", "gate_scale",
                                                                          "up_scale", "down_scale")}),
         ValueError, f"ExpertWeights sizes must be positive, got gate shape (0, {I}, {H})"),
    Case("ExpertWeights", "a scale missing", lambda c: c.experts_with(down_scale=None), TypeError,
         "ExpertWeights.down_scale must be a float32 numpy array of shape (4, 64, 1)"),
    Case("ExpertWeights", "a scale of the wrong shape",
         lambda c: c.experts_with(gate_scale=np.ones((E, I, 2), F32)), ValueError,
         "ExpertWeights.gate_scale has shape (4, 32, 2), expected (4, 32, 1)"),
    Case("ExpertWeights", "a scale of 1e37 (above FLT_MAX / 256)",
         lambda c: c.experts_with(up_scale=np.full((E, I, 1), 1e37, F32)), ValueError,
         "ExpertWeights.up_scale holds 1e+37 at [0, 0, 0]; |scale| must be at most 1.329e+36 (FLT_MAX / 256)"),
    Case("ExpertWeights", "fp8_block without block", lambda c: c.experts_with(format="fp8_block"), ValueError,
         "fp8_block needs block=(block_n, block_k) > 0"),
    Case("ExpertWeights", "fp8_block with block=(64.5, 64.5)",
         lambda c: c.experts_with(format="fp8_block", block=(64.5, 64.5)), TypeError,
         "ExpertWeights.block must be an int or a pair of ints (block_out, block_in), got (64.5, 64.5)"),
    Case("ExpertWeights", "fp8_per_channel with a block", lambda c: c.experts_with(block=(8, 8)), ValueError,
         "ExpertWeights of format 'fp8_per_channel' take no block (one scale per output row), got block=(8, 8)"),
    Case("ExpertWeights", "bf16 weights with scales",
         lambda c: c.experts_with(format="bf16", gate=c.w["gate"].astype(BF16), up=c.w["up"].astype(BF16),
                                  down=c.w["down"].astype(BF16)), ValueError,
         "ExpertWeights of format 'bf16' carry no scales or block; got gate_scale, up_scale, down_scale"),
    Case("ExpertWeights", "bf16 format with uint8 weights", lambda c: c.experts_with(format="bf16"), TypeError,
         "ExpertWeights.gate must be bfloat16 (or uint16 bits), got uint8"),
    Case("ExpertWeights", "gate a meta tensor",
         lambda c: c.experts_with(gate=_tensor(lambda torch: torch.empty(E, I, H, dtype=torch.uint8, device="meta"))),
         ValueError, "ExpertWeights.gate is a meta tensor (a shape without data)"),
    # ---------------------------------------------------------------- MoE construction
    Case("MoE", "a tuple as experts", lambda c: ktfp8.MoE(c.cfg, (c.w["gate"], c.w["up"], c.w["down"])),
         TypeError, "experts must be ktfp8.ExpertWeights, got tuple"),
    Case("MoE", "a dict as config", lambda c: ktfp8.MoE({"expert_num": E}, c.experts), TypeError,
         "config must be a ktfp8.MoeConfig, got dict"),
    Case("MoE", "experts of other sizes than the config", lambda c: ktfp8.MoE(cfg(hidden_size=H + 1), c.experts),
         ValueError, "experts hold (expert_num, hidden_size, intermediate_size) = (4, 64, 32), config says "
                     "(4, 65, 32)"),
    Case("MoE", "per-channel experts, block-wise config", lambda c: ktfp8.MoE(c.block_config(64), c.experts),
         ValueError, "experts are 'fp8_per_channel' but config.quant_config asks for 'fp8_block'"),
    Case("MoE", "experts in 32 x 32 blocks, config.quant_config.group_size 64",
         lambda c: ktfp8.MoE(c.block_config(64), ktfp8.quantize_experts(c.w["gate"], c.w["up"], c.w["down"],
                                                                        c.block_config(32).quant_config)),
         ValueError, "experts use block (32, 32), config.quant_config.group_size is 64"),
    Case("MoE", "block-wise experts with an odd K block",
         lambda c: ktfp8.MoE(c.block_config(8), c.odd_block_experts()), ValueError,
         "block-wise FP8 needs an even K block edge, got block=(8, 7)"),
    Case("MoE", "an unknown backend name",
         lambda c: ktfp8.MoE(c.cfg, c.experts, backend="no_such_backend"), ValueError,
         "backend='no_such_backend' is not compiled in this build; usable backends:"),
    Case("MoE", "threads=-1", lambda c: ktfp8.MoE(c.cfg, c.experts, threads=-1), ValueError,
         "threads must be a positive int or None, got -1"),
    Case("MoE", "threads=2**31 (more than OpenMP could start)", lambda c: ktfp8.MoE(c.cfg, c.experts, threads=2**31),
         ValueError, "threads must be at most"),
    Case("MoE", "KTFP8_NUM_THREADS=100000 in the environment",
         _with_env("KTFP8_NUM_THREADS", "100000", lambda c: ktfp8.MoE(c.cfg, c.experts)), ValueError,
         "KTFP8_NUM_THREADS must be at most"),
    Case("MoE", "KTFP8_BACKEND=AVX2 in the environment (upper case)",
         _with_env("KTFP8_BACKEND", "AVX2", lambda c: ktfp8.MoE(c.cfg, c.experts)), ValueError,
         "KTFP8_BACKEND='AVX2' is not a backend name (they are lower case, without spaces: 'avx2' is one)"),
    Case("MoE", "KTFP8_NUM_THREADS=1_0 in the environment (Python's int() takes it, OpenMP does not)",
         _with_env("KTFP8_NUM_THREADS", "1_0", lambda c: ktfp8.MoE(c.cfg, c.experts)), ValueError,
         "KTFP8_NUM_THREADS='1_0' is not an integer"),
    Case("MoE", "OMP_NUM_THREADS=-4 in the environment",
         _with_env("OMP_NUM_THREADS", "-4", lambda c: ktfp8.MoE(c.cfg, c.experts)), ValueError,
         "OMP_NUM_THREADS='-4' must be a positive integer"),
    Case("MoE.threads (assignment)", "moe.threads = 0", lambda c: setattr(c.moe, "threads", 0), ValueError,
         "threads must be a positive int or None, got 0"),
    Case("pickle.dumps(MoE)", "a built layer", lambda c: __import__("pickle").dumps(c.moe), TypeError,
         "MoE cannot be pickled: its weights are packed for this CPU's"),
    # ---------------------------------------------------------------- MoE call / forward
    Case("MoE.__call__", "x float64", lambda c: c.call(x=c.x.astype(np.float64)), TypeError,
         "x must have dtype float32 or bfloat16, got float64"),
    Case("MoE.__call__", "x of the wrong hidden size", lambda c: c.call(x=np.zeros((3, H + 1), F32)), ValueError,
         "x must have shape [T, 64], got (3, 65)"),
    Case("MoE.__call__", "x non-contiguous", lambda c: c.call(x=np.zeros((3, 2 * H), F32)[:, ::2]), ValueError,
         "x must be C-contiguous"),
    Case("MoE.__call__", "x a list", lambda c: c.call(x=c.x.tolist()), TypeError, "x must be a numpy array"),
    Case("MoE.__call__", "x a CUDA tensor", lambda c: c.call(x=_cuda(c.x)), ValueError,
         "x is a tensor on device 'cuda:0'; ktfp8 computes on the CPU: pass x.cpu() or copy_to_cpu=True"),
    Case("MoE.__call__", "x a meta tensor", lambda c: c.call(x=_tensor(lambda torch: torch.empty(3, H, device="meta"))),
         ValueError, "x is a meta tensor (a shape without data); ktfp8 needs a CPU tensor"),
    Case("MoE.__call__", "x a float64 tensor", lambda c: c.call(x=_tensor(lambda torch: torch.zeros(3, H).double())),
         TypeError, "x must have dtype float32 or bfloat16, got float64"),
    Case("MoE.__call__", "x a non-contiguous tensor", lambda c: c.call(x=_tensor(lambda torch: torch.zeros(H, 3).T)),
         ValueError, "x must be C-contiguous (use np.ascontiguousarray, or .contiguous() on a tensor)"),
    Case("MoE.__call__", "out a bfloat16 tensor for float32 x",
         lambda c: c.call(out=_tensor(lambda torch: torch.zeros(3, H, dtype=torch.bfloat16))), TypeError,
         "out must have dtype float32, got bfloat16"),
    Case("MoE.__call__", "out a tensor that requires grad (grad mode on)",
         lambda c: c.call(out=_tensor(lambda torch: torch.zeros(3, H, requires_grad=True))), ValueError,
         "out requires grad: ktfp8 writes it in place outside autograd"),
    Case("MoE.__call__", "topk_ids float32", lambda c: c.call(topk_ids=c.ids.astype(F32)), TypeError,
         "topk_ids must have dtype int32 or int64, got float32"),
    Case("MoE.__call__", "an expert id >= expert_num", lambda c: c.call(topk_ids=c.ids + E), ValueError,
         "topk_ids holds expert id 7 >= expert_num 4"),
    Case("MoE.__call__", "topk_ids [T, k-1]", lambda c: c.call(topk_ids=c.ids[:, :1].copy()), ValueError,
         "topk_ids must have shape [T, num_experts_per_tok] = (3, 2), got (3, 1)"),
    Case("MoE.__call__", "topk_weights float64", lambda c: c.call(topk_weights=c.tw.astype(np.float64)),
         TypeError, "topk_weights must have dtype float32, got float64"),
    Case("MoE.__call__", "topk_weights for fewer tokens", lambda c: c.call(topk_weights=c.tw[:2].copy()),
         ValueError, "topk_weights must have shape [T, num_experts_per_tok] = (3, 2), got (2, 2)"),
    Case("MoE.__call__", "x a numpy.ma.MaskedArray", lambda c: c.call(x=np.ma.masked_less(c.x, 0)), TypeError,
         "x is a numpy.ma.MaskedArray, whose mask ktfp8 cannot honour"),
    Case("MoE.__call__", "out of another shape", lambda c: c.call(out=np.zeros((2, H), F32)), ValueError,
         "out must have the shape of x (3, 64), got (2, 64)"),
    Case("MoE.__call__", "out of another dtype than x", lambda c: c.call(out=np.zeros((3, H), BF16)), TypeError,
         "out must have dtype float32, got bfloat16"),
    Case("MoE.__call__", "out read-only",
         lambda c: c.call(out=np.lib.stride_tricks.as_strided(np.zeros((3, H), F32), writeable=False)),
         ValueError, "out must be writeable"),
    Case("MoE.__call__", "accumulate='False' (a string)",
         lambda c: c.moe(c.x, c.ids, c.tw, out=np.zeros_like(c.x), accumulate="False"), TypeError,
         "accumulate must be a bool, got str 'False'"),
    Case("MoE.__call__", "accumulate=True without out", lambda c: c.moe(c.x, c.ids, c.tw, accumulate=True),
         ValueError, "accumulate=True needs out="),
    Case("MoE.forward", "router_logits and topk_ids both given",
         lambda c: c.moe.forward(c.x, c.ids, c.tw, router_logits=ROUTER(c)), ValueError,
         "pass either router_logits= or topk_ids/topk_weights, not both"),
    Case("MoE.forward", "neither router_logits nor topk_ids", lambda c: c.moe.forward(c.x), ValueError,
         "forward needs topk_ids and topk_weights, or router_logits="),
    Case("MoE.forward", "correction_bias with topk_ids (it would be ignored)",
         lambda c: c.moe.forward(c.x, c.ids, c.tw, correction_bias=np.zeros(E, F32)), ValueError,
         "correction_bias= applies to router_logits="),
    Case("MoE.forward", "router_logits of the wrong width",
         lambda c: c.moe.forward(c.x, router_logits=np.zeros((3, E + 2), F32)), ValueError,
         "router_logits must have shape [T, expert_num=4]"),
    Case("MoE.forward", "router_logits for another number of tokens than x",
         lambda c: c.moe.forward(c.x, router_logits=np.zeros((2, E), F32)), ValueError,
         "router_logits must have one row per token of x: got 2 rows for 3 tokens"),
    # ---------------------------------------------------------------- moe_forward
    Case("moe_forward", "config=None", lambda c: ktfp8.moe_forward(c.x, c.experts, c.ids, c.tw, None), TypeError,
         "config must be a ktfp8.MoeConfig, got NoneType"),
    Case("moe_forward", "experts of another format than the config",
         lambda c: ktfp8.moe_forward(c.x, c.experts, c.ids, c.tw, ktfp8.MoeConfig(
             E, K, H, I, quant_config={"method": "BF16"})), ValueError,
         "experts are 'fp8_per_channel' but config.quant_config asks for 'bf16'"),
    Case("moe_forward", "negative and too-large ids mixed",
         lambda c: ktfp8.moe_forward(c.x, c.experts, np.array([[-1, 9]] * 3), c.tw, c.cfg), ValueError,
         "topk_ids holds expert id 9 >= expert_num 4"),
    Case("moe_forward", "topk_ids a CUDA tensor",
         lambda c: ktfp8.moe_forward(c.x, c.experts, _cuda(c.ids), c.tw, c.cfg), ValueError,
         "topk_ids is a tensor on device 'cuda:0'; ktfp8 computes on the CPU: pass topk_ids.cpu() or copy_to_cpu=True"),
    # ---------------------------------------------------------------- FP8SafeTensorLoader
    Case("FP8SafeTensorLoader", "a path that is not a folder",
         lambda c: FP8SafeTensorLoader(c.ckpt / "config.json"), SafetensorsError, "not a directory"),
    Case("FP8SafeTensorLoader", "a folder without weights",
         lambda c: FP8SafeTensorLoader((c.tmp / "empty").mkdir() or c.tmp / "empty"), SafetensorsError,
         "no model.safetensors.index.json and no .safetensors files"),
    Case("FP8SafeTensorLoader", "a shard truncated mid-tensor", _truncated_shard, SafetensorsError,
         "truncated: tensor"),
    Case("FP8SafeTensorLoader", "an index that is not JSON", lambda c: _bad_index(c, "{weight_map"),
         SafetensorsError, "model.safetensors.index.json: not valid JSON"),
    Case("FP8SafeTensorLoader", "an index naming a shard in another folder",
         lambda c: _bad_index(c, json.dumps({"weight_map": {"a": "../model.safetensors"}})), SafetensorsError,
         "shard name '../model.safetensors' must be a plain file name"),
    Case("FP8SafeTensorLoader", "an index nested 100000 deep", lambda c: _bad_index(c, "[" * 100_000),
         SafetensorsError, "model.safetensors.index.json: not valid JSON"),
    Case("FP8SafeTensorLoader", "a shard header nested 100000 deep", _deep_header, SafetensorsError,
         "header is not valid JSON (nested too deeply)"),
    Case("FP8SafeTensorLoader.load_experts", "a layer without experts",
         lambda c: FP8SafeTensorLoader(c.ckpt).load_experts(7), ValueError, "layer 7 has no experts"),
    Case("FP8SafeTensorLoader.load_experts", "layer 0.0 (a float)",
         lambda c: FP8SafeTensorLoader(c.ckpt).load_experts(0.0), TypeError, "layer must be an int, got float 0.0"),
    Case("FP8SafeTensorLoader.load_experts", "a NaN in a weight_scale",
         lambda c: _edited_checkpoint(c, "nan_scale", _nan_scale), SafetensorsError,
         "experts.1.up_proj.weight_scale holds nan at [2, 0]; scales must be finite, >= 0 and at most 1.329e+36 (FLT_MAX / 256)"),
    Case("FP8SafeTensorLoader.load_experts", "a stray tensor of expert 7 beside experts 0-3", _stray_expert,
         SafetensorsError, f"experts [4, 5, 6] have no gate, up or down weight, yet '{_expert(7, 'up')}' names "
                           f"expert 7: expert indices run from 0 without a gap"),
    Case("FP8SafeTensorLoader.load_experts", "a stray tensor of expert 10**9 beside experts 0-3",
         lambda c: _stray_expert(c, 10**9), SafetensorsError,
         f"experts [4, 5, 6, 7, 8, 9, 10, 11, ... (999999996 in all)] have no gate, up or down weight, yet "
         f"'{_expert(10**9, 'up')}' names expert 1000000000"),
    Case("FP8SafeTensorLoader.load_experts", "one expert's up weight BF16, the others F8_E4M3",
         lambda c: _edited_checkpoint(c, "one_in_bf16", _one_in_bf16), SafetensorsError,
         "layer 0 expert weights have dtypes ['BF16', 'F8_E4M3']; expected one"),
    Case("FP8SafeTensorLoader.load_experts", "expert weights stored as I8",
         lambda c: _edited_checkpoint(c, "int8", _weights_as_int8), SafetensorsError,
         "layer 0 expert weights are I8; supported: F8_E4M3, BF16, F16, F32"),
    Case("FP8SafeTensorLoader.load_experts", "F8_E4M3 weights without any scale",
         lambda c: _edited_checkpoint(c, "no_scales", _without(".weight_scale")), SafetensorsError,
         "layer 0 experts are F8_E4M3 without weight_scale or weight_scale_inv tensors"),
    Case("FP8SafeTensorLoader.load_experts", "the down projections' weight_scale missing",
         lambda c: _edited_checkpoint(c, "no_down_scales", _without("down_proj.weight_scale")), SafetensorsError,
         "layer 0 has no down expert weight_scale tensors under model.layers.0.mlp.experts"),
    Case("FP8SafeTensorLoader.load_experts", "one expert's gate weight a row short",
         lambda c: _edited_checkpoint(c, "row_short", _row_short), SafetensorsError,
         f"layer 0 gate weight: experts differ in shape or dtype ({_expert(2, 'gate')}: F8_E4M3 [{I - 1}, {H}], "
         f"but {_expert(0, 'gate')}: F8_E4M3 [{I}, {H}])"),
    Case("FP8SafeTensorLoader.load_experts", "a weight_scale of two values a row",
         lambda c: _edited_checkpoint(c, "two_scales_a_row", _two_scales_a_row), SafetensorsError,
         f"layer 0 gate weight_scale has per-expert shape [{I}, 2]; per-channel needs [{I}] or [{I}, 1]"),
    Case("FP8SafeTensorLoader.load_experts",
         "weight_scale_inv of 2 x 2 scales a matrix, where 128 x 128 blocks make 1 x 1",
         lambda c: _edited_checkpoint(c, "block_scales", _block_scales_of_2x2), SafetensorsError,
         f"layer 0 gate weight_scale_inv has shape [{E}, 2, 2]; block [128, 128] needs [{E}, 1, 1]"),
    Case("FP8SafeTensorLoader", "one tensor in two shards, no index", _in_two_shards, SafetensorsError,
         f"tensor '{_expert(0, 'gate')}' is in both a.safetensors and b.safetensors"),
    Case("FP8SafeTensorLoader", "an index without weight_map",
         lambda c: _bad_index(c, json.dumps({"metadata": {}})), SafetensorsError,
         "model.safetensors.index.json: needs a 'weight_map' object mapping tensor names to file names"),
    Case("FP8SafeTensorLoader.tensor", "a name the checkpoint lacks",
         lambda c: FP8SafeTensorLoader(c.ckpt).tensor("lm_head.weight"), SafetensorsError,
         "no tensor named 'lm_head.weight' in this checkpoint"),
    Case("FP8SafeTensorLoader", "a named pipe called extra.safetensors (no index, no model.safetensors)", _fifo_shard,
         SafetensorsError,
         "extra.safetensors: is not a regular file, expected a .safetensors file"),
    Case("FP8SafeTensorLoader.config", "no config.json", _without_config, ValueError,
         "no config.json to build a MoeConfig from"),
    # ---------------------------------------------------------------- python -m ktfp8.convert
    Case("python -m ktfp8.convert", "--input-type missing",
         lambda c: convert_main(["--input-path", str(c.ckpt), "--output-path", str(c.tmp / "o")]), 2,
         "the following arguments are required: --input-type"),
    Case("python -m ktfp8.convert", "--quant-config not JSON", lambda c: _convert(c, "--quant-config", "{x"), 2,
         "not valid JSON"),
    Case("python -m ktfp8.convert", "--quant-config with unknown keys",
         lambda c: _convert(c, "--quant-config", '{"method":"FP8","bits":4}'), 2, "unknown keys"),
    Case("python -m ktfp8.convert", "--quant-config nested 100000 deep",
         lambda c: _convert(c, "--quant-config", "[" * 100_000), 2, "argument --quant-config: not valid JSON"),
    Case("python -m ktfp8.convert", "--threads 0", lambda c: _convert(c, "--threads", "0"), 2,
         "must be a positive integer, got '0'"),
    Case("python -m ktfp8.convert", "--threads 100000", lambda c: _convert(c, "--threads", "100000"), 2,
         "the thread count must be at most"),
    Case("python -m ktfp8.convert", "--max-shard-size 5XB", lambda c: _convert(c, "--max-shard-size", "5XB"), 2,
         "is not like 5GB"),
    Case("python -m ktfp8.convert", "--max-shard-size of 400 digits",
         lambda c: _convert(c, "--max-shard-size", "1" + "0" * 400), 2, "is too large"),
    Case("python -m ktfp8.convert", "an input folder that does not exist",
         lambda c: convert_main(["--input-type", "bf16", "--input-path", str(c.tmp / "absent"),
                                 "--output-path", str(c.tmp / "o")]), 1, "does not exist or is not a directory"),
    Case("python -m ktfp8.convert", "a non-empty output folder without --overwrite", _non_empty, 1,
         "is not empty; pass --overwrite to replace it"),
    Case("python -m ktfp8.convert", "--overwrite of a folder that holds no model (no config.json, no safetensors)",
         lambda c: _non_empty(c, "--overwrite"), 1,
         "holds no config.json or *.safetensors: it is no model folder, and --overwrite would delete everything"),
    Case("python -m ktfp8.convert", "the output inside the input",
         lambda c: _convert(c, out="ckpt/inner"), 1, "must be outside the input"),
    Case("python -m ktfp8.convert", "--output-path . (the working directory)", _into_working_dir, 1,
         "is (or contains) the current directory; run from outside it"),
    Case("python -m ktfp8.convert", "an output in a folder nothing can be written into (/proc)",
         lambda c: _convert_bf16(c, "bf16_into_proc", lambda tensors, config: None, out="/proc/out"), 1,
         "cannot write the output /proc/out into /proc:"),
    Case("python -m ktfp8.convert", "an output path that is a symlink to itself", _symlink_loop, 1,
         "its symlinks cannot be followed"),
    Case("python -m ktfp8.convert", "an output under a file", _under_a_file, 1,
         "cannot write the output"),
    Case("python -m ktfp8.convert", "--input-type not matching the weights",
         lambda c: _convert(c, input_type="bf16"), 1, "already F8_E4M3; use --input-type fp8"),
    Case("python -m ktfp8.convert", "an expert weight of another shape than config.json says",
         lambda c: _convert_bf16(c, "wide_gate", _wider_gate), 1,
         f"'{_expert(1, 'gate')}' has shape [{I + 8}, {H}]; expected [intermediate, hidden] = [{I}, {H}]"),
    Case("python -m ktfp8.convert", "experts of different shapes, config.json without the sizes",
         lambda c: _convert_bf16(c, "no_sizes", _without_sizes), 1,
         f"has shape [{H}, {I - 8}]; expected [hidden, intermediate] = [{H}, {I}] (as most experts of"),
    Case("python -m ktfp8.convert", "an expert without its up_proj",
         lambda c: _convert_bf16(c, "no_up", lambda t, cfg: t.pop(_expert(2, "up"))), 1,
         f"expert tensor '{_expert(2, 'up')}' is missing"),
    Case("python -m ktfp8.convert", "an expert index past config.json's expert count",
         lambda c: _convert_bf16(c, "extra_expert", lambda t, cfg: t.update(
             {_expert(E, r): t[_expert(0, r)] for r in ("gate", "up", "down")})), 1,
         f"expert index {E} is out of range (config.json: num_experts {E}"),
    Case("python -m ktfp8.convert", "config.json's num_experts 2**63, experts 0-3 only",
         lambda c: _convert_bf16(c, "count_2_63", lambda t, cfg: cfg.update(num_experts=2**63)), 1,
         f"expert tensor '{_expert(E, 'gate')}' is missing: model.layers.0.mlp.experts needs experts "
         f"0-{2**63 - 1} (config.json: num_experts {2**63})"),
    Case("python -m ktfp8.convert", "a weight_scale_inv beside a BF16 expert weight",
         lambda c: _convert_bf16(c, "stale_scale", lambda t, cfg: t.update(
             {_expert(1, "gate") + "_scale_inv": ("F32", np.ones((1, 1), F32))})), 1,
         f"tensor '{_expert(1, 'gate')}_scale_inv' scales '{_expert(1, 'gate')}', which is BF16, not F8_E4M3: a "
         f"scale beside a float weight is stale"),
    Case("python -m ktfp8.convert", "a weight_scale beside a block-wise FP8 weight and its weight_scale_inv",
         lambda c: _convert_block_fp8(c, "both_scales", extra={_expert(1, "gate") + "_scale": ("F32", np.ones(
             (I, 1), F32))}), 1,
         f"tensor '{_expert(1, 'gate')}' has both a weight_scale_inv and a weight_scale"),
    Case("python -m ktfp8.convert", "the NaN code in a block-wise FP8 weight copied as it is (same blocks)",
         lambda c: _convert_block_fp8(c, "nan_code_copied", nan_code=True, args=("--quant-config",
                                                                                 '{"group_size": 32}')), 1,
         f"tensor '{_expert(1, 'gate')}' holds the FP8 NaN code 0xFF at [0, 1]; a NaN weight makes every output"),
    Case("python -m ktfp8.convert", "the NaN code in a block-wise FP8 weight to requantize per-channel",
         lambda c: _convert_block_fp8(c, "nan_code_requantized", nan_code=True), 1,
         f"tensor '{_expert(1, 'gate')}' dequantized with '{_expert(1, 'gate')}_scale_inv' holds nan at [0, 1]"),
    Case("python -m ktfp8.convert", "a dangling symlink among the input's other files (an interrupted download)",
         lambda c: _with_other_file(c, "dangling", c.tmp / "absent_blob"), 1,
         "which does not exist (an interrupted download?)"),
    Case("python -m ktfp8.convert", "a symlink to /dev/zero among the input's other files",
         lambda c: _with_other_file(c, "device", "/dev/zero"), 1,
         "tokenizer.json is not a regular file (a device, FIFO or socket)"),
    Case("python -m ktfp8.convert", "an expert weight with no rows",
         lambda c: _convert_bf16(c, "empty_expert", lambda t, cfg: t.update(
             {_expert(1, "up"): ("BF16", np.zeros((0, H), BF16))})),
         1, f"tensor '{_expert(1, 'up')}' has shape [0, {H}]; an empty weight has nothing to quantize"),
    Case("python -m ktfp8.convert", "routed experts stored fused (...experts.gate_up_proj, 3-D) by a model type "
         "whose fused layout it does not know",
         lambda c: _convert_bf16(c, "fused", _fused), 1,
         "holds a layer's routed experts fused in one 3-D tensor, whose layout python -m ktfp8.convert does not "
         "know for model type qwen3_moe"),
    Case("python -m ktfp8.convert", "--quant-config with a key given twice (json.loads keeps the last)",
         lambda c: _convert(c, "--quant-config", '{"per_channel":true,"per_channel":false}'), 2,
         "argument --quant-config: duplicate key 'per_channel'"),
    Case("python -m ktfp8.convert", "--quant-config group_size 2**31",
         lambda c: _convert(c, "--quant-config", '{"per_channel":false,"group_size":2147483648}'), 2,
         "argument --quant-config: group_size must be at most 2147483647"),
    Case("python -m ktfp8.convert", "a NaN in an expert weight to quantize",
         lambda c: _convert_bf16(c, "nan_weight", lambda t, cfg: t[_expert(1, "gate")][1].__setitem__((2, 3), np.nan)),
         1, f"tensor '{_expert(1, 'gate')}' holds nan at [2, 3]; only finite weights can be quantized"),
    Case("python -m ktfp8.convert", "an Inf in an expert weight to quantize",
         lambda c: _convert_bf16(c, "inf_weight", lambda t, cfg: t[_expert(1, "gate")][1].__setitem__((2, 3), -np.inf)),
         1, f"tensor '{_expert(1, 'gate')}' holds -inf at [2, 3]; only finite weights can be quantized"),
    Case("python -m ktfp8.convert", "a NaN in a block-wise FP8 input's weight_scale_inv",
         lambda c: _convert_block_fp8(c, "nan_scale_inv", np.nan), 1,
         f"tensor '{_expert(1, 'gate')}_scale_inv' holds nan at [0, 1]; scales must be finite, >= 0 and at most 1.329e+36 (FLT_MAX / 256)"),
    Case("python -m ktfp8.convert", "a negative value in a block-wise FP8 input's weight_scale_inv",
         lambda c: _convert_block_fp8(c, "negative_scale_inv", -1.0), 1,
         f"tensor '{_expert(1, 'gate')}_scale_inv' holds -1.0 at [0, 1]; scales must be finite, >= 0 and at most 1.329e+36 (FLT_MAX / 256)"),
    # ---------------------------------------------------------------- python -m ktfp8.cpu
    Case("python -m ktfp8.cpu", "an unknown option", lambda c: cpu_main(["--verbose"]), 2,
         "unrecognized arguments: --verbose"),
    # ---------------------------------------------------------------- ktfp8.hf (torch + transformers)
    Case("ktfp8.hf.from_pretrained", "a folder that does not exist",
         lambda c: _hf().from_pretrained(c.tmp / "absent"), FileNotFoundError, "no such model folder"),
    Case("ktfp8.hf.from_pretrained", "a folder whose experts are BF16", _bf16_experts_folder, ValueError,
         "experts are 'bf16', not FP8"),
    Case("ktfp8.hf.from_pretrained", "FP8 tensors outside the experts (--all-linear)", _fp8_attention, ValueError,
         "FP8 tensors outside the routed experts"),
    Case("ktfp8.hf.from_pretrained", "a model type without supported experts",
         lambda c: _hf().from_pretrained(_with_config(c, "llama", model_type="llama")), ValueError,
         "model type 'llama' is not supported"),
    Case("ktfp8.hf.from_pretrained", "dtype=torch.float16",
         lambda c: _hf().from_pretrained(c.ckpt, dtype=__import__("torch").float16), TypeError,
         "dtype must be torch.bfloat16 or torch.float32"),
    Case("ktfp8.hf.from_pretrained", "a layer holding fewer experts than config.json says", _fewer_experts,
         ValueError, "model.layers.0.mlp.experts has 4 experts by config.json, the checkpoint holds experts 0-2 of "
         "layer 0"),
    Case("ktfp8.hf.from_pretrained", "key_mapping= (set by ktfp8.hf)",
         lambda c: _hf().from_pretrained(c.ckpt, key_mapping={}), TypeError, "sets key_mapping= itself"),
    Case("ktfp8.hf.from_pretrained", "a config.json whose vocab_size is not the checkpoint's",
         lambda c: _hf().from_pretrained(_vocab_changed(c, fp8=True)), ValueError,
         "weight(s) of another shape than config.json gives, e.g. lm_head.weight (16, 16) in the checkpoint, "
         "(12, 16) in Qwen3MoeForCausalLM"),
    Case("ktfp8.hf.prepare", "not a transformers model", lambda c: _hf().prepare("model"), TypeError,
         "model must be a transformers PreTrainedModel"),
    Case("ktfp8.hf.prepare", "a model type without supported experts", lambda c: _hf().prepare(_tiny_llama()),
         ValueError, "model type 'llama' is not supported"),
    Case("ktfp8.hf.prepare", "a Qwen3-MoE whose layers are all dense (mlp_only_layers)",
         lambda c: _hf().prepare(_tiny_qwen3_moe(mlp_only_layers=[0])), ValueError,
         "Qwen3MoeForCausalLM has no experts module that transformers' experts_implementation dispatches"),
    Case("ktfp8.hf.prepare", "experts whose activation is exact GELU (hidden_act 'gelu')",
         lambda c: _hf().prepare(_tiny_qwen3_moe(hidden_act="gelu")), ValueError,
         "Qwen3MoeExperts with hidden_act='gelu' (the kernels compute silu or gelu_pytorch_tanh)"),
    Case("ktfp8.hf.prepare", "KTFP8_EXPERT_PARALLEL=yes in the environment",
         _with_env("KTFP8_EXPERT_PARALLEL", "yes", lambda c: _hf().prepare(_tiny_qwen3_moe())), ValueError,
         "KTFP8_EXPERT_PARALLEL='yes' must be 0 (every rank holds every expert) or 1"),
    Case("ktfp8.hf.prepare", "save_pretrained of a prepared model (experts released)",
         lambda c: _prepared_qwen3_moe().save_pretrained(c.tmp / "saved_prepared"), ValueError,
         "ktfp8 holds the routed experts of this model"),
    Case("ktfp8.hf.prepare", "set_experts_implementation('eager') after prepare", _switched_back, ValueError,
         "so this model cannot switch back to another experts implementation"),
    Case("ktfp8.hf.prepare", "pickle of a prepared model",
         lambda c: __import__("pickle").dumps(_prepared_qwen3_moe()), TypeError,
         "whose experts ktfp8 holds cannot be pickled"),
    Case("ktfp8.hf.prepare", "a float16 model", _float16_model, TypeError,
         "the model runs in torch.float16; ktfp8 takes float32 or bfloat16 activations"),
    Case("ktfp8.hf.prepare", "the model cast with .half() after its first forward", _half_after_first_forward,
         TypeError, "the model runs in torch.float16; ktfp8 takes float32 or bfloat16 activations"),
    Case("ktfp8.hf.prepare", "a forward-mode AD tangent (torch.autograd.forward_ad) through the experts",
         _forward_mode_ad, NotImplementedError,
         "forward-mode AD (torch.autograd.forward_ad) through Qwen3MoeExperts is not supported"),
    Case("experts_implementation='ktfp8'", "a NaN expert weight, met when the first forward quantizes it",
         _nan_at_first_forward, ValueError,
         "Qwen3MoeExperts, quantized at its first forward: gate holds nan at [2, 3, 4]; only finite weights"),
    # ---------------------------------------------------------------- python -m ktfp8.generate
    Case("python -m ktfp8.generate", "a folder that does not exist",
         lambda c: _generate(c, "--model", str(c.tmp / "absent"), "--prompt-ids", "1"), 1, "no such model folder"),
    Case("python -m ktfp8.generate", "a checkpoint lacking the model's other weights",
         lambda c: _generate(c, "--model", str(c.ckpt), "--prompt-ids", "1"), 1,
         "the checkpoint does not fit its config.json:"),
    Case("python -m ktfp8.generate", "a BF16 folder whose config.json gives another vocab_size",
         lambda c: _generate(c, "--model", str(_vocab_changed(c, fp8=False)), "--prompt-ids", "1"), 1,
         "whole_bf16_vocab: cannot load the model: the checkpoint does not fit its config.json: 2 weight(s) of "
         "another shape than config.json gives, e.g. lm_head.weight (16, 16) in the checkpoint"),
    Case("python -m ktfp8.generate", "a BF16 folder whose model.safetensors is cut short",
         lambda c: _generate(c, "--model", str(_whole_bf16(c, "cut_short", lambda f: os.truncate(
             f / "model.safetensors", 1000))), "--prompt-ids", "1"), 1,
         "exceeds the file size 1000 (truncated or not a safetensors file)"),
    Case("python -m ktfp8.generate", "a BF16 folder whose pytorch_model.bin is not a pickle (no safetensors)",
         lambda c: _generate(c, "--model", str(_whole_bf16(c, "garbage_bin", _garbage_bin)), "--prompt-ids", "1"),
         1, "garbage_bin: cannot load the model: pytorch_model.bin is not a valid PyTorch checkpoint (torch.load, "
         "which transformers reads .bin weights with, raised UnpicklingError)"),
    Case("python -m ktfp8.generate", "--prompt text in a folder without a tokenizer",
         lambda c: _generate(c, "--model", str(c.ckpt), "--prompt", "hello"), 2,
         "has no tokenizer: give the prompt as --prompt-ids"),
    Case("python -m ktfp8.generate", "--prompt-ids past config.json's vocab_size",
         lambda c: _generate(c, "--model", str(_with_config(c, "vocab_16", vocab_size=16)), "--prompt-ids", "1,16"),
         2, "--prompt-ids: token id 16 is outside the vocabulary (size 16)"),
    Case("python -m ktfp8.generate", "WORLD_SIZE=x in the environment",
         _with_env("WORLD_SIZE", "x", lambda c: _generate(c, "--model", str(c.ckpt), "--prompt-ids", "1")), 1,
         "cannot start the ranks: WORLD_SIZE='x' is not an integer"),
    Case("python -m ktfp8.generate", "--prompt-ids not integers",
         lambda c: _generate(c, "--model", str(c.ckpt), "--prompt-ids", "1,a"), 2,
         "expected comma-separated token ids"),
    Case("python -m ktfp8.generate", "--max-new-tokens 0",
         lambda c: _generate(c, "--model", str(c.ckpt), "--prompt-ids", "1", "--max-new-tokens", "0"), 2,
         "expected a positive integer, got '0'"),
    Case("python -m ktfp8.generate", "--threads 100000 (torch.set_num_threads would crash)",
         lambda c: _generate(c, "--model", str(c.ckpt), "--prompt-ids", "1", "--threads", "100000"), 2,
         "the thread count must be at most"),
    Case("python -m ktfp8.generate", "both --prompt and --prompt-ids",
         lambda c: _generate(c, "--model", str(c.ckpt), "--prompt", "a", "--prompt-ids", "1"), 2,
         "not allowed with argument"),
    # ---------------------------------------------------------------- layers split over nodes or ranks
    Case("ktfp8.numa.NumaMoE", "experts a tuple of arrays",
         lambda c: numa.NumaMoE(c.cfg, (c.w["gate"], c.w["up"], c.w["down"])), TypeError,
         "experts must be ktfp8.ExpertWeights, got tuple"),
    Case("ktfp8.numa.NumaMoE", "a config whose expert_num differs from the experts'",
         lambda c: numa.NumaMoE(cfg(expert_num=E + 1), c.experts), ValueError,
         "experts hold (expert_num, hidden_size, intermediate_size) = (4, 64, 32), config says (5, 64, 32)"),
    Case("ktfp8.numa.NumaMoE", "called after close()", _closed_numa_moe, RuntimeError,
         "this NumaMoE is closed (close() shut down its node teams)"),
    Case("ktfp8.numa.plan", "nodes a list of (id, cpus) tuples", lambda c: numa.plan(E, [(0, (0,))]), TypeError,
         "nodes[0] must be a ktfp8.numa.NumaNode(id, cpus), got tuple (0, (0,))"),
    Case("ktfp8.numa.plan", "nodes a str", lambda c: numa.plan(E, "0-1"), TypeError,
         "nodes must be a list of ktfp8.numa.NumaNode (e.g. numa.topology()), got str '0-1'"),
    Case("ktfp8.numa.plan", "a node id twice",
         lambda c: numa.plan(E, [numa.NumaNode(0, (0,)), numa.NumaNode(0, (1,))]), ValueError,
         "nodes: node id 0 appears twice"),
    Case("ktfp8.numa.plan", "a CPU in two nodes",
         lambda c: numa.plan(E, [numa.NumaNode(0, (0, 1)), numa.NumaNode(1, (1,))]), ValueError,
         "nodes: CPU 1 is in node 0 and in node 1; a CPU belongs to one node"),
    Case("ktfp8.numa.pin", "cpus [True] (a bool, not CPU 1)", lambda c: _pin_in_thread([True]), TypeError,
         "cpus must hold CPU numbers (ints), got bool True"),
    Case("ktfp8.numa.parse_cpulist", "a range up to CPU 4294967295 (it was expanded: memory ran out)",
         lambda c: numa.parse_cpulist("0-4294967295", "node0/cpulist"), ValueError,
         "node0/cpulist: CPU list '0-4294967295' names CPU 4294967295, above ktfp8.numa.MAX_CPU = 1048575"),
    Case("ktfp8.distributed.ExpertParallelMoE", "KTFP8_DIST_TIMEOUT_S=1e10 (the rendezvous failed at once; 1e11 hung)",
         _with_env("KTFP8_DIST_TIMEOUT_S", "1e10", lambda c: distributed.timeout_seconds()), ValueError,
         "KTFP8_DIST_TIMEOUT_S must be a positive number of seconds, at most 1e+08 (about 3 years), got '1e10'"),
    Case("ktfp8.distributed.ExpertParallelMoE", "a dict as config",
         lambda c: distributed.ExpertParallelMoE({"expert_num": E}, c.experts), TypeError,
         "config must be a ktfp8.MoeConfig, got dict"),
    # ---------------------------------------------------------------- python -m ktfp8.bench
    Case("python -m ktfp8.bench", "--out a folder it cannot write into",
         lambda c: _bench(c, "--no-plot", "--out", "/proc"), 2, "--out: cannot write into '/proc'"),
    Case("python -m ktfp8.bench", "a --layer whose weights cannot fit in memory",
         lambda c: _bench(c, *_SMALL_BENCH, "--layer", "1000000,8,2048,768"), 2,
         "--layer: the weights of 'E=1000000 top-8 H=2048 I=768' take"),
    Case("python -m ktfp8.bench", "a --layer size past 2**63 (an OverflowError traceback)",
         lambda c: _bench(c, *_SMALL_BENCH, "--layer", "99999999999999999999,2,64,32"), 2,
         "sizes must be positive and at most 2147483647, and top_k <= E"),
    Case("python -m ktfp8.bench", "--tokens whose activations cannot fit in memory",
         lambda c: _bench(c, *_SMALL_BENCH, "--layer", "4,2,64,32", "--tokens", "999999999"), 2,
         "--tokens: the activations of a call of T=999999999"),
    Case("python -m ktfp8.bench", "--threads above 16 per CPU (the run started, then a traceback)",
         lambda c: _bench(c, *_SMALL_BENCH, "--layer", "4,2,64,32", "--tokens", "1", "--threads", "100000"), 2,
         "--threads must be at most"),
    Case("python -m ktfp8.bench", "KTFP8_BACKEND=junk in the environment",
         _with_env("KTFP8_BACKEND", "junk", lambda c: _bench(c, *_SMALL_BENCH, "--layer", "4,2,64,32")), 2,
         "KTFP8_BACKEND='junk' is not compiled in this build; usable backends:"),
    Case("python -m ktfp8.bench.model", "--layers 49", lambda c: _bench_model(c, "--layers", "49"), 2,
         "--layers: Qwen3-30B-A3B has 48 layers, got 49"),
    Case("python -m ktfp8.bench.model", "--json in a folder that does not exist",
         lambda c: _bench_model(c, "--layers", "1", "--json", str(c.tmp / "absent" / "r.json")), 2,
         "absent' does not exist"),
    Case("python -m ktfp8.bench.model", "KTFP8_BACKEND=junk in the environment (found after the model was built)",
         _with_env("KTFP8_BACKEND", "junk", lambda c: _bench_model(c, "--layers", "1", "--sides", "ktfp8")), 2,
         "KTFP8_BACKEND='junk' is not compiled in this build; usable backends:"),
    Case("python -m ktfp8.bench.model", "--json '' (was taken for no --json: no file, no word)",
         lambda c: _bench_model(c, "--layers", "1", "--json", ""), 2, "--json: an empty path; name the file to write"),
    Case("python -m ktfp8.bench.model", "--json in a folder it cannot write into",
         lambda c: _bench_model(c, "--layers", "1", "--json", "/proc/r.json"), 2,
         "--json: cannot write into '/proc'"),
]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return Ctx(tmp_path_factory.mktemp("bad_inputs"))


# entry points above the core, which need torch and transformers: skipped where they are not installed
TORCH_ENTRIES = ("ktfp8.hf.", "experts_implementation=", "python -m ktfp8.generate", "python -m ktfp8.bench.model")


@pytest.mark.parametrize("case", CASES, ids=[f"{c.entry}: {c.bad}" for c in CASES])
def test_bad_input(case, ctx, capsys, monkeypatch):
    if case.entry.startswith(TORCH_ENTRIES):
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    for var in ("KTFP8_BACKEND", "KTFP8_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    run = (lambda c: case.run(c, monkeypatch)) if getattr(case.run, "needs_env", False) else case.run
    capsys.readouterr()
    if isinstance(case.expect, int):            # a command-line tool: exit status and stderr
        try:
            status = run(ctx)
        except SystemExit as e:                 # argparse exits 2 on a usage error
            status = e.code
        assert status == case.expect
        assert case.message in capsys.readouterr().err
    else:
        with pytest.raises(case.expect, match=re.escape(case.message)):
            run(ctx)


def test_catalogue_is_large_and_covers_every_entry_point():
    entries = {c.entry for c in CASES}
    assert len(CASES) >= 40
    for wanted in ("MoeConfig", "QuantConfig", "MoeConfig.from_hf_config", "route", "fp8.encode", "fp8.decode",
                   "fp8.quantize", "fp8.dequantize", "quantize_experts", "ExpertWeights", "MoE", "MoE.__call__",
                   "MoE.forward", "moe_forward", "FP8SafeTensorLoader", "python -m ktfp8.convert",
                   "python -m ktfp8.cpu", "ktfp8.hf.from_pretrained", "ktfp8.hf.prepare",
                   "python -m ktfp8.generate", "ktfp8.numa.NumaMoE", "ktfp8.distributed.ExpertParallelMoE",
                   "python -m ktfp8.bench", "python -m ktfp8.bench.model"):
        assert wanted in entries, wanted


def render_table():
    """The README "Errors" section."""
    def outcome(c):
        if isinstance(c.expect, int):
            return f"exit status {c.expect}"
        return c.expect.__name__
    lines = ["## Errors", "",
             "Every public entry point checks its input and answers a bad one with an exception that names "
             "the argument (command-line tools: a message on stderr and exit status 2 for a usage error, 1 for "
             "a refused or failed run); nothing crashes, nothing is half-written. The table is the catalogue "
             f"of bad inputs the test suite tries, one test each ({len(CASES)} cases, "
             "`tests/test_bad_inputs.py`). `SafetensorsError` is a `ValueError`.", "",
             "| Entry point | Bad input | Raises | Message contains |", "|---|---|---|---|"]
    for c in CASES:
        message = c.message.replace("|", "\\|")
        lines.append(f"| `{c.entry}` | {c.bad} | `{outcome(c)}` | {message} |")
    return "\n".join(lines) + "\n"


def test_readme_table_is_current():
    """README.md (once merged) or docs-errors-snippet.md holds exactly render_table()."""
    table = render_table()
    sources = [p for p in (REPO / "README.md", REPO / "docs-errors-snippet.md") if p.exists()]
    assert any(table in p.read_text() for p in sources), \
        "the Errors table is stale: PYTHONPATH=. python tests/test_bad_inputs.py prints the current one"


if __name__ == "__main__":
    sys.stdout.write(render_table())
