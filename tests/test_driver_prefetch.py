"""The MoE driver's software prefetches are in its machine code.

GCC deletes every call to a static function that only prefetches: it finds the function "looping
pure" (__builtin_prefetch has no effect it models), and the call's result is unused.  So it did with
the driver's prefetch_tile from its start until 2026-12-06, and what was measured for it timed nothing.
Compiled as setup.py compiles it, the driver must hold what its source asks for: prefetcht0 for each
job's head lines and scales (prefetch_tile), prefetcht1 for the heads of a stream that starts cold
(prefetch_cold_heads)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "ktfp8" / "_native" / "moe_driver.c"


def package_cflags():
    """setup.py's BASE_CFLAGS, as tools/isa_flags.sh reads them for the timing tools."""
    out = subprocess.run(["bash", "-c", f'source "{ROOT}/tools/isa_flags.sh" && package_cflags'],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on this machine (setup.py builds with it)")
def test_the_compiled_driver_holds_its_prefetches():
    asm = subprocess.run(["gcc", *package_cflags(), "-I", str(ROOT / "include"), "-S", "-o", "-", str(DRIVER)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    counts = {hint: len(re.findall(rf"^\s*{hint}\s", asm, re.MULTILINE)) for hint in ("prefetcht0", "prefetcht1")}
    assert counts["prefetcht0"] > 0, f"prefetch_tile's prefetches were compiled out: {counts}"
    assert counts["prefetcht1"] > 0, f"prefetch_cold_heads' prefetches were compiled out: {counts}"
