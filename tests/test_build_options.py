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
    # an earlier build's test module, in place: EMULATED=OFF must not leave it to be shipped and loaded
    stale = sorted((ROOT / "ktfp8" / "_native").glob("_testing*.so"))
    for so in stale:
        shutil.copy(so, source / "ktfp8" / "_native" / so.name)
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


@pytest.mark.parametrize("var", ["KTFP8_ENABLE_AVX2", "CPUINFER_ENABLE_AVX2"])
def test_bad_option_value_is_refused_naming_the_variable_as_set(source, var):
    """KTransformers' spelling was reported as KTFP8_ENABLE_..., a variable the user never set, and the
    value upper-cased."""
    proc = build(source, **{var: "sometimes"})
    assert proc.returncode != 0
    assert f"{var}='sometimes'; expected ON, OFF or AUTO" in proc.stdout + proc.stderr


def clang_with_openmp(tmp_path):
    """A clang on PATH that builds and links an OpenMP program, or None."""
    probe = tmp_path / "omp.c"
    probe.write_text("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
    for name in ["clang"] + [f"clang-{v}" for v in range(21, 13, -1)]:
        cc = shutil.which(name)
        if cc and subprocess.run([cc, "-fopenmp", str(probe), "-o", str(tmp_path / "omp")],
                                 capture_output=True, timeout=120).returncode == 0:
            return cc
    return None


def test_a_clang_build_passes_the_tests_that_differ_by_compiler(source, tmp_path_factory):
    """A clang build links LLVM's libomp and lowers SIMDe's bf16 vectors its own way: its test module
    imports (clang once called __truncsfbf2, which libgcc before GCC 13 lacks), its emulated
    vdpbf16ps keeps the SDM's bits, its OpenMP threads keep the CPUs numa.pin gives them (without a
    word from a runtime that started before ktfp8 loaded), and a worker forked after a team runs."""
    cc = clang_with_openmp(tmp_path_factory.mktemp("probe"))
    if cc is None:
        pytest.skip("no clang with OpenMP (libomp) on this machine")
    proc = build(source, CC=cc, LDSHARED=f"{cc} -shared")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tests = [str(ROOT / "tests" / name)
             for name in ("test_vdpbf16ps_emulation.py", "test_tile_pair.py", "test_packing.py", "test_numa.py",
                          "test_concurrency.py")]
    env = {k: v for k, v in os.environ.items() if k not in ("KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=source,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    # another library's libomp started before ktfp8 loads: ktfp8 leaves it as it is, and says nothing
    started_first = ("import ctypes, ctypes.util, numpy as np\n"
                     "ctypes.CDLL(ctypes.util.find_library('omp')).omp_get_num_procs()\n"
                     "import ktfp8\n"
                     "cfg = ktfp8.MoeConfig(expert_num=4, num_experts_per_tok=2, hidden_size=64, intermediate_size=32)\n"
                     "w = np.ones((4, 32, 64), np.float32)\n"
                     "moe = ktfp8.MoE(cfg, ktfp8.quantize_experts(w, w, np.ones((4, 64, 32), np.float32), cfg.quant_config))\n"
                     "moe(np.ones((3, 64), np.float32), np.zeros((3, 2), np.int64), np.ones((3, 2), np.float32))\n"
                     "print(ktfp8.__file__)\n")
    proc = subprocess.run([sys.executable, "-c", started_first], cwd=source, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and str(source) in proc.stdout, proc.stderr[-2000:]
    assert "OMP:" not in proc.stderr, proc.stderr
