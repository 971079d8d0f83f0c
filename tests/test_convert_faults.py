"""python -m ktfp8.convert under faults: kill -9 at random points (also while replacing an existing
output with --overwrite), a full disk (a 2 MB tmpfs), a read-only output folder, an input shard
truncated mid-tensor before and during the run.  After each: the input is unchanged (hashes), no
folder looks complete unless it is, and a rerun with --overwrite succeeds with the exact output of an
undisturbed run.  (test_convert.py covers SIGINT/SIGTERM and a file-size limit.)

KTFP8_FUZZ_LONG=1 tries 25 kill points instead of 5."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fuzz_settings import LONG
from hf_models import folder_digest
from ktfp8.convert import main as convert
from ktfp8.loader import INDEX_NAME, FP8SafeTensorLoader
from ktfp8.safetensors_io import SafetensorsFile, write_file

REPO = Path(__file__).resolve().parents[1]
KILL_POINTS = 25 if LONG else 5


def _write_input(folder, experts, rows, cols, shards=2):
    """A bf16 MoE checkpoint of `experts` experts ([rows, cols] gate/up, [cols, rows] down) in
    `shards` files with an index, plus a config.json and a tokenizer file to copy."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    block = rng.standard_normal((rows, cols), dtype=np.float32).astype(ml_dtypes.bfloat16)
    shapes = {"gate": block, "up": block[::-1].copy(), "down": block.T.copy()}
    names = [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in shapes]
    weight_map = {}
    per_shard = -(-len(names) // shards)
    for s in range(shards):
        file_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s * per_shard:(s + 1) * per_shard]
        write_file(folder / file_name, {n: ("BF16", shapes[n.split(".")[-2][:-5]]) for n in part},
                   metadata={"format": "pt"})
        weight_map.update({n: file_name for n in part})
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": experts, "num_experts_per_tok": 2, "hidden_size": cols,
        "moe_intermediate_size": rows}))
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    return folder


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    """~48 MB of bf16 experts in 2 shards: a one-thread conversion lasts about a second or two."""
    return _write_input(tmp_path_factory.mktemp("medium") / "in", experts=16, rows=512, cols=1024)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """~6 MB of bf16 experts: its FP8 output (~3 MB) does not fit a 2 MB disk."""
    return _write_input(tmp_path_factory.mktemp("small") / "in", experts=8, rows=256, cols=512)


@pytest.fixture(scope="module")
def reference_output(medium, tmp_path_factory):
    """The undisturbed conversion of `medium`: what every rerun must reproduce byte for byte."""
    out = tmp_path_factory.mktemp("ref") / "out"
    assert convert(_args(medium, out)) == 0
    return _contents(out)


def _args(src, dst, *extra):
    return ["--input-type", "bf16", "--input-path", str(src), "--output-path", str(dst), "--max-shard-size",
            "8MB", *extra]


def _start(src, dst, *extra, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "ktfp8.convert", *_args(src, dst, "--threads", "1", *extra)],
                            cwd=REPO, **kwargs)


def _contents(folder):
    """{file name: bytes} of a finished output (sorted, hidden files excluded)."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def is_complete(folder):
    """A finished checkpoint: config.json, the index (or a single model.safetensors), every shard it
    lists present and parseable with every listed tensor, and no in-progress marker."""
    folder = Path(folder)
    try:
        json.loads((folder / "config.json").read_text())
        if (folder / INDEX_NAME).exists():
            weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
        else:
            with SafetensorsFile(folder / "model.safetensors") as f:
                weight_map = {n: "model.safetensors" for n in f.tensors}
        for file_name in set(weight_map.values()):
            with SafetensorsFile(folder / file_name) as f:
                if any(fn == file_name and n not in f for n, fn in weight_map.items()):
                    return False
        return bool(weight_map) and not (folder / "KTFP8_CONVERSION_IN_PROGRESS").exists()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def looks_complete(folder):
    """What a user or another engine would take for a checkpoint: config.json next to weights."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors*"))


