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
