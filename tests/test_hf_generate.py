"""python -m ktfp8.generate: the tokens are transformers' own greedy ones (model.generate on the same
ktfp8 model), for a BF16 folder and an FP8 folder, with and without a tokenizer; its exit statuses."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

import ktfp8.hf  # noqa: E402
from ktfp8.hf import checkpoint as checkpoint_module  # noqa: E402
from hf_oracle import model_folders, tiny_model_settings  # noqa: E402
from open_files import open_files_under  # noqa: E402
from ktfp8.generate import main  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

PROMPT = [5, 17, 42, 99, 3]
NEW = 12


@pytest.fixture(autouse=True)
def settings(monkeypatch):
    yield from tiny_model_settings(monkeypatch)          # float32 kernels, 1 thread


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return model_folders("mixtral", tmp_path_factory)


def _generate_json(capsys, *args):
    assert main([*args, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1           # one JSON object, nothing else on stdout
    return json.loads(out)


def _expected(model, prompt=PROMPT):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    ids = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return ids[:ids.index(eos) + 1] if eos in ids else ids     # generate pads after EOS; we stop


@pytest.mark.parametrize("folder", ["fp8", "bf16"])
def test_json_ids_are_transformers_greedy_tokens(mixtral, folder, capsys):
    got = _generate_json(capsys, "--model", str(mixtral[folder]), "--prompt-ids", ",".join(map(str, PROMPT)),
                         "--max-new-tokens", str(NEW), "--threads", "1")
    if folder == "fp8":
        model = ktfp8.hf.from_pretrained(mixtral["fp8"])
    else:
        model = ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(mixtral["bf16"], dtype=torch.bfloat16))
    assert got["ids"] == _expected(model)
    assert got["text"] is None                                   # the folder has no tokenizer
    assert got["prefill_tokens_per_s"] > 0
    assert got["decode_tokens_per_s"] is None or got["decode_tokens_per_s"] > 0


def test_from_pretrained_gives_the_checkpoint_files_back(mixtral, tmp_path, monkeypatch):
    """Once every layer has packed its experts, from_pretrained closes its loader, and so does a refusal:
    while the loader object is still referenced (here by the test; in a refusal, by the exception's
    frames), no descriptor of the folder's shards stays open; the model still runs."""
    loaders = []

    class Recorded(checkpoint_module.FP8SafeTensorLoader):
        def __init__(self, path):
            super().__init__(path)
            loaders.append(self)
    monkeypatch.setattr(checkpoint_module, "FP8SafeTensorLoader", Recorded)
    model = ktfp8.hf.from_pretrained(mixtral["fp8"])
    assert len(loaders) == 1 and open_files_under(mixtral["fp8"]) == []
    assert len(_expected(model)) > 0
    with pytest.raises(ValueError, match="not FP8") as refused:
        ktfp8.hf.from_pretrained(mixtral["bf16"])
    assert len(loaders) == 2 and refused.value is not None and open_files_under(mixtral["bf16"]) == []