def _check_nothing_looks_complete_unless_it_is(parent):
    for path in Path(parent).rglob("*"):
        if path.is_dir() and looks_complete(path) and not is_complete(path):
            # the one legitimate in-between state: a partial folder whose run was killed after
            # config.json and before the marker went; it is hidden and still marked
            assert path.name.startswith(".") and (path / "KTFP8_CONVERSION_IN_PROGRESS").exists(), path


def _wait_for_partial(proc, parent, name, timeout=60):
    deadline = time.monotonic() + timeout
    while not list(parent.glob(f".{name}.ktfp8-partial-*")):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _phases(medium, tmp_path):
    """(seconds until the partial folder appears, seconds from then to the end) of one run."""
    start = time.monotonic()
    proc = _start(medium, tmp_path / "timing", stderr=subprocess.DEVNULL)
    assert _wait_for_partial(proc, tmp_path, "timing")
    seen = time.monotonic()
    assert proc.wait(timeout=300) == 0
    shutil.rmtree(tmp_path / "timing")
    return seen - start, time.monotonic() - seen


def _state(tmp_path, dst):
    """Where the kill landed, judged by what it left."""
    partial = list(tmp_path.glob(f".{dst.name}.ktfp8-partial-*"))
    if dst.exists() and is_complete(dst) and not partial:
        return "after publishing"
    if not partial:
        return "before the partial folder"
    p = partial[0]
    if not (p / "KTFP8_CONVERSION_IN_PROGRESS").exists():
        return "between finishing and publishing"
    if (p / "config.json").exists():
        return "writing config.json"
    if (p / INDEX_NAME).exists() or (p / "tokenizer.json").exists():
        return "copying files / writing the index"
    return "writing shards" if list(p.glob("*.safetensors")) else "creating the partial folder"


def test_kill_9_at_random_points(medium, reference_output, tmp_path):
    """SIGKILL at random points spread over the run (start-up, shard writes, copying, index and
    config, the final rename), every other one while --overwrite replaces a finished output."""
    before = folder_digest(medium)
    startup, work = _phases(medium, tmp_path)
    rng = random.Random(7)
    states = []
    for i in range(KILL_POINTS):
        dst = tmp_path / f"out{i}"
        replacing = i % 2 == 1
        if replacing:
            assert convert(_args(medium, dst)) == 0
        proc = _start(medium, dst, *(["--overwrite"] if replacing else []), stderr=subprocess.DEVNULL)
        if i % 5 == 4:                                  # one in five: during start-up
            time.sleep(rng.uniform(0, startup))
        elif _wait_for_partial(proc, tmp_path, dst.name):
            time.sleep(rng.uniform(0, work * 1.1))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        states.append(_state(tmp_path, dst))
        assert folder_digest(medium) == before
        _check_nothing_looks_complete_unless_it_is(tmp_path)
        if dst.exists() and any(dst.iterdir()):
            assert is_complete(dst), f"kill {i} left an incomplete {dst}"
            if not replacing or states[-1] == "after publishing":
                assert _contents(dst) == reference_output
        assert convert(_args(medium, dst, "--overwrite")) == 0
        assert is_complete(dst) and _contents(dst) == reference_output
        assert not list(tmp_path.glob(f".{dst.name}.ktfp8-*")), "the rerun left a hidden folder behind"
    print(f"{KILL_POINTS} kill points: {states}; start-up {startup:.2f} s, work {work:.2f} s")


@pytest.fixture
def mount_point(tmp_path):
    """Mounts a tmpfs with the given options at a fresh folder; unmounts after the test."""
    mounted = []

    def mount(name, options):
        path = tmp_path / name
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full(small, mount_point, tmp_path, capsys):
    before = folder_digest(small)
    disk = mount_point("disk", "size=2m")
    dst = disk / "out"
    assert convert(_args(small, dst)) == 1
    assert f"No space left on device: '{disk}/.out.ktfp8-partial-" in capsys.readouterr().err   # where
    assert list(disk.iterdir()) == []            # the partial output was removed: the space is free again
    assert folder_digest(small) == before
    # the same disk with room to spare: the rerun (with --overwrite) succeeds
    subprocess.run(["mount", "-o", "remount,size=32m", str(disk)], check=True)
    assert convert(_args(small, dst, "--overwrite")) == 0
    assert is_complete(dst) and FP8SafeTensorLoader(dst).load_experts(0).expert_num == 8


