"""The scripts behind the README's measured figures (bench/readme_figures/) still run: each, in its
smallest setting, exits 0 and prints the line its figures are read from.  (bench/expert_parallel.py had
stopped running unnoticed when a function it calls changed; speed itself is not measured here.)"""
import os
import subprocess
import sys

import pytest

import ktfp8

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=120):
    return subprocess.run([sys.executable, os.path.join(REPO, "bench", "readme_figures", script), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_t1_calls():
    proc = _run("t1_calls.py", "--seconds", "0.05", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pass 0 threads 1:" in proc.stdout and "calls/s" in proc.stdout


def test_avx2_precision():
    if "avx2" not in ktfp8.available_backends():
        pytest.skip("no avx2 on this CPU")
    proc = _run("avx2_precision.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("relative error of B's row") == 36


def test_huge_pages():
    proc = _run("huge_pages.py", "--mib", "8", "--rounds", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("huge / 4 KiB median") == 4


def test_op_dispatch():
    pytest.importorskip("transformers")
    proc = _run("op_dispatch.py", "--rounds", "1", "--calls", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the op's dispatch, per round" in proc.stdout


def test_ep_checks():
    pytest.importorskip("torch.distributed")
    proc = _run("ep_checks.py", "--rounds", "1", "--launches", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "input check at T = 512" in proc.stdout
    assert "lost rank (kill" in proc.stdout and "lost rank (stall" in proc.stdout


def test_hf_memory_and_busy_core_say_how_to_call_them():
    proc = _run("hf_memory.py")
    assert proc.returncode == 2 and "hf_memory.py make BF16_FOLDER" in proc.stderr
    proc = subprocess.run(["bash", os.path.join(REPO, "bench", "readme_figures", "busy_core.sh")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "same-session|own-session" in proc.stderr