def test_fp8_folder_without_a_quantization_config_is_read_as_fp8(mixtral, tmp_path, capsys):
    """Its headers say F8_E4M3: transformers' own loading would take the codes as values and drop the
    scales (wrong tokens, exit 0), so generate reads it as FP8 anyway."""
    folder = tmp_path / "fp8_no_quant_config"
    shutil.copytree(mixtral["fp8"], folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    got = _generate_json(capsys, "--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
                         "--max-new-tokens", str(NEW), "--threads", "1")
    assert got["ids"] == _expected(ktfp8.hf.from_pretrained(mixtral["fp8"]))


def _word_tokenizer(vocab_size):
    """A whitespace tokenizer whose word 'w<i>' is token i (an oracle for text in, text out)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"[UNK]": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _with_tokenizer(folder, copy, vocab_size=128):
    copy = shutil.copytree(folder, copy)
    _word_tokenizer(vocab_size).save_pretrained(copy)
    return copy


def test_text_prompt_and_text_out(mixtral, tmp_path, capsys):
    folder = _with_tokenizer(mixtral["fp8"], tmp_path / "with_tokenizer")
    got = _generate_json(capsys, "--model", str(folder), "--prompt", " ".join(f"w{i}" for i in PROMPT),
                         "--max-new-tokens", str(NEW))
    assert got["ids"] == _expected(ktfp8.hf.from_pretrained(mixtral["fp8"]))
    assert got["text"].split() == [f"w{i}" if i < 127 else "[UNK]" for i in got["ids"]]
    assert main(["--model", str(folder), "--prompt", "w1 w2", "--max-new-tokens", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines[0].split()) <= 3 and lines[1].startswith("prefill: 2 tokens")


@pytest.mark.parametrize("broken, error", [
    ("tokenizer_config.json", "AttributeError"),     # no object: an AttributeError traceback from transformers
    ("tokenizer.json", "JSONDecodeError"),           # cut short: was worded "cannot load the model"
])
def test_a_broken_tokenizer_is_named_and_ids_go_on_without_it(mixtral, tmp_path, capsys, broken, error):
    folder = _with_tokenizer(mixtral["fp8"], tmp_path / "broken")
    path = folder / broken
    path.write_text("[1, 2]" if broken == "tokenizer_config.json" else path.read_text()[:50])
    assert main(["--model", str(folder), "--prompt", "w1 w2", "--max-new-tokens", "2"]) == 1
    assert f"{folder}: cannot load the tokenizer: {error}" in capsys.readouterr().err
    assert main(["--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW),
                 "--json"]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    assert got["ids"] == _expected(ktfp8.hf.from_pretrained(mixtral["fp8"])) and got["text"] is None
    assert f"warning: {folder}: cannot load the tokenizer: {error}" in captured.err
    assert captured.err.splitlines()[0].endswith("; printing token ids")


def test_ctrl_c_prints_the_tokens_so_far_and_exits_130(mixtral, monkeypatch, capsys):
    def interrupt_at_the_fourth(self, done, tokens_per_s):
        if done == 4:
            raise KeyboardInterrupt
    monkeypatch.setattr("ktfp8.generate.Progress.update", interrupt_at_the_fourth)
    assert main(["--model", str(mixtral["fp8"]), "--prompt-ids", ",".join(map(str, PROMPT)),
                 "--max-new-tokens", str(NEW)]) == 130
    captured = capsys.readouterr()
    want = _expected(ktfp8.hf.from_pretrained(mixtral["fp8"]))[:4]
    assert captured.out.split() == list(map(str, want))           # the ids so far, no speed line
    assert captured.err.strip().endswith("python -m ktfp8.generate: interrupted after 4 new tokens")


def test_a_run_past_max_position_embeddings_is_warned_about(mixtral, tmp_path, capsys):
    folder = shutil.copytree(mixtral["fp8"], tmp_path / "short")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = len(PROMPT) + 2
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "2"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "3"]) == 0
    assert (f"the prompt and --max-new-tokens take up to {len(PROMPT) + 3} positions, past the model's "
            f"max_position_embeddings ({len(PROMPT) + 2})") in capsys.readouterr().err


def test_exit_statuses(mixtral, tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing"), "--prompt-ids", "1"]) == 1
    assert "no such model folder" in capsys.readouterr().err
    assert main(["--model", "", "--prompt-ids", "1"]) == 2                      # not the current folder
    assert "--model: an empty path" in capsys.readouterr().err
    assert main(["--model", str(mixtral["fp8"]), "--prompt", "hello"]) == 2     # no tokenizer for text
    assert "--prompt-ids" in capsys.readouterr().err
    assert main(["--model", str(mixtral["fp8"]), "--prompt-ids", "1,500"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["--model", str(tmp_path / "empty"), "--prompt-ids", "1"]) == 1
    for bad in (["--prompt-ids", "1"], ["--model", "x"], ["--model", "x", "--prompt-ids", "1,a"],
                ["--model", "x", "--prompt-ids", "1", "--max-new-tokens", "0"],
                ["--model", "x", "--prompt", "a", "--prompt-ids", "1"], ["--model", "x", "--prompt-ids", "-1"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2


def test_usage_errors_and_run_errors_start_alike(tmp_path, capsys):
    """argparse's errors began `python -m ktfp8.generate: error:`, the others `ktfp8.generate: error:`."""
    with pytest.raises(SystemExit):
        main(["--model", "x", "--prompt-ids", "1,a"])
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "python -m ktfp8.generate: error: argument --prompt-ids: expected comma-separated token ids")
    assert main(["--model", str(tmp_path / "missing"), "--prompt-ids", "1"]) == 1
    assert capsys.readouterr().err == f"python -m ktfp8.generate: error: {tmp_path / 'missing'}: no such model folder\n"


