"""tools/device_check.sh, the prepared run for a lent machine: it parses, names test files that
exist, and leaves no more files in $OUT than the device tool brings back (8)."""
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "device_check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_named_tests_exist():
    named = re.findall(r"tests/\S+\.py", SCRIPT.read_text())
    assert named and all((SCRIPT.parent.parent / path).is_file() for path in named), named


def test_at_most_eight_output_files():
    text = SCRIPT.read_text()
    logs = set(re.findall(r"^step (\w+) ", text, re.M)) | {"machine"}
    bench_outputs = 3 if "-m ktfp8.bench" in text else 0  # bench-results.{txt,json,png}
    assert len(logs) + bench_outputs <= 8, logs
