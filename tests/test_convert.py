"""python -m ktfp8.convert: output layout (shards, index, config.json for other engines, copied files),
determinism, --verify, and every safety rule (input untouched, output refused / replaced, malformed
inputs, interrupted runs)."""
import concurrent.futures
import fcntl
import json
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from hf_models import (EXPERTS, HIDDEN, MODELS, MOE_INTER, build_model, expert_name, folder_digest, fuse_experts,
                       moe_layers, save_model)
from ktfp8 import convert as convert_module
from ktfp8 import fp8
from ktfp8.convert import main as convert
from ktfp8.loader import FP8SafeTensorLoader
from ktfp8.safetensors_io import SafetensorsError, SafetensorsFile, write_file

REPO = Path(__file__).resolve().parents[1]
PER_CHANNEL = '{"method":"FP8","per_channel":true}'


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen3-MoE bf16 checkpoint (sharded) with tokenizer-like extra files, and its model."""
    root = tmp_path_factory.mktemp("qwen")
    model = build_model("qwen3_moe")
    folder = save_model(model, root / "bf16", max_shard_size="100KB")
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("kept as is\n")
    (folder / "pytorch_model.bin").write_bytes(b"stale weights")
    return folder


def run(src, dst, *extra, input_type="bf16"):
    return convert(["--input-type", input_type, "--input-path", str(src), "--output-path", str(dst), *extra])


def _tensors(folder):
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with SafetensorsFile(path) as f:
            for name in f.tensors:
                out[name] = (f.info(name).dtype, f.read_rows(name).tobytes())
    return out


def test_output_layout_and_copied_files(qwen, tmp_path, capsys):
    out = tmp_path / "fp8"
    assert run(qwen, out, "--max-shard-size", "150KB", "--threads", "2") == 0
    files = sorted(p.name for p in out.iterdir())
    assert "pytorch_model.bin" not in files and not any(f.startswith(".") for f in files)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (qwen / name).read_bytes()
    assert (out / "extra" / "notes.txt").read_text() == "kept as is\n"
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in shards:
        with SafetensorsFile(shard) as f:
            data = sum(t.nbytes for t in f.tensors.values())
            assert data <= 150_000 or len(f.tensors) == 1, shard.name
            assert f.metadata == {"format": "pt"}
            assert all(index["weight_map"][n] == shard.name for n in f.tensors)
    written = _tensors(out)
    assert set(index["weight_map"]) == set(written)
    assert index["metadata"]["total_size"] == sum(len(b) for _, b in written.values())
    original = _tensors(qwen)
    for name, (dtype, raw) in original.items():
        if ".experts." in name:
            assert written[name][0] == "F8_E4M3" and name + "_scale" in written
        else:
            assert written[name] == (dtype, raw), name         # copied byte for byte
    assert len(written) == len(original) + sum(".experts." in n for n in original)


def test_config_is_read_by_compressed_tensors(qwen, tmp_path):
    ct = pytest.importorskip("compressed_tensors")
    out = tmp_path / "fp8"
    assert run(qwen, out) == 0
    config = json.loads((out / "config.json").read_text())
    original = json.loads((qwen / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == original
    q = ct.QuantizationConfig.model_validate(config["quantization_config"])
    assert q.quant_method == "compressed-tensors" and q.format == "float-quantized"
    weights = q.config_groups["group_0"].weights
    assert (weights.num_bits, weights.type, weights.strategy, weights.symmetric, weights.dynamic) == \
        (8, "float", "channel", True, False)
    assert q.config_groups["group_0"].input_activations is None
    assert q.config_groups["group_0"].targets == ["Linear"]
    linears = {n[:-7] for n, (_, shape) in _shapes(qwen).items() if n.endswith(".weight") and len(shape) == 2
               and "embed" not in n}
    experts = {n for n in linears if ".experts." in n}
    assert set(q.ignore) == linears - experts          # every Linear but the experts is left as is
    assert "lm_head" in q.ignore and "model.layers.0.mlp.gate" in q.ignore


def test_all_linear(qwen, tmp_path):
    ct = pytest.importorskip("compressed_tensors")
    out = tmp_path / "fp8"
    assert run(qwen, out, "--all-linear") == 0
    q = ct.QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())
                                             ["quantization_config"])
    assert sorted(q.ignore) == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    written = _tensors(out)
    assert written["model.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"
    assert written["model.layers.0.self_attn.q_proj.weight_scale"][0] == "F32"
    assert written["model.embed_tokens.weight"][0] == "BF16" and written["lm_head.weight"][0] == "BF16"
    assert "model.layers.0.input_layernorm.weight_scale" not in written


def test_all_linear_keeps_hunyuans_router(tmp_path):
    """Hunyuan-A13B's router is the Linear `wg` inside `mlp.gate`: --all-linear quantized it."""
    src = save_model(build_model("hunyuan_v1_moe"), tmp_path / "hunyuan")
    routers = [n for n in _tensors(src) if n.endswith(".mlp.gate.wg.weight")]
    assert routers
    assert run(src, tmp_path / "out", "--all-linear") == 0
    written = _tensors(tmp_path / "out")
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    for name in routers:
        assert written[name][0] == "BF16" and name + "_scale" not in written and name[:-len(".weight")] in ignore
    assert written["model.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"


def test_block_wise_config(qwen, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "blk"
    assert run(qwen, out, "--quant-config", '{"method":"FP8","per_channel":false,"group_size":64}') == 0
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == \
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}
    parsed = transformers.FineGrainedFP8Config.from_dict(dict(q))
    assert list(parsed.weight_block_size) == [64, 64]
    assert "lm_head" in parsed.modules_to_not_convert
    with SafetensorsFile(next(out.glob("*.safetensors"))) as f:
        assert f.info("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv").shape == (2, 3)  # 96x160
    assert FP8SafeTensorLoader(out).load_experts(0).block == (64, 64)


@pytest.mark.parametrize("given, spec", [('{"group_size": 64}', (False, (64, 64))),
                                          ('{"group_size": 0}', (True, None)),
                                          ('{"per_channel": false}', (False, (128, 128))),
                                          ('{}', (True, None))])
def test_quant_config_key_left_out_follows_the_one_given_as_in_quant_config(given, spec):
    """--quant-config '{"group_size": 64}' was refused ("per_channel needs group_size 0": per_channel
    defaulted to true), where ktfp8.QuantConfig(group_size=64), which the README describes, is block-wise."""
    from ktfp8 import QuantConfig
    from ktfp8.convert_args import parse_quant_config
    got = parse_quant_config(given)
    assert (got.per_channel, got.block) == spec
    fields = json.loads(given)
    expected = QuantConfig(**fields)
    assert got.per_channel == expected.per_channel and (got.block or (0, 0))[0] == expected.group_size


def _shapes(folder):
    out = {}
    for path in Path(folder).glob("*.safetensors"):
        with SafetensorsFile(path) as f:
            out.update({n: (t.dtype, t.shape) for n, t in f.tensors.items()})
    return out


def test_threads_do_not_change_the_output(qwen, tmp_path):
    assert run(qwen, tmp_path / "t1", "--threads", "1") == 0
    assert run(qwen, tmp_path / "t2", "--threads", "2") == 0
    a, b = folder_digest(tmp_path / "t1"), folder_digest(tmp_path / "t2")
    assert {k: v[0] for k, v in a.items()} == {k: v[0] for k, v in b.items()}


def test_threads_help_names_every_default():
    """--threads left out is backends.default_threads(None): KTFP8_NUM_THREADS, OMP_NUM_THREADS, all cores."""
    from ktfp8.convert import build_parser
    threads = next(a for a in build_parser()._actions if "--threads" in a.option_strings)
    assert threads.default is None
    assert re.search(r"KTFP8_NUM_THREADS.*OMP_NUM_THREADS.*all cores", threads.help)


def test_verify_reports_sqnr(qwen, tmp_path, capsys):
    assert run(qwen, tmp_path / "v", "--verify") == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith("SQNR")]
    assert len(lines) == 2 * 3 * 4                      # 2 layers x 3 projections x 4 experts
    values = [float(l.split()[1]) for l in lines]
    assert all(28 < v < 40 for v in values)
    assert "worst 10 of 24 quantized tensors:" in out and "0 differ" in out
    assert run(qwen, tmp_path / "v2", "--verify", "--verify-min-sqnr", "60") == 1
    assert not (tmp_path / "v2").exists()
    assert "verification failed: 24 tensor(s) below 60.0 dB" in capsys.readouterr().err
    # a threshold alone asks for the check too (it was ignored, and the output written unchecked)
    assert run(qwen, tmp_path / "v3", "--verify-min-sqnr", "60") == 1
    assert not (tmp_path / "v3").exists()
    assert "verification failed: 24 tensor(s) below 60.0 dB" in capsys.readouterr().err


