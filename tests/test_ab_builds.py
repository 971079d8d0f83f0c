"""tools/ab_builds.py: two builds in one process, each its own compiled module, and bad input refused."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "ab_builds.py"


def run_tool(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_same_tree_twice_times_two_distinct_builds():
    # A/A on a small layer: the tool asserts that the two copies load distinct compiled modules
    done = run_tool(ROOT, ROOT, "--tokens", 16, "--rounds", 2, "--threads", 1, "--layer", "8,2,256,128",
                    "--format", "fp8_per_channel")
    assert done.returncode == 0, done.stderr
    m = re.search(r"old ([\d.]+) ms  new ([\d.]+) ms  new/old ([\d.]+)", done.stdout)
    assert m, done.stdout
    old, new, ratio = map(float, m.groups())
    assert old > 0 and new > 0 and 0.2 < ratio < 5


@pytest.mark.parametrize("args, message", [
    (["{tmp}", "{root}"], "holds no ktfp8 package"),
    (["{root}", "{unbuilt}"], "is not built"),
    (["{root}", "{root}", "--layer", "8,9,256,128"], "top_k <= E"),
    (["{root}", "{root}", "--layer", "big"], "--layer takes"),
    (["{root}", "{root}", "--rounds", "0"], "expected a positive integer"),
])
def test_bad_input_is_refused_with_the_reason(tmp_path, args, message):
    unbuilt = tmp_path / "unbuilt"
    (unbuilt / "ktfp8" / "_native").mkdir(parents=True)
    (unbuilt / "ktfp8" / "__init__.py").write_text("")
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_tool(*(a.format(tmp=empty, root=ROOT, unbuilt=unbuilt) for a in args))
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
