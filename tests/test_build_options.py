"""Build options: KTFP8_ENABLE_* / CPUINFER_ENABLE_* = ON | OFF | AUTO decide which ISA units are
compiled, the build says which, and ON with a compiler that cannot do it stops with a clear message.
Each case builds a copy of the sources in a temporary folder."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("Cython", reason="building needs Cython (a build dependency)")


@pytest.fixture()
def source(tmp_path):
    for name in ("ktfp8", "include"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("*.so", "_ext.c", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def build(src, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("KTFP8_", "CPUINFER_"))}
    full.update(env)
    return subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=src, env=full,
                          capture_output=True, text=True, timeout=600)


def test_off_options_leave_units_out(source):
    proc = build(source, KTFP8_ENABLE_AVX512="OFF", CPUINFER_ENABLE_AMX="OFF", KTFP8_ENABLE_EMULATED="OFF")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("ktfp8 build: ISA units compiled:"))
    units = line.rsplit(":", 1)[1].split(",")
    assert [u.strip() for u in units] == ["avx2"]
    variants = subprocess.run([sys.executable, "-c", "import ktfp8; print(ktfp8.compiled_variants())"],
                              cwd=source, capture_output=True, text=True, timeout=120)
    assert variants.stdout.strip() == "['avx2', 'reference']", variants.stderr


def test_on_with_an_unable_compiler_stops_the_build(source, tmp_path_factory):
    # a compiler that refuses the AMX flags, as an old gcc would
    fake = tmp_path_factory.mktemp("cc") / "cc"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -mamx-tile ] && exit 1; done\nexec gcc "$@"\n')
    fake.chmod(0o755)
    proc = build(source, KTFP8_ENABLE_AMX="ON", CC=str(fake))
    assert proc.returncode != 0
    assert "amx was requested (ON) but this compiler does not accept" in proc.stdout + proc.stderr


def test_bad_option_value_is_refused(source):
    proc = build(source, KTFP8_ENABLE_AVX2="sometimes")
    assert proc.returncode != 0
    assert "KTFP8_ENABLE_AVX2='SOMETIMES'; expected ON, OFF or AUTO" in proc.stdout + proc.stderr