@pytest.mark.parametrize("stdout", ["closed", "/dev/full"])
def test_a_verify_report_it_cannot_print_fails_the_run(qwen, tmp_path, capsys, monkeypatch, stdout):
    """The report is what --verify is for: a closed stdout (`>&-`) used to drop it without a word (print() to
    None) and publish the output; a full disk was an OSError logged as if the conversion had failed."""
    if stdout == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    full = open(stdout, "w") if stdout != "closed" else None
    monkeypatch.setattr(sys, "stdout", full)
    try:
        assert run(qwen, tmp_path / "v", "--verify") == 1
    finally:
        if full is not None:
            full.close()
    err = capsys.readouterr().err
    reason = "it is closed" if full is None else "No space left on device"
    assert f"ktfp8-convert: error: cannot write to standard output: {reason}\n" in err
    assert f"nothing was written to {tmp_path / 'v'}" in err
    assert not (tmp_path / "v").exists() and list(tmp_path.iterdir()) == []


def test_input_is_never_modified(qwen, tmp_path):
    before = folder_digest(qwen)
    assert run(qwen, tmp_path / "a", "--verify", "--all-linear") == 0
    assert folder_digest(qwen) == before
    for bad_out in (qwen, qwen / "inside"):
        assert run(qwen, bad_out, "--overwrite") == 1
    assert run(qwen.parent, tmp_path / "b", "--overwrite") == 1       # input contains no checkpoint
    assert folder_digest(qwen) == before


def test_output_folder_rules(qwen, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run(qwen, out) == 1
    assert "not empty; pass --overwrite" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["keep.txt"]
    assert run(qwen, out, "--overwrite") == 1        # not a model folder: --overwrite would delete all in it
    assert "holds no config.json or *.safetensors: it is no model folder" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["keep.txt"]
    (out / "config.json").write_text("{}")          # an earlier output: replaced as a whole
    assert run(qwen, out, "--overwrite") == 0
    assert not (out / "keep.txt").exists() and json.loads((out / "config.json").read_text())
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(qwen, empty) == 0 and (empty / "config.json").exists()
    (tmp_path / "file").write_text("x")
    assert run(qwen, tmp_path / "file", "--overwrite") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "out"]   # no temp folders left


@pytest.mark.parametrize("after_rename", [1, 2])
def test_overwrite_interrupted_within_the_swap(qwen, tmp_path, capsys, monkeypatch, after_rename):
    """A Ctrl-C right after the first of --overwrite's two renames (the old output moved aside) puts the
    old output back; right after the second (the new one in place) the run says so.  Before, the first
    lost both outputs and the second said "nothing was written" (a helper's review)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"previous": "output"}')
    import ktfp8.convert as module
    real, calls = os.rename, []

    def rename(a, b):
        calls.append((a, b))
        real(a, b)
        if len(calls) == after_rename:
            raise KeyboardInterrupt
    monkeypatch.setattr(module.os, "rename", rename)
    assert run(qwen, out, "--overwrite") == 130
    monkeypatch.undo()
    err = capsys.readouterr().err
    if after_rename == 1:
        assert json.loads((out / "config.json").read_text()) == {"previous": "output"}
        assert sorted(os.listdir(out)) == ["config.json"] and "nothing was written" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    else:
        assert "previous" not in json.loads((out / "config.json").read_text())
        assert "was written in full and put in place" in err
        aside, = tmp_path.glob(f".out{module.REPLACED_TAG}{os.getpid()}")    # removed by a later run
        aside.rename(tmp_path / f".out{module.REPLACED_TAG}{_dead_pid()}")  # (this process lives on)
        assert run(qwen, out, "--overwrite") == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_through_a_symlink_replaces_the_folder_it_points_to(qwen, tmp_path):
    """The link stays and shows the new checkpoint; the folder's old files are gone, and no moved-aside
    copy or temporary folder is left next to the link or the folder."""
    target, link = tmp_path / "data" / "model", tmp_path / "links" / "model"
    target.mkdir(parents=True)
    (target / "old.txt").write_text("previous output")
    (target / "model.safetensors").write_bytes(b"")         # a model folder: --overwrite replaces it
    link.parent.mkdir()
    link.symlink_to(target)
    assert run(qwen, link) == 1                                   # not empty, no --overwrite
    assert run(qwen, link, "--overwrite") == 0
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert (target / "config.json").exists() and not (target / "old.txt").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]
    assert sorted(p.name for p in link.parent.iterdir()) == ["model"]
    empty_target, empty_link = tmp_path / "data" / "empty", tmp_path / "links" / "empty"
    empty_target.mkdir()
    empty_link.symlink_to(empty_target)
    assert run(qwen, empty_link) == 0 and (empty_link / "config.json").exists()
    assert _tensors(empty_target) == _tensors(target)


def test_output_containing_the_working_directory_is_refused_up_front(qwen, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    for cwd, given in ((out, "."), (out / "sub", "..")):
        monkeypatch.chdir(cwd)
        assert run(qwen, given) == 1
        assert "is (or contains) the current directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and os.listdir(out) == ["sub"]


def test_output_filled_by_another_run_meanwhile_is_not_replaced(qwen, tmp_path, monkeypatch, capsys):
    import ktfp8.convert as convert_module
    out = tmp_path / "out"
    copy_other_files = convert_module._copy_other_files

    def and_another_run_writes(files, tmp):  # lands in `out` between the check and the rename
        copy_other_files(files, tmp)
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(convert_module, "_copy_other_files", and_another_run_writes)
    assert run(qwen, out) == 1
    assert "was filled while converting" in capsys.readouterr().err
    assert os.listdir(out) == ["config.json"] and (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_never_replaces_a_folder_of_other_files_filled_meanwhile(qwen, tmp_path, monkeypatch, capsys):
    import ktfp8.convert as convert_module
    out = tmp_path / "out"
    copy_other_files = convert_module._copy_other_files

    def and_someone_writes(files, tmp):
        copy_other_files(files, tmp)
        out.mkdir()
        (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(convert_module, "_copy_other_files", and_someone_writes)
    assert run(qwen, out, "--overwrite") == 1
    assert "it is no model folder, and --overwrite would delete everything in it" in capsys.readouterr().err
    assert os.listdir(out) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("bad, message", [
    ("{nope", "not valid JSON"),
    ('["FP8"]', "must be a JSON object"),
    ('{"method":"INT4"}', "method must be"),
    ('{"per_channel":"yes"}', "per_channel must be true or false"),
    ('{"per_channel":true,"group_size":128}', "per_channel needs group_size 0"),
    ('{"per_channel":false,"group_size":0}', "needs group_size > 0"),
    ('{"per_channel":false,"group_size":15}', "group_size must be even, got 15"),  # no MoE could run it
    ('{"method":"FP8","bits":8}', "unknown keys"),
    # json.loads keeps the last of two values: per-channel asked for first, block-wise written
    ('{"method":"FP8","per_channel":true,"per_channel":false}', "argument --quant-config: duplicate key 'per_channel'"),
    ('{"per_channel":false,"group_size":2147483648}',          # failed later, after the plan was logged
     "argument --quant-config: group_size must be at most 2147483647 (the kernels' block edges are 32-bit), "
     "got 2147483648"),
])
def test_malformed_quant_config(qwen, tmp_path, capsys, bad, message):
    with pytest.raises(SystemExit) as exit_info:
        run(qwen, tmp_path / "o", "--quant-config", bad)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["--max-shard-size", "5XB"], "is not like 5GB"),
    (["--threads", "0"], "positive integer"),
    (["--verify", "--verify-min-sqnr", "nan"], "finite number of decibels"),  # else every tensor fails, late
    (["--verify-min-sqnr", "20dB"], "finite number of decibels"),
    (["--input-type", "int8"], "invalid choice"),
])
def test_bad_options(qwen, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        convert(["--input-type", "bf16", "--input-path", str(qwen), "--output-path", str(tmp_path / "o"), *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


def _expect_error(src, tmp_path, capsys, message, input_type="bf16"):
    assert run(src, tmp_path / "o", input_type=input_type) == 1
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".o")] == []


def test_missing_and_truncated_files(qwen, tmp_path, capsys):
    index = json.loads((qwen / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    missing = _copy_folder(qwen, tmp_path / "missing")
    (missing / shard).unlink()
    _expect_error(missing, tmp_path, capsys, f"{shard}: shard listed in model.safetensors.index.json is missing")

    truncated = _copy_folder(qwen, tmp_path / "truncated")
    raw = (truncated / shard).read_bytes()
    (truncated / shard).write_bytes(raw[:-100])
    _expect_error(truncated, tmp_path, capsys, "truncated")

    bad_header = _copy_folder(qwen, tmp_path / "header")
    (bad_header / shard).write_bytes(raw[:8] + b"!" + raw[9:])
    _expect_error(bad_header, tmp_path, capsys, "header is not valid JSON")

    no_tensor = _copy_folder(qwen, tmp_path / "no_tensor")
    victim = next(n for n, f in index["weight_map"].items() if f == shard)
    index["weight_map"]["model.layers.1.mlp.experts.9.up_proj.weight"] = shard
    (no_tensor / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_error(no_tensor, tmp_path, capsys, "'model.layers.1.mlp.experts.9.up_proj.weight' is missing from "
                  "this shard")
    assert victim

    nothing = tmp_path / "nothing"
    nothing.mkdir()
    _expect_error(nothing, tmp_path, capsys, "no model.safetensors.index.json and no .safetensors files")
    _expect_error(tmp_path / "absent", tmp_path, capsys, "does not exist")


def test_unsupported_and_unexpected_dtypes(qwen, tmp_path, capsys):
    _expect_error(qwen, tmp_path, capsys, "is BF16, but --input-type fp32 expects F32", input_type="fp32")
    _expect_error(qwen, tmp_path, capsys, "--input-type fp8, but no F8_E4M3 weights", input_type="fp8")
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    raw = np.zeros((4, 8), np.uint8)
    write_file(folder / "model.safetensors", {"model.layers.0.mlp.experts.0.gate_proj.weight": ("U8", raw)})
    _expect_error(folder, tmp_path, capsys, "is U8, but --input-type bf16 expects BF16")
    header = json.dumps({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    _expect_error(folder, tmp_path, capsys, "unsupported dtype 'F4'")
    fp8 = {"model.layers.0.mlp.experts.0.gate_proj.weight": ("F8_E4M3", np.zeros((4, 8), np.uint8)),
           "model.layers.0.mlp.experts.0.gate_proj.weight_scale": ("F32", np.ones((4, 1), np.float32))}
    write_file(folder / "model.safetensors", fp8)
    _expect_error(folder, tmp_path, capsys, "already F8_E4M3; use --input-type fp8")
    _expect_error(folder, tmp_path, capsys, "a weight_scale (per-channel or per-tensor: ktfp8 loads it as it is)",
                  input_type="fp8")
    no_experts = {"model.layers.0.self_attn.q_proj.weight": ("BF16", np.zeros((4, 8), ml_dtypes.bfloat16))}
    write_file(folder / "model.safetensors", no_experts)
    _expect_error(folder, tmp_path, capsys, "found no weights to quantize")


@pytest.fixture(scope="module")
def big_input(tmp_path_factory):
    """~200 MB of bf16 experts: a conversion that takes long enough to be interrupted."""
    folder = tmp_path_factory.mktemp("big") / "in"
    folder.mkdir()
    rng = np.random.default_rng(0)
    block = rng.standard_normal((1024, 2048), dtype=np.float32).astype(ml_dtypes.bfloat16)
    shapes = {"gate": block, "up": block, "down": block.reshape(2048, 1024)}
    tensors = {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": ("BF16", shapes[p])
               for e in range(16) for p in ("gate", "up", "down")}
    write_file(folder / "model.safetensors", tensors, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 16}))
    return folder


def _start(src, dst, preexec=None, **kwargs):
    cmd = [sys.executable, "-m", "ktfp8.convert", "--input-type", "bf16", "--input-path", str(src),
           "--output-path", str(dst), "--threads", "1"]

    def child_setup():
        # SIGINT as a terminal delivers it: a test run started as a shell's background job (bash
        # starts those with SIGINT ignored) passed SIG_IGN on, and the converter ran to the end
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if preexec:
            preexec()

    return subprocess.Popen(cmd, cwd=REPO, preexec_fn=child_setup, **kwargs)


def _wait_for_partial_shard(proc, parent, name):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        shards = list(parent.glob(f".{name}.ktfp8-partial-*/*.safetensors"))
        if shards and shards[0].stat().st_size > 10_000_000:
            return
        assert proc.poll() is None, "the conversion ended before it could be interrupted"
        time.sleep(0.005)
    pytest.fail("no partial output appeared")


def test_killed_conversion_leaves_nothing_that_looks_finished(big_input, tmp_path):
    dst = tmp_path / "out"
    proc = _start(big_input, dst, stderr=subprocess.DEVNULL)
    _wait_for_partial_shard(proc, tmp_path, "out")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dst.exists()
    leftovers = list(tmp_path.glob(".out.ktfp8-partial-*"))
    assert len(leftovers) == 1
    assert not (leftovers[0] / "config.json").exists() and (leftovers[0] / "KTFP8_CONVERSION_IN_PROGRESS").exists()
    # the next run cleans up after the dead one and finishes
    assert run(big_input, dst, "--threads", "2") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert FP8SafeTensorLoader(dst).load_experts(0).expert_num == 16


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("marker", [True, False], ids=["marked", "unmarked"])
def test_next_run_removes_a_dead_runs_partial_folder(qwen, tmp_path, marker):
    """A run killed between creating its folder and writing the in-progress marker (or between
    removing it and publishing) leaves a hidden folder without the marker: gone after the next run,
    as a marked one is.  A live run's folder stays."""
    dst = tmp_path / "out"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead, live = (tmp_path / f".out.ktfp8-partial-{pid}" for pid in (_dead_pid(), alive.pid))
        for folder in (dead, live):
            folder.mkdir()
            (folder / "model-00001-of-00002.safetensors").write_bytes(b"half a shard")
            if marker:
                (folder / "KTFP8_CONVERSION_IN_PROGRESS").write_text("in progress\n")
        assert run(qwen, dst) == 0
    finally:
        alive.kill()
        alive.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])


