"""A missing ISA is a fallback, never a SIGILL: the package runs under emulated CPUs that lack
AVX-512 (qemu -cpu Haswell) or AVX2/FMA/F16C too (-cpu SandyBridge), detects that through CPUID,
picks the best backend those CPUs can run, and computes the same codes as this host.

The checks themselves live in tests/qemu_probe.py, run as a subprocess under qemu-x86_64 with this
test's own Python and ktfp8; the host runs the same check functions in-process for comparison."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ktfp8
from ktfp8 import backends

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qemu_probe  # noqa: E402

QEMU = shutil.which("qemu-x86_64")
PROBE = Path(__file__).resolve().parent / "qemu_probe.py"
PACKAGE_ROOT = str(Path(ktfp8.__file__).resolve().parent.parent)  # the ktfp8 this test imported

pytestmark = pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 not found (Debian: apt-get install qemu-user)")


def qemu_version():
    """(major, minor) of qemu-x86_64, or None if it does not say."""
    out = subprocess.run([QEMU, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m[1]), int(m[2])) if m else None


# QEMU's software CPU emulates AVX, AVX2, FMA and F16C from 7.2 on: older ones (Ubuntu 22.04's 6.2) run
# -cpu Haswell and -cpu SandyBridge without them, so Haswell is no AVX2 machine there
EMULATES_AVX = QEMU is not None and (qemu_version() or (0, 0)) >= (7, 2)


def expected_best(cpu):
    """What automatic selection must pick on that CPU model, given what this build compiled."""
    if cpu == "Haswell" and "avx2" in backends.compiled_variants():
        return "avx2"
    return "reference"


@pytest.fixture(scope="module", params=["Haswell", "SandyBridge"])
def probe(request):
    cpu = request.param
    if cpu == "Haswell" and not EMULATES_AVX:
        pytest.skip(f"qemu-x86_64 {qemu_version()} does not emulate AVX2 (QEMU 7.2 and later do)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    env.pop("KTFP8_BACKEND", None)
    proc = subprocess.run([QEMU, "-cpu", cpu, sys.executable, str(PROBE)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, (f"probe under -cpu {cpu} exited with {proc.returncode} (-4 = SIGILL):\n"
                                  f"{proc.stderr[-4000:]}")
    return cpu, json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpuid_reports_the_emulated_cpu(probe):
    cpu, result = probe
    features = result["backends"]["features"]
    assert features["avx512f"] == 0 and features["os_avx512"] == 0
    assert features["avx"] == int(EMULATES_AVX)
    if cpu == "Haswell":
        assert features["avx2"] == features["fma"] == features["f16c"] == 1
    else:
        assert features["avx2"] == features["fma"] == features["f16c"] == 0


def test_selection_falls_back(probe):
    cpu, result = probe
    info = result["backends"]
    assert info["compiled"] == backends.compiled_variants()
    assert info["available"][0] == expected_best(cpu)
    assert info["resolved"] == expected_best(cpu)
    assert info["available"][-1] == "reference"
    assert not any(name.startswith(("avx512", "amx")) for name in info["available"])
    if cpu == "SandyBridge":
        assert info["usable"] == ["reference"]  # the emulated variants need AVX2 underneath


def test_codes_match_the_host(probe):
    cpu, result = probe
    host = qemu_probe.check_codec()
    expected = host["reference"]
    assert all(outputs == expected for outputs in host.values()), "host variants disagree"
    ran = result["codec"]
    assert set(ran) == set(result["backends"]["usable"]) | {"default"}
    for variant, outputs in ran.items():
        assert outputs == expected, f"{variant} under -cpu {cpu} differs from the host"


def test_moe_forward_matches_the_fp64_oracle(probe):
    cpu, result = probe
    moe = result["moe"]
    assert moe.pop("default") == expected_best(cpu)
    assert set(moe) == set(result["backends"]["usable"])
    for variant, error in moe.items():
        assert error <= 2e-5, f"{variant} under -cpu {cpu}: NMSE {error:.2e}"


def test_read_probe_reads_every_step_once(probe):
    cpu, result = probe
    host = qemu_probe.check_read_probe()
    words = np.arange(128 * 1001 // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    assert set(host.values()) == {str(int(words.sum(dtype=np.uint64)))}  # wraps modulo 2**64, as the probe
    assert result["read_probe"] == host, f"the read probe under -cpu {cpu} differs from the host"
