"""tools/fp8_perchannel_moe_example.py runs as is and checks itself against float64."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_example_runs_and_matches_the_reference():
    proc = subprocess.run([sys.executable, "tools/fp8_perchannel_moe_example.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("OK")
    nmse = float(proc.stdout.split("NMSE vs float64 reference:")[1].split()[0])
    assert nmse < 2e-5


def test_example_help_describes_it_and_does_not_run_it():
    """--help (or any argument) ran the whole example: it takes none."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "tools/fp8_perchannel_moe_example.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "FP8 per-channel MoE, configured the way" in proc.stdout
    assert "NMSE" not in proc.stdout
    proc = subprocess.run([sys.executable, "tools/fp8_perchannel_moe_example.py", "--tokens", "4"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "unrecognized arguments: --tokens 4" in proc.stderr and not proc.stdout


def test_readme_quick_start_runs_as_written():
    """The README's Quick start, pasted into Python as it stands: it defines what it uses and runs."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python", readme.index("## Quick start")) + len("```python")
    code = readme[start:readme.index("```", start)]
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    backend, nbytes = proc.stdout.split()
    assert backend in ("amx", "avx512_bf16", "avx512", "avx2", "reference") and int(nbytes) > 64 * 3 * 2048 * 768