def test_an_output_name_with_glob_characters_removes_only_its_own_leftovers(qwen, tmp_path):
    """'out[1]' as a glob pattern matched '.out1...' (another output's folder) and not its own."""
    own, other = (tmp_path / f".{name}.ktfp8-partial-{_dead_pid()}" for name in ("out[1]", "out1"))
    for folder in (own, other):
        folder.mkdir()
    assert run(qwen, tmp_path / "out[1]") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out[1]", other.name])


def test_a_mount_point_as_the_output_is_refused_before_any_work(qwen, tmp_path, monkeypatch, capsys):
    """A volume (docker -v host:/out) cannot be removed or renamed: the run converted everything and
    then failed with 'Device or resource busy'.  Refused by name, first."""
    out = tmp_path / "volume"
    out.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == os.fspath(out))
    assert run(qwen, out) == 1
    err = capsys.readouterr().err
    assert f"output {out} is a mount point" in err and f"give a folder inside it (e.g. {out / qwen.name})" in err
    assert "wrote" not in err and list(out.iterdir()) == [] and not list(tmp_path.glob(".volume.*"))


def test_tensors_the_index_does_not_list_are_converted_too(qwen, tmp_path):
    """transformers loads every tensor of each shard the index names; the converter went by the index
    alone and dropped model.norm.weight when the index left it out."""
    src = tmp_path / "in"
    shutil.copytree(qwen, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert run(src, tmp_path / "out") == 0
    assert _tensors(tmp_path / "out")["model.norm.weight"] == _tensors(qwen)["model.norm.weight"]


def test_a_tied_output_head_is_listed_as_left_unquantized(tmp_path):
    """With tie_word_embeddings there is no lm_head tensor, so lm_head was missing from `ignore`, and
    transformers' compressed-tensors loader quantized the head without a scale: garbage logits."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    torch = pytest.importorskip("torch")
    model = build_model("qwen3_moe", tie_word_embeddings=True)
    src = save_model(model, tmp_path / "tied")
    assert "lm_head.weight" not in _tensors(src)
    assert run(src, tmp_path / "out") == 0
    assert "lm_head" in json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.inference_mode():
        want, got = model.float()(ids).logits, loaded(ids).logits
    assert torch.isfinite(got).all() and float((got - want).norm() / want.norm()) < 0.1


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])   # 128 + the signal
def test_interrupted_conversion_cleans_up(big_input, tmp_path, sig, code):
    dst = tmp_path / "out"
    proc = _start(big_input, dst, stderr=subprocess.PIPE, text=True)
    _wait_for_partial_shard(proc, tmp_path, "out")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "interrupted" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig, raised", [(signal.SIGINT, KeyboardInterrupt),
                                         (signal.SIGTERM, convert_module._Terminated)])
def test_a_signal_while_waiting_for_the_workers_is_raised_when_the_wait_returns(sig, raised):
    """Raised inside threading.Condition.wait, the interrupt could leave its lock released and end in
    "RuntimeError: release unlocked lock" (CPython issue 118433; once in CI, status 1 and a traceback
    instead of 143): the gate holds it and raises it within a poll, long before the work is done."""
    gate = convert_module._SignalGate()
    previous = signal.signal(sig, gate.handler)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            release = threading.Event()
            slow = pool.submit(release.wait, 30)
            threading.Timer(0.2, os.kill, (os.getpid(), sig)).start()
            started = time.monotonic()
            with pytest.raises(raised) as caught:
                gate.wait({slow})
            assert time.monotonic() - started < 0.2 + 5 * gate.POLL_S and not slow.done()
            assert type(caught.value) is raised and gate.held is None and not gate.waiting
            release.set()
        with pytest.raises(raised):    # outside the wait, at once
            gate.handler(sig, None)
    finally:
        signal.signal(sig, previous)


def test_progress_bar_on_a_terminal(qwen, tmp_path):
    pytest.importorskip("tqdm")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a 100-column terminal
    proc = subprocess.Popen([sys.executable, "-m", "ktfp8.convert", "--input-type", "bf16", "--input-path",
                             str(qwen), "--output-path", str(tmp_path / "o")], cwd=REPO, stderr=slave,
                            stdout=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait() == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "converting: 100%|" in text


def test_console_entry_point(qwen, tmp_path):
    tomllib = pytest.importorskip("tomllib")          # Python 3.11 on
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ktfp8-convert"] == "ktfp8.convert:main"
    proc = subprocess.run([sys.executable, "-m", "ktfp8.convert", "--input-bf16-hf-path", str(qwen),
                           "--output-fp8-hf-path", str(tmp_path / "o"), "--input-type", "bf16"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert FP8SafeTensorLoader(tmp_path / "o").format == "fp8_per_channel"


def test_many_shards_with_few_file_descriptors(qwen, tmp_path):
    """Shards are opened one after another, so a checkpoint of more shards than the process may hold
    file descriptors still converts."""
    import resource

    def limit_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "-m", "ktfp8.convert", "--input-type", "bf16", "--input-path",
                           str(qwen), "--output-path", str(out), "--max-shard-size", "1KB"],
                          cwd=REPO, capture_output=True, text=True, preexec_fn=limit_fds)
    assert proc.returncode == 0, proc.stderr
    assert len(list(out.glob("model-*.safetensors"))) > 48
    assert FP8SafeTensorLoader(out).format == "fp8_per_channel"


def test_write_failure_leaves_nothing(big_input, tmp_path):
    """A write that fails mid-run (here: a file size limit, as a full disk would) stops the run with
    an error and removes the partial output."""
    import resource

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)        # EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000_000, 20_000_000))

    dst = tmp_path / "out"
    proc = _start(big_input, dst, preexec=limit_file_size, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "error: [Errno 27] File too large" in err
    assert list(tmp_path.iterdir()) == []


# -- routed experts no engine can load: refused before anything is written ---------------------------
INTER_KEY = {"mixtral": "intermediate_size"}      # the others: moe_intermediate_size


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> a single-file bf16 checkpoint of each tiny model of hf_models.MODELS."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: save_model(build_model(kind), root / kind) for kind in MODELS}


def _edited(src, dst, tensors=lambda t: None, config=lambda c: None):
    """A copy of the single-file checkpoint `src` whose {name: (dtype, array)} and config.json dict are
    edited in place by `tensors` and `config`."""
    dst.mkdir()
    with SafetensorsFile(src / "model.safetensors") as f:
        stored = {n: (f.info(n).dtype, f.read_rows(n)) for n in f.tensors}
    tensors(stored)
    write_file(dst / "model.safetensors", stored, metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _expert_count(folder):
    """(config.json key, value) of the expert count."""
    cfg = json.loads((folder / "config.json").read_text())
    return next((k, cfg[k]) for k in ("num_experts", "n_routed_experts", "num_local_experts") if cfg.get(k))


def _bf16(shape):
    return "BF16", np.ones(shape, ml_dtypes.bfloat16)


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("role, shape", [("gate", (MOE_INTER + 8, HIDDEN)), ("up", (MOE_INTER, HIDDEN - 32)),
                                         ("down", (MOE_INTER, HIDDEN))])        # down transposed
def test_expert_of_another_shape_than_config_json_is_refused(tiny, tmp_path, capsys, kind, role, shape):
    name = expert_name(kind, moe_layers(kind)[-1], 1, role)
    src = _edited(tiny[kind], tmp_path / "in", lambda t: t.update({name: _bf16(shape)}))
    inter = f"{INTER_KEY.get(kind, 'moe_intermediate_size')} {MOE_INTER}"
    expected = f"[hidden, intermediate] = [{HIDDEN}, {MOE_INTER}] (config.json: hidden_size {HIDDEN}, {inter})" \
        if role == "down" else \
        f"[intermediate, hidden] = [{MOE_INTER}, {HIDDEN}] (config.json: {inter}, hidden_size {HIDDEN})"
    _expect_error(src, tmp_path, capsys, f"tensor {name!r} has shape {list(shape)}; expected {expected}")


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_experts_all_of_another_size_than_config_json_are_refused(tiny, tmp_path, capsys, kind):
    """Consistent among themselves, but not the model config.json describes (the loader's MoeConfig)."""
    layer = moe_layers(kind)[-1]
    count = _expert_count(tiny[kind])[1]

    def wider(t):
        for e in range(count):
            t.update({expert_name(kind, layer, e, "gate"): _bf16((MOE_INTER + 8, HIDDEN)),
                      expert_name(kind, layer, e, "up"): _bf16((MOE_INTER + 8, HIDDEN)),
                      expert_name(kind, layer, e, "down"): _bf16((HIDDEN, MOE_INTER + 8))})

    _expect_error(_edited(tiny[kind], tmp_path / "in", wider), tmp_path, capsys,
                  f"tensor {expert_name(kind, layer, 0, 'gate')!r} has shape [{MOE_INTER + 8}, {HIDDEN}]; "
                  f"expected [intermediate, hidden] = [{MOE_INTER}, {HIDDEN}]")


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_expert_missing_a_projection_or_whole_is_refused(tiny, tmp_path, capsys, kind):
    layer = moe_layers(kind)[-1]
    key, count = _expert_count(tiny[kind])
    up = expert_name(kind, layer, 2, "up")
    src = _edited(tiny[kind], tmp_path / "no_up", lambda t: t.pop(up))
    _expect_error(src, tmp_path, capsys, f"expert tensor {up!r} is missing: {up.rsplit('.', 3)[0]} needs experts "
                  f"0-{count - 1} (config.json: {key} {count}), each with gate, up and down weights")
    last = [expert_name(kind, layer, count - 1, role) for role in ("gate", "up", "down")]
    src = _edited(tiny[kind], tmp_path / "fewer", lambda t: [t.pop(n) for n in last])
    _expect_error(src, tmp_path, capsys, f"expert tensor {last[0]!r} is missing")


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_a_projection_named_twice_is_refused(tiny, tmp_path, capsys, kind):
    """gate_proj and w1 (Mixtral's name) for one expert: one of them would silently win."""
    layer = moe_layers(kind)[-1]
    gate = expert_name(kind, layer, 1, "gate")
    twin = gate.replace(".gate_proj.", ".w1.") if ".gate_proj." in gate else gate.replace(".w1.", ".gate_proj.")
    src = _edited(tiny[kind], tmp_path / "in", lambda t: t.update({twin: t[gate]}))
    first, second = sorted([gate, twin])
    _expect_error(src, tmp_path, capsys, f"tensors {first!r} and {second!r} are both expert 1's gate weight")


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_expert_index_beyond_config_json_is_refused(tiny, tmp_path, capsys, kind):
    layer = moe_layers(kind)[-1]
    key, count = _expert_count(tiny[kind])

    def one_more(t):
        for role in ("gate", "up", "down"):
            t[expert_name(kind, layer, count, role)] = t[expert_name(kind, layer, 0, role)]

    _expect_error(_edited(tiny[kind], tmp_path / "in", one_more), tmp_path, capsys,
                  f"tensor {expert_name(kind, layer, count, 'gate')!r}: expert index {count} is out of range "
                  f"(config.json: {key} {count}, experts 0-{count - 1})")


def test_config_json_without_sizes(tiny, tmp_path, capsys):
    """Without sizes in config.json (or without config.json) the experts are checked against each other;
    a consistent checkpoint still converts (its config.json is the input's, as before)."""
    kind, layer = "qwen3_moe", moe_layers("qwen3_moe")[-1]

    def no_sizes(c):
        for key in ("hidden_size", "moe_intermediate_size", "intermediate_size", "num_experts",
                    "num_local_experts"):
            c.pop(key, None)

    src = _edited(tiny[kind], tmp_path / "plain", config=no_sizes)
    assert run(src, tmp_path / "ok") == 0
    assert FP8SafeTensorLoader(tmp_path / "ok").load_experts(layer).expert_num == EXPERTS
    odd = expert_name(kind, layer, 3, "down")
    src = _edited(tiny[kind], tmp_path / "odd", lambda t: t.update({odd: _bf16((HIDDEN, MOE_INTER - 16))}),
                  no_sizes)
    _expect_error(src, tmp_path, capsys, f"tensor {odd!r} has shape [{HIDDEN}, {MOE_INTER - 16}]; expected "
                  f"[hidden, intermediate] = [{HIDDEN}, {MOE_INTER}] (as most experts of "
                  f"model.layers.{layer}.mlp.experts)")
    (src / "config.json").unlink()
    _expect_error(src, tmp_path, capsys, f"tensor {odd!r} has shape")
    gap = [expert_name(kind, layer, 1, role) for role in ("gate", "up", "down")]
    src = _edited(tiny[kind], tmp_path / "gap", lambda t: [t.pop(n) for n in gap], no_sizes)
    _expect_error(src, tmp_path, capsys, f"expert tensor {gap[0]!r} is missing: model.layers.{layer}.mlp.experts "
                  f"needs experts 0-{EXPERTS - 1} (the highest index found is {EXPERTS - 1})")


def test_config_json_with_per_layer_sizes(tiny, tmp_path, capsys):
    """Hunyuan-A13B's config.json gives moe_intermediate_size per layer: a list holding one value checks
    the experts as that size does; a list whose values differ checks them against each other."""
    kind, layer = "qwen3_moe", moe_layers("qwen3_moe")[-1]
    odd = expert_name(kind, layer, 3, "down")
    src = _edited(tiny[kind], tmp_path / "one", lambda t: t.update({odd: _bf16((HIDDEN, MOE_INTER - 16))}),
                  lambda c: c.update(moe_intermediate_size=[MOE_INTER] * 2))
    _expect_error(src, tmp_path, capsys, f"tensor {odd!r} has shape [{HIDDEN}, {MOE_INTER - 16}]; expected "
                  f"[hidden, intermediate] = [{HIDDEN}, {MOE_INTER}] (config.json: hidden_size {HIDDEN}, "
                  f"moe_intermediate_size {MOE_INTER})")
    src = _edited(tiny[kind], tmp_path / "two", config=lambda c: c.update(moe_intermediate_size=[MOE_INTER, 64]))
    assert run(src, tmp_path / "ok") == 0


def test_fp8_expert_weight_not_2d_is_refused(tmp_path, capsys):
    folder = tmp_path / "fp8"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [128, 128]}}))
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    write_file(folder / "model.safetensors", {name: ("F8_E4M3", np.zeros((1, 4, 8), np.uint8)),
                                              name + "_scale_inv": ("F32", np.ones((1, 1), np.float32))})
    _expect_error(folder, tmp_path, capsys, f"tensor {name!r} has shape [1, 4, 8]; a Linear weight is 2-D",
                  input_type="fp8")


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fused_experts_of_an_unknown_layout_are_refused(tiny, tmp_path, capsys, kind):
    """Routed experts stored fused, one 3-D ...experts.gate_up_proj / down_proj per layer, in a model type
    whose fused layout the converter does not know (gate and up may be interleaved): it names a tensor,
    the model types it splits and the way that works (quantize on load) instead of 'found no weights to
    quantize'; with --all-linear too, which would leave most of the weights unquantized.  Nothing is
    written."""
    layers, count = moe_layers(kind), _expert_count(tiny[kind])[1]
    stack = expert_name(kind, layers[0], 0, "gate").rsplit(".0.", 1)[0]
    works = 'quantized on load instead: transformers\' from_pretrained(path, experts_implementation="ktfp8") ' \
            'after `import ktfp8.hf`'
    src = _edited(tiny[kind], tmp_path / "fused", lambda t: fuse_experts(t, kind, layers))
    fused = f"tensor '{stack}.down_proj' [{count}, {HIDDEN}, {MOE_INTER}] holds a layer's routed experts fused in " \
        f"one 3-D tensor, whose layout python -m ktfp8.convert does not know for model type {kind}: it splits the " \
        f"fused experts of mistral4, qwen3_vl_moe, lara_mini, granitemoe_swa, hy_v4, zaya, gemma4 checkpoints, and " \
        f"otherwise reads per-expert tensors only (...experts.<e>.gate_proj.weight, up_proj, down_proj)"
    _expect_error(src, tmp_path, capsys, f"{fused}. A BF16 checkpoint like this one is {works}")
    assert run(src, tmp_path / "o", "--all-linear") == 1
    err = capsys.readouterr().err
    assert f"{fused}; refused with --all-linear too, which would leave them, most of the weights, unquantized" \
           in err and works in err, err
    assert not (tmp_path / "o").exists()
    # the Hub's transposed layout, in the last MoE layer only (the others per-expert): refused all the same
    last = expert_name(kind, layers[-1], 0, "gate").rsplit(".0.", 1)[0]
    src = _edited(tiny[kind], tmp_path / "hub", lambda t: fuse_experts(t, kind, layers[-1:], transposed=True))
    _expect_error(src, tmp_path, capsys, f"tensor '{last}.down_proj' [{count}, {MOE_INTER}, {HIDDEN}] holds a "
                  f"layer's routed experts fused")