def test_read_only_output(small, mount_point, tmp_path, capsys):
    before = folder_digest(small)
    if os.geteuid() == 0:                        # root writes through permission bits: use a read-only mount
        parent = mount_point("ro", "ro,size=1m")
    else:
        parent = tmp_path / "ro"
        parent.mkdir()
        parent.chmod(0o555)
    try:
        assert convert(_args(small, parent / "out")) == 1
        err = capsys.readouterr().err
        assert "Read-only file system" in err or "Permission denied" in err, err
        assert list(parent.iterdir()) == []
    finally:
        if os.geteuid() != 0:
            parent.chmod(0o755)
    assert folder_digest(small) == before
    assert convert(_args(small, tmp_path / "rw", "--overwrite")) == 0 and is_complete(tmp_path / "rw")


def test_input_shard_truncated_mid_tensor(small, tmp_path, capsys):
    src = Path(shutil.copytree(small, tmp_path / "in"))
    shard = sorted(src.glob("*.safetensors"))[0]
    with SafetensorsFile(shard) as f:
        info = next(iter(f.tensors.values()))
    raw = shard.read_bytes()
    shard.write_bytes(raw[:info.start + info.nbytes // 2])    # cut inside the first tensor
    before = folder_digest(src)
    assert convert(_args(src, tmp_path / "out")) == 1
    assert "truncated" in capsys.readouterr().err
    assert folder_digest(src) == before
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    shard.write_bytes(raw)                                     # repaired input: the rerun succeeds
    assert convert(_args(src, tmp_path / "out", "--overwrite")) == 0 and is_complete(tmp_path / "out")


def test_input_shard_truncated_during_the_run(medium, tmp_path):
    """The input shrinks under a running conversion (after its headers were checked): a clear error,
    not a crash (tensors are read with pread, never through a memory map that would SIGBUS)."""
    src = Path(shutil.copytree(medium, tmp_path / "in"))
    last = sorted(src.glob("*.safetensors"))[-1]
    proc = _start(src, tmp_path / "out", stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.ktfp8-partial-*/*.safetensors")):
        assert proc.poll() is None and time.monotonic() < deadline, "the conversion ended too early"
        time.sleep(0.005)
    os.truncate(last, last.stat().st_size // 2)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the conversion had read the shard before it was truncated")
    assert proc.returncode == 1, err
    assert "truncated while reading tensor" in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


_KILLED_WHILE_REMOVING_OLD = r"""
import os, shutil, signal, sys
from pathlib import Path
import ktfp8.convert as c

real_rmtree = shutil.rmtree

def rmtree_then_die(path, *args, **kwargs):
    if ".ktfp8-replaced-" in str(path):          # the previous output, moved aside by --overwrite
        shards = sorted(Path(path).glob("*.safetensors"))
        for shard in shards[: len(shards) // 2 + 1]:
            shard.unlink()                       # part of it deleted, then the process dies
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rmtree(path, *args, **kwargs)

c.shutil.rmtree = rmtree_then_die
sys.exit(c.main(sys.argv[1:]))
"""


def test_kill_9_while_the_replaced_output_is_removed(medium, reference_output, tmp_path):
    """--overwrite moves the old output aside, renames the new one into place, then deletes the old
    one; a kill during that delete must not leave a half-deleted folder that looks complete, and the
    next run removes the remains."""
    dst = tmp_path / "out"
    assert convert(_args(medium, dst)) == 0
    proc = subprocess.run([sys.executable, "-c", _KILLED_WHILE_REMOVING_OLD, *_args(medium, dst, "--overwrite")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert is_complete(dst) and _contents(dst) == reference_output
    _check_nothing_looks_complete_unless_it_is(tmp_path)
    assert convert(_args(medium, dst, "--overwrite")) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
