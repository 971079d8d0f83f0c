"""What a user installs from: the sdist holds every file the build reads and none that a build makes,
and a wheel built from that sdist alone imports and runs outside the source tree.
The sdist comes from a copy of the sources in a temporary folder (setup.py writes its egg-info
beside itself); the wheel is built without build isolation (this venv's setuptools, Cython and NumPy:
no index is asked) and without the test-only emulated variants, to keep it under a minute."""
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("Cython", reason="building needs Cython (a build dependency)")
GENERATED = ("_ext.c", "_testing.c")  # what Cython writes from the .pyx seams
SOURCES = ("ktfp8", "include")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KTFP8_", "CPUINFER_", "PYTHONPATH"))}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def copied_tree(tmp_path_factory):
    """The sources as a checkout holds them: no compiled modules, no generated C, no caches."""
    tree = tmp_path_factory.mktemp("tree")
    for name in SOURCES:
        shutil.copytree(ROOT / name, tree / name,
                        ignore=shutil.ignore_patterns("*.so", *GENERATED, "__pycache__", "*.egg-info"))
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    return tree


@pytest.fixture(scope="module")
def sdist(copied_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("sdist")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(out)], cwd=copied_tree,
                          env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (archive,) = out.glob("ktfp8-*.tar.gz")
    return archive


def test_an_unbuilt_checkout_says_why_it_cannot_be_imported(copied_tree):
    """`pip install .`, then Python in that folder: the checkout shadows the installed copy, and the
    import said only "cannot import name '_ext' from 'ktfp8._native'"."""
    proc = subprocess.run([sys.executable, "-c", "import ktfp8"], cwd=copied_tree, env=_clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "ImportError: ktfp8's compiled kernels are not built in" in proc.stderr
    assert "Python is importing ktfp8 from its source folder" in proc.stderr


def test_sdist_holds_every_source_and_nothing_generated(copied_tree, sdist):
    with tarfile.open(sdist) as tar:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    sources = {p.relative_to(copied_tree).as_posix() for name in SOURCES for p in (copied_tree / name).rglob("*")
               if p.is_file() and not p.name.endswith(GENERATED)}  # setup.py's cythonize wrote them there
    assert "include/ktfp8/variants.def" in sources  # the ISA table setup.py reads
    assert sorted(sources - names) == []
    assert not [n for n in names if n.endswith(GENERATED)], "Cython's output belongs to the build, not the sdist"
    assert not [n for n in names if n.startswith("tests/")], "the tests run from a checkout"


def test_wheel_built_from_the_sdist_runs_outside_the_source_tree(sdist, tmp_path):
    wheels = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                           "-q", "-w", str(wheels), str(sdist)],
                          cwd=tmp_path, env=_clean_env(KTFP8_ENABLE_EMULATED="OFF"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = wheels.glob("ktfp8-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        sources = [n for n in z.namelist() if n.endswith((".c", ".pyx", ".pxi", ".h"))]
        assert sources == [], "a wheel runs its compiled extensions: the sources belong to the sdist"
        z.extractall(site)
    # every backend this CPU runs against the portable reference, from the wheel's own modules
    script = """
import numpy as np, ktfp8
assert ktfp8.__file__.startswith(SITE), ktfp8.__file__
E, H, I = 8, 136, 72
rng = np.random.default_rng(0)
cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=2, hidden_size=H, intermediate_size=I)
cfg.quant_config.method, cfg.quant_config.per_channel, cfg.quant_config.group_size = "FP8", True, 0
gate, up, down = (rng.standard_normal(shape).astype(np.float32) for shape in ((E, I, H), (E, I, H), (E, H, I)))
experts = ktfp8.quantize_experts(gate, up, down, cfg.quant_config)
x = rng.standard_normal((5, H)).astype(np.float32)
ids, w = ktfp8.route(rng.standard_normal((5, E)).astype(np.float32), cfg)
want = ktfp8.MoE(cfg, experts, backend="reference")(x, ids, w)
for b in ktfp8.available_backends():
    y = ktfp8.MoE(cfg, experts, backend=b)(x, ids, w)
    err = float(np.abs(y - want).max() / np.abs(want).max())
    assert err < 1e-2, (b, err)
    print(b, err)
""".replace("SITE", repr(str(site)))
    env = _clean_env(PYTHONPATH=str(site))
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "reference 0.0" in run.stdout
    cpu = subprocess.run([sys.executable, "-m", "ktfp8.cpu"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert cpu.returncode == 0 and "Selected backend:" in cpu.stdout, cpu.stderr[-3000:]


def test_the_package_needs_no_newer_python_than_it_declares():
    """pyproject.toml's requires-python against what the package's code uses: vermin reads its syntax and
    standard-library calls (math.lcm sets 3.9 today).  The machines here run a newer Python than the
    oldest declared one, so nothing else would notice code that needs a newer one."""
    pytest.importorskip("vermin", reason="vermin is a test dependency")
    oldest = re.search(r'^requires-python = ">=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    proc = subprocess.run([sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", "--no-tips",
                           "--violations", f"-t={oldest}-", "ktfp8", "setup.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "i686"])
def test_a_build_for_another_cpu_says_why_it_stops(machine):
    """On an ARM server the build used to end in a compiler error about emmintrin.h."""
    code = (f"import platform, runpy, sys; platform.machine = lambda: {machine!r}; "
            "sys.argv = ['setup.py', '--version']; runpy.run_path('setup.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"build for x86-64 CPUs only; this is a {machine} machine with a 64-bit Python" in proc.stderr


def test_a_build_with_msvc_says_why_it_stops():
    """pip on Windows compiles with MSVC, which cannot read the GNU C sources: one sentence, not hundreds
    of compiler errors."""
    import runpy
    from types import SimpleNamespace

    from setuptools import Distribution
    build_native = runpy.run_path(str(ROOT / "setup.py"))["BuildNative"]
    cmd = build_native(Distribution())
    cmd.compiler = SimpleNamespace(compiler_type="msvc")
    with pytest.raises(SystemExit, match="build with GCC or clang only, not MSVC; on Windows, install it under "
                                         "WSL2"):
        cmd.plan()