# (model_type, stored transposed) as checkpoints hold them (FUSED_LAYOUTS): Mistral 4 in transformers'
# layout, Qwen3-VL-MoE's Hub checkpoints transposed and transformers 5's saves not
FUSED_KINDS = [("mistral4", False), ("qwen3_vl_moe", True), ("qwen3_vl_moe", False)]
FUSED_IDS = ["mistral4", "qwen3_vl_moe-hub", "qwen3_vl_moe-transformers5"]
BLOCK_64 = '{"method":"FP8","per_channel":false,"group_size":64}'


def _fused(tiny, tmp_path, model_type, transposed, tensors=lambda t: None, config=lambda c: None):
    """The tiny Qwen3-MoE checkpoint with every MoE layer's experts fused (transposed or not), config.json
    naming `model_type`; then edited by `tensors` and `config`."""
    kind = "qwen3_moe"

    def edit(t):
        fuse_experts(t, kind, moe_layers(kind), transposed=transposed)
        tensors(t)

    def edit_config(c):
        c["model_type"] = model_type
        config(c)
    return _edited(tiny[kind], tmp_path / f"fused_{model_type}", edit, edit_config)


@pytest.mark.parametrize("quant", [PER_CHANNEL, BLOCK_64], ids=["per_channel", "block64"])
@pytest.mark.parametrize("model_type, transposed", FUSED_KINDS, ids=FUSED_IDS)
def test_fused_experts_convert_as_their_per_expert_form(tiny, tmp_path, model_type, transposed, quant):
    """Mistral 4's fused experts (transformers' layout, gate_up_proj [E, 2I, H]) and Qwen3-VL-MoE's (also
    transposed, [E, H, 2I]) are split into per-expert FP8 weights: every output tensor, byte for byte, is
    what converting the same experts stored per expert gives."""
    reference = tmp_path / "per_expert"
    assert run(tiny["qwen3_moe"], reference, "--quant-config", quant) == 0
    assert run(_fused(tiny, tmp_path, model_type, transposed), tmp_path / "o", "--quant-config", quant) == 0
    written, expected = _tensors(tmp_path / "o"), _tensors(reference)
    assert sorted(written) == sorted(expected)
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in written)
    assert written == expected
    assert FP8SafeTensorLoader(tmp_path / "o").moe_layers() == moe_layers("qwen3_moe")