def test_the_prompt_is_refused_before_the_model_loads(mixtral, tmp_path, monkeypatch, capsys):
    """A text prompt without a tokenizer, a token id past the config's vocab_size (a multimodal model's:
    its text config's): refused after the model had loaded, minutes for a large one."""
    from ktfp8 import generate

    def load(folder, threads):
        raise AssertionError(f"{folder} was loaded")
    monkeypatch.setattr(generate, "load", load)
    assert main(["--model", str(mixtral["fp8"]), "--prompt", "hello"]) == 2
    assert f"{mixtral['fp8']} has no tokenizer: give the prompt as --prompt-ids" in capsys.readouterr().err
    assert main(["--model", str(mixtral["bf16"]), "--prompt-ids", "1,500"]) == 2
    assert "--prompt-ids: token id 500 is outside the vocabulary (size 128)" in capsys.readouterr().err
    big = tmp_path / "big_tokenizer"                                  # no weights: nothing is loaded
    big.mkdir()
    shutil.copy(mixtral["fp8"] / "config.json", big)
    _word_tokenizer(300).save_pretrained(big)
    assert main(["--model", str(big), "--prompt", "w5 w250"]) == 2
    assert "--prompt: the tokenizer's token id 250 is outside the vocabulary (size 128)" in capsys.readouterr().err
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    config = {"model_type": "qwen3_vl_moe", "text_config": {"vocab_size": 64}}
    (multimodal / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(multimodal), "--prompt-ids", "64"]) == 2
    assert "--prompt-ids: token id 64 is outside the vocabulary (size 64)" in capsys.readouterr().err