@pytest.mark.parametrize("model_type, transposed", FUSED_KINDS, ids=FUSED_IDS)
def test_fused_weights_read_back_in_row_chunks(tiny, tmp_path, model_type, transposed):
    """However a weight's rows are cut into chunks, the chunks read from its fused stack are the expert's
    weight as stored per expert (a transposed stack: one chunk a weight)."""
    from ktfp8.convert_args import parse_quant_config
    from ktfp8.convert_plan import build_plan
    from ktfp8.convert_work import _source_rows, chunks
    from ktfp8.loader import Checkpoint
    with SafetensorsFile(tiny["qwen3_moe"] / "model.safetensors") as f:
        original = {n: f.read_rows(n) for n in f.tensors}
    checkpoint, spec = Checkpoint(_fused(tiny, tmp_path, model_type, transposed)), parse_quant_config(PER_CHANNEL)
    fused = [i for i in build_plan(checkpoint, "bf16", spec, False, 10**9).items if i.fused]
    assert len(fused) == 3 * EXPERTS * len(moe_layers("qwen3_moe"))
    for item in fused:
        parts = chunks(item, checkpoint, spec, chunk_bytes=7 * 2 * item.shape[1])     # 7 rows a chunk
        assert len(parts) == (1 if transposed else -(-item.shape[0] // 7))
        rows = np.concatenate([_source_rows(c, checkpoint) for c in parts])
        np.testing.assert_array_equal(rows.view(np.uint16), original[item.out].view(np.uint16))


def _rename_stack(t, old, new):
    for name in [n for n in t if n.startswith(old)]:
        t[new + name[len(old):]] = t.pop(name)


STACK = "model.layers.1.mlp.experts"
FUSED_REFUSALS = {
    "down_proj missing": (lambda t: t.pop(f"{STACK}.down_proj"), lambda c: None,
                          f"tensor '{STACK}.gate_up_proj' holds routed experts fused, but '{STACK}.down_proj' "
                          f"is missing"),
    "also per expert": (lambda t: t.update({f"{STACK}.0.gate_proj.weight": _bf16((MOE_INTER, HIDDEN))}),
                        lambda c: None, f"{STACK} holds its routed experts twice: fused ('{STACK}.gate_up_proj') "
                                        f"and per expert"),
    "intermediate size": (lambda t: None, lambda c: c.update(moe_intermediate_size=64),
                          f"tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape [{EXPERTS}, {2 * MOE_INTER}, "
                          f"{HIDDEN}]; expected [experts, 2 x intermediate, hidden] = [{EXPERTS}, 128, {HIDDEN}] "
                          f"(config.json: num_local_experts {EXPERTS}, hidden_size {HIDDEN}, moe_intermediate_size "
                          f"64)"),
    "down_proj of other experts": (lambda t: t.update({f"{STACK}.down_proj": _bf16((EXPERTS, MOE_INTER, HIDDEN))}),
                                   lambda c: None, f"tensor '{STACK}.down_proj' has shape [{EXPERTS}, {MOE_INTER}, "
                                                   f"{HIDDEN}]; expected [experts, hidden, intermediate]"),
    "FP8": (lambda t: t.update({f"{STACK}.gate_up_proj": ("F8_E4M3", np.zeros((EXPERTS, 2 * MOE_INTER, HIDDEN),
                                                                              ml_dtypes.float8_e4m3fn))}),
            lambda c: None, f"tensor '{STACK}.gate_up_proj' is F8_E4M3; python -m ktfp8.convert reads fused "
                            f"experts as BF16, FP16 or FP32 weights"),
    "no width": (lambda t: t.update({f"{STACK}.gate_up_proj": _bf16((EXPERTS, 0, HIDDEN)),
                                      f"{STACK}.down_proj": _bf16((EXPERTS, HIDDEN, 0))}),
                 lambda c: c.update(moe_intermediate_size=0),
                 f"tensor '{STACK}.gate_up_proj' has shape [{EXPERTS}, 0, {HIDDEN}]; experts of no width have "
                 f"nothing to quantize"),
    "outside mlp.experts": (lambda t: _rename_stack(t, STACK, "model.layers.1.moe.experts"), lambda c: None,
                            "tensor 'model.layers.1.moe.experts.gate_up_proj' holds routed experts fused "
                            "outside a decoder layer's mlp.experts or experts"),
}


@pytest.mark.parametrize("case", sorted(FUSED_REFUSALS))
def test_fused_experts_that_cannot_be_split_are_refused(tiny, tmp_path, capsys, case):
    """A fused stack of a known layout that does not hold what its names say is refused before anything
    is written, naming the tensor."""
    tensors, config, message = FUSED_REFUSALS[case]
    _expect_error(_fused(tiny, tmp_path, "mistral4", False, tensors, config), tmp_path, capsys, message)


def test_fused_experts_in_a_layout_their_model_type_does_not_use_are_refused(tiny, tmp_path, capsys):
    """Mistral 4's checkpoints hold transformers' layout only: a transposed stack is refused, not guessed."""
    gate_up = f"tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape [{EXPERTS}, {HIDDEN}, {2 * MOE_INTER}]"
    _expect_error(_fused(tiny, tmp_path, "mistral4", True), tmp_path, capsys,
                  f"{gate_up}; expected [experts, 2 x intermediate, hidden] = [{EXPERTS}, {2 * MOE_INTER}, {HIDDEN}] "
                  f"(config.json: ")
    # where a model type has two layouts and neither fits, both are named
    bad = _fused(tiny, tmp_path, "qwen3_vl_moe", True, config=lambda c: c.update(moe_intermediate_size=64))
    _expect_error(bad, tmp_path, capsys, f"{gate_up}; expected [experts, hidden, 2 x intermediate] = [{EXPERTS}, "
                  f"{HIDDEN}, 128] (config.json: num_local_experts {EXPERTS}, hidden_size {HIDDEN}, "
                  f"moe_intermediate_size 64) or [experts, 2 x intermediate, hidden] = [{EXPERTS}, 128, {HIDDEN}] "
                  f"(config.json: ")


def test_legitimate_shapes_convert(tmp_path):
    """What real checkpoints hold besides the routed experts keeps its own shape: Qwen2-MoE's shared
    expert (shared_expert_intermediate_size), DeepSeek-V3's dense first layer (intermediate_size) and
    shared experts, and its MTP layer (a layer past num_hidden_layers with routed experts)."""
    qwen2 = save_model(build_model("qwen2_moe"), tmp_path / "qwen2_moe")
    assert run(qwen2, tmp_path / "qwen2_fp8") == 0
    deepseek = save_model(build_model("deepseek_v3"), tmp_path / "deepseek_v3")
    mtp = _edited(deepseek, tmp_path / "deepseek_mtp", lambda t: t.update(
        {n.replace("layers.1.", "layers.2."): v for n, v in list(t.items()) if n.startswith("model.layers.1.")}))
    with SafetensorsFile(mtp / "model.safetensors") as f:
        assert f.info("model.layers.0.mlp.gate_proj.weight").shape == (192, HIDDEN)
        assert f.info("model.layers.1.mlp.shared_experts.gate_proj.weight").shape == (MOE_INTER, HIDDEN)
    assert run(mtp, tmp_path / "deepseek_fp8") == 0
    assert FP8SafeTensorLoader(tmp_path / "deepseek_fp8").moe_layers() == [1, 2]


def test_a_scale_named_twice_is_refused(tiny, tmp_path, capsys):
    """A block-wise FP8 expert with gate_proj.weight_scale_inv and w1.weight_scale_inv: which one scales
    the codes?  Refused before anything is written, as a weight named twice is."""
    kind = "qwen3_moe"
    block = tmp_path / "block"
    assert run(tiny[kind], block, "--quant-config", '{"method":"FP8","per_channel":false,"group_size":128}') == 0
    scale = expert_name(kind, moe_layers(kind)[-1], 1, "gate") + "_scale_inv"
    twin = scale.replace(".gate_proj.", ".w1.")
    src = _edited(block, tmp_path / "in", lambda t: t.update({twin: t[scale]}))
    _expect_error(src, tmp_path, capsys, f"tensors {scale!r} and {twin!r} are both expert 1's gate weight_scale_inv",
                  input_type="fp8")


def test_two_expert_stacks_in_one_layer_both_convert(tiny, tmp_path):
    """A multimodal checkpoint may hold a text and a vision MoE with the same layer index: the converter
    quantizes both stacks.  ktfp8's loader, which addresses experts by layer, takes the stack of the root
    with more layers (the decoder's: see test_loader's Qwen3-Next MTP test), and refuses two of as many."""
    kind = "qwen3_moe"
    layer = moe_layers(kind)[-1]
    stack = expert_name(kind, layer, 0, "gate").split(".0.gate_proj.")[0]
    vision = "vision_" + stack
    src = _edited(tiny[kind], tmp_path / "in", lambda t: t.update(   # the vision experts all zero: scales 0
        {vision + n[len(stack):]: (t[n][0], np.zeros_like(t[n][1])) for n in list(t) if n.startswith(stack + ".")}))
    assert run(src, tmp_path / "o", "--quant-config", PER_CHANNEL) == 0
    written = _tensors(tmp_path / "o")
    for prefix in (stack, vision):
        name = f"{prefix}.0.down_proj.weight"
        assert written[name][0] == "F8_E4M3" and written[name + "_scale"][0] == "F32"
    with FP8SafeTensorLoader(tmp_path / "o") as loader:   # the text root has more layers: its experts
        assert loader.moe_layers() == moe_layers(kind)
        assert (np.asarray(loader.load_experts(layer).down_scale) > 0).all()
    first = expert_name(kind, moe_layers(kind)[0], 0, "gate").split(".0.gate_proj.")[0]
    more = _edited(tmp_path / "o", tmp_path / "in2", lambda t: t.update(   # now as many layers under each
        {"vision_" + n: t[n] for n in list(t) if n.startswith(first + ".")}))
    with pytest.raises(SafetensorsError, match=r"layer \d+ has experts under two prefixes: 'model\.layers"):
        FP8SafeTensorLoader(more)


def test_experts_of_their_own_width_convert(tiny, tmp_path):
    """Muse Spark (moe_hidden_size) and NemotronH (moe_latent_size) project x to the experts' own width:
    the experts are checked against that width, not hidden_size."""
    for key in ("moe_hidden_size", "moe_latent_size"):
        src = _edited(tiny["qwen3_moe"], tmp_path / key, config=lambda c: c.update(
            {key: c["hidden_size"], "hidden_size": c["hidden_size"] + 8}))
        assert run(src, tmp_path / f"{key}_out", "--quant-config", PER_CHANNEL) == 0


# -- values no FP8 checkpoint can hold: refused, naming the tensor and the value ---------------------
def _in_small_chunks(monkeypatch, rows):
    """Cuts every tensor into chunks of about `rows` rows (of the widest experts), so that a value is
    found in a chunk that does not start at row 0."""
    import functools
    import ktfp8.convert as convert_module
    from ktfp8.convert_work import chunks
    monkeypatch.setattr(convert_module, "chunks", functools.partial(chunks, chunk_bytes=rows * 2 * HIDDEN))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_nan_or_inf_in_a_weight_to_quantize_is_refused(tiny, tmp_path, capsys, monkeypatch, value, dtype):
    """NaN and Inf have no FP8 E4M3 code that means them (Inf would be saturated to 448 x the row's scale,
    NaN would make every output of its row NaN): refused at the chunk that holds one, naming the tensor,
    the value and where it is in the input, and nothing is written.  Row 50 lies in a chunk that starts
    at row 32 (BF16, FP16) or 48 (FP32)."""
    _in_small_chunks(monkeypatch, 32)
    kind = "qwen3_moe"
    name = expert_name(kind, moe_layers(kind)[-1], 2, "up")
    np_dtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}[dtype]
    safetensors_dtype = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[dtype]

    def spoil(t):
        for n, (d, a) in list(t.items()):
            if d == "BF16":
                t[n] = (safetensors_dtype, a.astype(np.float32).astype(np_dtype))
        t[name][1][50, 7] = value
    src = _edited(tiny[kind], tmp_path / "in", spoil)
    _expect_error(src, tmp_path, capsys, f"tensor {name!r} holds {float(value)} at [50, 7]; only finite weights "
                  f"can be quantized", input_type=dtype)


@pytest.mark.parametrize("model_type, transposed", FUSED_KINDS, ids=FUSED_IDS)
def test_nan_in_fused_experts_is_refused_where_it_is(tiny, tmp_path, capsys, model_type, transposed):
    """A NaN in a fused stack is reported at its index in the stack, with the per-expert weight it falls
    in: expert 2's up_proj row 5, column 7."""
    stack = "model.layers.1.mlp.experts"
    where = (2, 7, MOE_INTER + 5) if transposed else (2, MOE_INTER + 5, 7)

    def spoil(t):
        t[f"{stack}.gate_up_proj"][1][where] = np.nan
    src = _fused(tiny, tmp_path, model_type, transposed, spoil)
    _expect_error(src, tmp_path, capsys, f"tensor '{stack}.gate_up_proj' holds nan at {list(where)} "
                  f"({stack}.2.up_proj.weight); only finite weights can be quantized")


B32 = '{"method":"FP8","per_channel":false,"group_size":32}'


@pytest.fixture(scope="module")
def block_fp8(tiny, tmp_path_factory):
    """The tiny Qwen3-MoE as a block-wise FP8 checkpoint of 32 x 32 blocks (gate/up scales [3, 5])."""
    out = tmp_path_factory.mktemp("block_fp8") / "b32"
    assert run(tiny["qwen3_moe"], out, "--quant-config", B32) == 0
    return out


@pytest.mark.parametrize("quant", [PER_CHANNEL, BLOCK_64, B32], ids=["per_channel", "block64", "same_block"])
@pytest.mark.parametrize("bad", ["nan", "inf", "negative", "too_large"])
def test_bad_weight_scale_inv_is_refused(block_fp8, tmp_path, capsys, monkeypatch, bad, quant):
    """A block-wise FP8 input whose weight_scale_inv holds a NaN, an Inf, a negative value or one above
    FLT_MAX / 256 is refused as ktfp8's loader refuses it (FP8SafeTensorLoader: SCALE_RULE), whether its weight is
    re-quantized (NaN codes, +-448 codes, flipped signs were written before) or kept as it is (the
    loader would refuse the output); the index is the scale's own, in a chunk not starting at row 0."""
    _in_small_chunks(monkeypatch, 32)
    scale = "model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"
    value = {"nan": np.nan, "inf": np.inf, "negative": -0.25, "too_large": 1e37}[bad]

    def spoil(t):
        t[scale][1][2, 3] = value
    src = _edited(block_fp8, tmp_path / "in", spoil)
    rule = "scales must be finite, >= 0 and at most 1.329e+36 (FLT_MAX / 256)"
    with pytest.raises(SafetensorsError, match=re.escape(f"{scale} holds {float(value)} at [2, 3]; {rule}")):
        FP8SafeTensorLoader(src).load_experts(1)
    assert run(src, tmp_path / "o", "--quant-config", quant, input_type="fp8") == 1
    err = capsys.readouterr().err
    assert f"tensor {scale!r} holds {float(value)} at [2, 3]; {rule}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_nan_code_in_fp8_input_is_refused(block_fp8, tmp_path, capsys):
    """An F8_E4M3 NaN code (0x7F) is a NaN once dequantized: refused, not written as a NaN code again."""
    name = "model.layers.0.mlp.experts.1.down_proj.weight"

    def spoil(t):
        t[name][1].view(np.uint8)[4, 9] = 0x7F
    src = _edited(block_fp8, tmp_path / "in", spoil)
    _expect_error(src, tmp_path, capsys, f"tensor {name!r} dequantized with '{name}_scale_inv' holds nan at [4, 9]; "
                  f"only finite weights can be quantized", input_type="fp8")


def test_zero_weight_scale_inv_is_a_block_of_zeros(block_fp8, tmp_path):
    """Scale 0 is allowed, as the loader allows it (an all-zero block may carry it): that block's weights
    are zeros, written as zero codes; every other weight is its dequantized input re-quantized per
    channel (oracle: ml_dtypes)."""
    scale = "model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"
    name = scale[:-len("_scale_inv")]
    src = _edited(block_fp8, tmp_path / "in", lambda t: t[scale][1].__setitem__((1, 2), 0.0))
    assert run(src, tmp_path / "o", "--quant-config", PER_CHANNEL, input_type="fp8") == 0
    with SafetensorsFile(src / "model.safetensors") as f:
        codes, s = f.read_rows(name), f.read_rows(scale).astype(np.float32)
    expanded = np.repeat(np.repeat(s, 32, 0), 32, 1)[:codes.shape[0], :codes.shape[1]]
    w = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * expanded
    with SafetensorsFile(tmp_path / "o" / "model.safetensors") as f:
        out_codes, out_scale = f.read_rows(name), f.read_rows(name + "_scale")
    restored = out_codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * out_scale
    assert np.all(restored[32:64, 64:96] == 0)
    expected_scale = np.abs(w).max(axis=1, keepdims=True) / 448
    np.testing.assert_allclose(out_scale, expected_scale, rtol=1e-6)
    expected = (w / out_scale).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(out_codes.view(np.uint8), expected)
    FP8SafeTensorLoader(tmp_path / "o").load_experts(1)


# -- shapes and options that once stalled or were read wrongly ----------------------------------------
def test_zero_byte_tensor_with_huge_rows_is_one_chunk(tiny, tmp_path, capsys):
    """A legal zero-size tensor that is copied, shape [2**50, 0]: one empty chunk (rows of 0 bytes were cut
    into 2**25 chunks of 2**25 rows, minutes and gigabytes of bookkeeping), copied with its shape.  One
    whose row alone is more than NumPy can shape is refused, naming it."""
    from ktfp8.convert_args import parse_quant_config
    from ktfp8.convert_items import Item
    from ktfp8.convert_work import chunks
    spec = parse_quant_config(PER_CHANNEL)
    for shape in ((2**40, 0), (0, 5), (3, 0, 7)):
        item = Item("copy", "x", "x", "BF16", shape)
        parts = chunks(item, _ZeroSized(), spec)
        assert [(c.start, c.stop, c.in_bytes) for c in parts] == [(0, shape[0], 0)], shape
    started = time.monotonic()
    src = _with_zero_byte_tensor(tiny["qwen3_moe"], tmp_path / "in", [2**50, 0])
    assert run(src, tmp_path / "o", "--verify") == 0
    assert time.monotonic() - started < 60
    assert _shapes(tmp_path / "o")["model.extra_buffer"] == ("BF16", (2**50, 0))
    # more rows than NumPy can shape at once (nothing is read), in a shard of its own (opened all the same)
    src = _with_zero_byte_tensor(tiny["qwen3_moe"], tmp_path / "in2", [2**62, 0])
    assert run(src, tmp_path / "o2", "--verify", "--max-shard-size", "1") == 0
    assert _shapes(tmp_path / "o2")["model.extra_buffer"] == ("BF16", (2**62, 0))
    shard = json.loads((tmp_path / "o2" / "model.safetensors.index.json").read_text())["weight_map"]
    with SafetensorsFile(tmp_path / "o2" / shard["model.extra_buffer"]) as f:
        assert list(f.tensors) == ["model.extra_buffer"]
    capsys.readouterr()
    src = _with_zero_byte_tensor(tiny["qwen3_moe"], tmp_path / "in3", [0, 2**62])
    assert run(src, tmp_path / "o3") == 1
    assert f"tensor 'model.extra_buffer' has shape [0, {2**62}]: no bytes, but a row shape [{2**62}] larger than " \
           f"NumPy can hold" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists()


def _with_zero_byte_tensor(src, dst, shape):
    """A copy of the single-file checkpoint `src` with a second shard holding one BF16 tensor
    `model.extra_buffer` of `shape` and no bytes (written by hand: NumPy cannot make [2**62, 0])."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst)
    shutil.copy(src / "model.safetensors", dst / "model-00001-of-00002.safetensors")
    header = json.dumps({"model.extra_buffer": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}}).encode()
    header += b" " * (-len(header) % 8)
    (dst / "model-00002-of-00002.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with SafetensorsFile(src / "model.safetensors") as f:
        weight_map = {n: "model-00001-of-00002.safetensors" for n in f.tensors}
    weight_map["model.extra_buffer"] = "model-00002-of-00002.safetensors"
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


class _ZeroSized:
    """A checkpoint whose every tensor holds no bytes (what chunks() asks of one)."""

    def info(self, name):
        from ktfp8.safetensors_io import TensorInfo
        return TensorInfo(name, "BF16", (0,), 0, 0)


def test_fused_split_warns_that_transformers_cannot_load_the_output(tiny, tmp_path, capsys):
    """transformers' own Mistral 4 / Qwen3-VL-MoE classes hold fused experts: loading the per-expert output
    with their from_pretrained finds the experts missing and initialises them randomly.  The converter
    says so when it splits fused experts, and only then."""
    assert run(_fused(tiny, tmp_path, "mistral4", False), tmp_path / "o") == 0
    err = capsys.readouterr().err
    assert "warning: the fused experts of 2 layer(s) (model.layers.0.mlp.experts, ...) are written per expert " \
           "(...experts.<e>.gate_proj.weight, up_proj, down_proj): the output is for ktfp8 " \
           "(ktfp8.hf.from_pretrained, FP8SafeTensorLoader); transformers' own from_pretrained of mistral4 expects " \
           "fused gate_up_proj / down_proj, would find those experts missing and initialise them randomly" in err, err
    assert run(tiny["qwen3_moe"], tmp_path / "per_expert") == 0
    assert "warning" not in capsys.readouterr().err


def test_all_linear_leaves_the_layers_of_a_vision_encoder(tiny, tmp_path):
    """--all-linear quantizes the decoder's layers (those under the root holding the routed experts): a
    vision encoder's numbered layers, and a projector, stay as they are and are listed as unquantized."""
    vision = {"model.vision_model.encoder.layers.0.mlp.fc1.weight": _bf16((64, 32)),
              "vision_tower.transformer.layers.0.attention.q_proj.weight": _bf16((32, 32)),
              "multi_modal_projector.linear_1.weight": _bf16((64, 32))}
    src = _edited(tiny["qwen3_moe"], tmp_path / "in", lambda t: t.update(vision))
    assert run(src, tmp_path / "out", "--all-linear") == 0
    written = _tensors(tmp_path / "out")
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    for name, (dtype, array) in vision.items():
        assert written[name] == (dtype, array.tobytes()) and name[:-len(".weight")] in ignore
    assert written["model.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"


def test_an_fp8_output_head_is_requantized_and_not_listed_as_unquantized(block_fp8, tmp_path):
    """A block-wise FP8 input whose lm_head is FP8 too: the head is requantized as the other FP8 weights
    are, so `ignore` must not tell engines to read its F8_E4M3 bytes as an unquantized Linear."""
    with SafetensorsFile(block_fp8 / "model.safetensors") as f:
        head = f.read_rows("lm_head.weight").view(ml_dtypes.bfloat16).astype(np.float32)
    codes, scale = fp8.quantize(head, per_channel=False, block=(32, 32))
    src = _edited(block_fp8, tmp_path / "in", lambda t: t.update({"lm_head.weight": ("F8_E4M3", codes),
                                                                   "lm_head.weight_scale_inv": ("F32", scale)}))
    assert run(src, tmp_path / "out", input_type="fp8") == 0
    assert "lm_head" not in json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    with SafetensorsFile(tmp_path / "out" / "model.safetensors") as f:
        out_codes, out_scale = f.read_rows("lm_head.weight"), f.read_rows("lm_head.weight_scale")
    wanted = fp8.dequantize(codes, scale, block=(32, 32)).astype(np.float64)
    got = out_codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * out_scale
    # per-channel E4M3 rounds each row to within half its largest spacing: 16 x (amax / 448) = amax / 28
    assert (np.abs(got - wanted) <= np.abs(wanted).max(axis=1, keepdims=True) / 28 * (1 + 1e-6)).all()


def test_a_name_with_digits_of_another_script_converts(tiny, tmp_path):
    """Natural order reads ASCII digit runs as numbers: str.isdigit also takes a superscript two, which int()
    refused, and the run stopped naming no tensor."""
    name = "model.extra1\u00b22.weight"
    src = _edited(tiny["qwen3_moe"], tmp_path / "in", lambda t: t.update({name: _bf16((4,))}))
    assert run(src, tmp_path / "out") == 0
    assert _tensors(tmp_path / "out")[name] == ("BF16", _bf16((4,))[1].tobytes())


def test_fp8_input_and_verify_chunks_bound_the_float_copies(block_fp8, tmp_path, monkeypatch):
    """A chunk was 32 MiB of input whatever became of it: an FP8 input's codes are worked on as float32
    (4x their bytes) and --verify holds about 21 bytes a weight in float64 and float32, so converting a
    block-wise FP8 checkpoint with --verify peaked at 1451 MB on 2 threads (145 MB now; 0.4 GB of
    64 MB tensors)."""
    import ktfp8.convert as convert_module
    from ktfp8.convert_args import parse_quant_config
    from ktfp8.convert_plan import build_plan
    from ktfp8.convert_work import VERIFY_CHUNK_BYTES, chunks
    from ktfp8.loader import Checkpoint
    checkpoint, spec = Checkpoint(block_fp8), parse_quant_config(PER_CHANNEL)
    items = [i for i in build_plan(checkpoint, "fp8", spec, False, 10**9).items if i.src_block]
    assert items
    for item in items:
        budget = 32 * 4 * item.shape[1]             # 32 rows as float32; the input block is 32 rows
        parts = chunks(item, checkpoint, spec, chunk_bytes=budget)
        assert all(c.stop - c.start == 32 for c in parts[:-1]) and len(parts) == -(-item.shape[0] // 32)
    asked = []

    def recording(*args, **kwargs):
        asked.append(kwargs.get("chunk_bytes"))
        return chunks(*args, **kwargs)
    monkeypatch.setattr(convert_module, "chunks", recording)
    assert run(block_fp8, tmp_path / "o", "--verify", input_type="fp8") == 0
    assert set(asked) == {None, VERIFY_CHUNK_BYTES} and VERIFY_CHUNK_BYTES <= 8 << 20