def _sharded_bin(folder):
    """The folder's weights as two torch .bin shards with their index (no safetensors); the shards' names."""
    from safetensors.torch import load_file
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for shard, keys in shards.items():
        torch.save({k: tensors[k] for k in keys}, folder / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sorted(shards)


@pytest.mark.parametrize("content", [
    b"\x80\x02not a pickle" * 64,      # torch's message advised loading with weights_only=False
    b"",                               # these were tracebacks (EOFError, IndexError) ...
    b"a text file\n",
    "half",                            # ... or a message that named no file (a zip cut short)
])
def test_a_damaged_bin_shard_is_named_in_one_line(mixtral, tmp_path, capsys, content):
    folder = shutil.copytree(mixtral["bf16"], tmp_path / "bin")
    bad = _sharded_bin(folder)[1]
    if content == "half":
        content = (folder / bad).read_bytes()[:(folder / bad).stat().st_size // 2]
    (folder / bad).write_bytes(content)
    assert main(["--model", str(folder), "--prompt-ids", "1"]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(re.escape(f"python -m ktfp8.generate: error: {folder}: cannot load the model: {bad} is not a "
                                  f"valid PyTorch checkpoint (torch.load, which transformers reads .bin weights "
                                  f"with, raised ") + r"\w+\)", err.splitlines()[-1])
    assert "weights_only" not in err and "Traceback" not in err


def test_a_bin_holding_other_objects_than_tensors_is_named_so(mixtral, tmp_path, capsys):
    """A valid .bin holding a NumPy scalar beside its tensors is refused by torch.load(weights_only=True):
    named as such, not as a damaged file (a helper's review), nor with torch's advice to load it unsafely."""
    folder = shutil.copytree(mixtral["bf16"], tmp_path / "bin")
    bad = _sharded_bin(folder)[1]
    torch.save({**torch.load(folder / bad), "step": np.float64(3)}, folder / bad)
    assert main(["--model", str(folder), "--prompt-ids", "1"]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(re.escape(f"python -m ktfp8.generate: error: {folder}: cannot load the model: {bad} holds a ")
                        + r"numpy\S+scalar" + re.escape(" beside its tensors, which torch.load(weights_only=True) does "
                                                       "not unpickle; save the weights as tensors only, or as "
                                                       "safetensors"), err.splitlines()[-1])
    assert "Traceback" not in err and "arbitrary code" not in err


@pytest.mark.parametrize("folder", ["fp8", "bf16"])
def test_a_config_field_of_the_wrong_type_exits_1(mixtral, folder, tmp_path, capsys):
    """transformers' strict config classes raise huggingface_hub's StrictDataclassError (no ValueError)
    for a field of the wrong type: a message and exit status 1, not a traceback."""
    bad = tmp_path / "bad_config"
    shutil.copytree(mixtral[folder], bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_local_experts"] = [4, 4]
    (bad / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(bad), "--prompt-ids", "1"]) == 1
    assert "cannot load the model" in capsys.readouterr().err


def test_ranks_that_cannot_start_or_fail_exit_1_with_a_message(mixtral, monkeypatch, capsys):
    """Starting the ranks, and a rank lost midway (ExpertParallelError on the others), ended in a
    traceback; now one error line and exit status 1."""
    from ktfp8 import generate
    from ktfp8.distributed import ExpertParallelError
    args = ["--model", str(mixtral["fp8"]), "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    monkeypatch.setenv("WORLD_SIZE", "2")                       # not under torchrun: no MASTER_ADDR / PORT
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m ktfp8.generate: error: cannot start the ranks: ") and "is not set" in err
    monkeypatch.setenv("WORLD_SIZE", "1")

    def lost(*a, **k):
        raise ExpertParallelError("rank 1 did not answer within 5 s")
    monkeypatch.setattr(generate, "greedy", lost)
    assert main(args) == 1
    err = capsys.readouterr().err                                # after transformers' loading bar
    assert err.endswith("\npython -m ktfp8.generate: error: rank 1 did not answer within 5 s\n")
    assert "Traceback" not in err


def test_a_result_it_cannot_write_exits_1_without_a_traceback(mixtral):
    """/dev/full: an OSError traceback before; a reader that left (| head -0): a BrokenPipeError one."""
    cmd = [sys.executable, "-m", "ktfp8.generate", "--model", str(mixtral["fp8"]), "--prompt-ids", "1,2",
           "--max-new-tokens", "2", "--threads", "1"]
    with open("/dev/full", "w") as full:
        r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "python -m ktfp8.generate: error: cannot write to standard output: No space left on device" in r.stderr
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()                                            # the reader is gone before any output
    err = p.stderr.read()
    assert p.wait(timeout=300) == 1 and "Traceback" not in err and "error" not in err   # quietly, as | head
    # started with stdout closed (`>&-`: sys.stdout is None): an AttributeError traceback before
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
                       preexec_fn=lambda: os.close(1))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "python -m ktfp8.generate: error: cannot write to standard output: it is closed" in r.stderr


def test_without_torch_exits_1_naming_what_to_install(mixtral):
    """The core package installs without torch; generate then says what it needs (it was an
    ImportError traceback).  torch is hidden in a child process: a None in sys.modules fails its import."""
    code = "import sys; sys.modules['torch'] = None; from ktfp8.generate import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "--model", str(mixtral["fp8"]), "--prompt-ids", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "needs torch and transformers" in r.stderr and "transformers>=5.24" in r.stderr and "Traceback" not in r.stderr
    # the CPU build: PyPI's torch is the multi-GB CUDA one on Linux
    assert "pip install 'torch>=2.6' --index-url https://download.pytorch.org/whl/cpu" in r.stderr


def test_text_prompt_without_tokens(mixtral, tmp_path, capsys):
    folder = _with_tokenizer(mixtral["fp8"], tmp_path / "with_tokenizer")
    for empty in ("", "   "):
        assert main(["--model", str(folder), "--prompt", empty]) == 2
        assert "--prompt: the prompt has no tokens" in capsys.readouterr().err


def test_text_prompt_outside_the_vocabulary_names_the_tokenizer(mixtral, tmp_path, capsys):
    big = _with_tokenizer(mixtral["fp8"], tmp_path / "big_tokenizer", vocab_size=300)
    assert main(["--model", str(big), "--prompt", "w5 w250"]) == 2
    err = capsys.readouterr().err
    assert "--prompt: the tokenizer's token id 250 is outside the vocabulary (size 128)" in err


def test_bf16_folder_lacking_an_expert_tensor(mixtral, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    folder = shutil.copytree(mixtral["bf16"], tmp_path / "no_expert")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert main(["--model", str(folder), "--prompt-ids", "1"]) == 1
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert f"python -m ktfp8.generate: error: {folder}: cannot load the model: " in last_line
