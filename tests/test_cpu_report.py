"""`python -m ktfp8.cpu` / tools/check_cpu_features.py: the same report, from CPUID, exit status 0."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ktfp8
from ktfp8 import backends, cpu

ROOT = Path(__file__).resolve().parent.parent


def run(*args, env=None):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_module_and_tool_print_the_same_report():
    text = run("-m", "ktfp8.cpu")
    assert text == run("tools/check_cpu_features.py")
    for flag in ("avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
                 "avx512_vbmi", "amx_tile", "amx_bf16"):
        assert any(line.strip()[2:].strip() == flag for line in text.splitlines()), flag
    assert f"Usable backends (best first): {', '.join(ktfp8.available_backends())}" in text
    assert f"Compiled variants: {', '.join(ktfp8.compiled_variants())}" in text
    assert text.rstrip().splitlines()[-1] == cpu.report()["verdict"]


def test_json_report_agrees_with_cpuid():
    r = json.loads(run("-m", "ktfp8.cpu", "--json"))
    f = ktfp8.cpu_features()
    assert r["flags"]["avx2"] == bool(f["avx2"]) and r["flags"]["avx512f"] == bool(f["avx512f"])
    assert r["usable_backends"] == ktfp8.available_backends()
    assert r["compiled_variants"] == backends.compiled_variants()
    assert r["threads"]["affinity"] == len(os.sched_getaffinity(0))
    assert r["threads"]["affinity_cores"] == backends.affinity_cores() <= r["threads"]["affinity"]
    assert r["threads"]["default"] == min(r["threads"]["affinity_cores"],
                                          math.ceil(r["threads"]["cgroup_cpu_quota"] or r["threads"]["affinity"]))


@pytest.mark.parametrize("value, line_end, selected", [
    ("3", "; this environment sets 3", 3),
    ("abc", "; MoE() refuses this environment's count: KTFP8_NUM_THREADS='abc' is not an integer",
     "none: KTFP8_NUM_THREADS='abc' is not an integer"),
])
def test_the_thread_count_this_environment_sets(value, line_end, selected):
    """What KTFP8_NUM_THREADS makes of MoE()'s thread count, or why MoE() refuses it: the report said
    nothing, and a typo only surfaced at the first MoE."""
    env = {**os.environ, "KTFP8_NUM_THREADS": value}
    lines = [line for line in run("-m", "ktfp8.cpu", env=env).splitlines() if line.startswith("Threads")]
    assert len(lines) == 1 and lines[0].endswith(line_end)
    assert json.loads(run("-m", "ktfp8.cpu", "--json", env=env))["threads"]["selected"] == selected


def test_a_stdout_without_unicode_gets_ascii_marks():
    """PYTHONIOENCODING=ascii (a pipe or terminal that cannot take the check marks) used to end in a
    UnicodeEncodeError; the same report comes out with words for the marks, the JSON with escapes."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    text = run("-m", "ktfp8.cpu", env=env)
    f = ktfp8.cpu_features()
    assert text.isascii()
    assert f"  {'yes' if f['avx2'] else 'no '} avx2\n" in text
    assert f"  {'yes' if f['avx512f'] else 'no '} avx512f\n" in text
    r = json.loads(run("-m", "ktfp8.cpu", "--json", env=env))
    assert r["verdict"] == cpu.report()["verdict"] and r["flags"]["avx2"] == bool(f["avx2"])


def test_verdict_names_what_is_missing(monkeypatch):
    monkeypatch.delenv("KTFP8_BACKEND", raising=False)
    r = cpu.report()
    f = ktfp8.cpu_features()
    full = all(f[k] for k in ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vbmi")) and f["os_avx512"]
    if full:
        assert r["verdict"] == "✅ Your CPU supports full AVX512 (F/BF16/VBMI) – FP8 MoE will work!"
    else:
        assert "lacks" in r["verdict"] and f"'{ktfp8.available_backends()[0]}' fallback" in r["verdict"]
        for name in ("avx512f", "avx512_bf16", "avx512_vbmi"):
            assert (name in r["verdict"]) == (not f[name])


def test_verdict_on_a_full_avx512_cpu_whose_build_lacks_the_native_kernels(monkeypatch):
    """Every flag the native level needs, but no avx512_bf16 / amx variant usable (a build with
    KTFP8_ENABLE_AVX512_BF16=OFF): the verdict used to promise the full path while MoE ran a fallback."""
    monkeypatch.delenv("KTFP8_BACKEND", raising=False)
    needs, _ = backends.isa_levels()[cpu.NATIVE_FP8_LEVEL]
    full = {**ktfp8.cpu_features(), **dict.fromkeys(needs, 1)}
    monkeypatch.setattr(backends, "cpu_features", lambda: full)
    monkeypatch.setattr(backends, "available_backends", lambda: ["avx2", "reference"])
    monkeypatch.setattr(backends, "resolve_backend", lambda name=None: "avx2")
    verdict = cpu.report()["verdict"]
    assert not verdict.startswith("✅") and "FP8 MoE will work!" not in verdict
    assert "'avx2' fallback" in verdict and "build" in verdict and "lacks" not in verdict


def test_verdict_says_what_a_forced_backend_changes(monkeypatch):
    """$KTFP8_BACKEND decides what MoE() runs: the verdict says so, where it differs from the default."""
    monkeypatch.delenv("KTFP8_BACKEND", raising=False)
    plain = cpu.report()["verdict"]
    monkeypatch.setenv("KTFP8_BACKEND", "reference")
    assert cpu.report()["verdict"] == plain + " $KTFP8_BACKEND forces 'reference' instead."
    monkeypatch.setenv("KTFP8_BACKEND", ktfp8.available_backends()[0])
    assert cpu.report()["verdict"] == plain
    monkeypatch.setenv("KTFP8_BACKEND", "no_such_kernel")
    assert cpu.report()["verdict"].startswith(plain + " But MoE() refuses $KTFP8_BACKEND now: "
                                              "KTFP8_BACKEND='no_such_kernel' is not compiled")


def _cpuinfo_first(field):
    """The first processor's `field` in /proc/cpuinfo (the kernel's own decoding of CPUID leaf 1)."""
    with open("/proc/cpuinfo") as info:
        for line in info:
            name, _, value = line.partition(":")
            if name.strip() == field:
                return value.strip()
    pytest.skip(f"/proc/cpuinfo has no {field!r} line")


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="Linux's /proc/cpuinfo is the oracle")
def test_family_model_stepping_agree_with_the_kernel():
    r = cpu.report()
    assert (r["family"], r["model"], r["stepping"]) == \
        tuple(int(_cpuinfo_first(f)) for f in ("cpu family", "model", "stepping"))
    assert r["vendor"] == _cpuinfo_first("vendor_id")
    first_line = run("-m", "ktfp8.cpu").splitlines()[0]
    assert first_line == f"CPU: {r['cpu']} ({r['vendor']}, family {r['family']}, model {r['model']}, " \
                         f"stepping {r['stepping']})"
    assert set(r["flags"]).isdisjoint(("family", "model", "stepping", "vendor", "brand"))


def _run_with_stdout(stdout, *args, shell_redirect=""):
    """(exit status, stderr) of the report with this stdout (a file object, or a shell redirection)."""
    cmd = [sys.executable, *args]
    if shell_redirect:
        cmd = ["sh", "-c", f'exec "$0" "$@" {shell_redirect}', *cmd]
    proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("args", [("-m", "ktfp8.cpu"), ("-m", "ktfp8.cpu", "--json"),
                                  ("tools/check_cpu_features.py",)])
def test_a_reader_that_left_ends_the_report_quietly(args):
    """`python -m ktfp8.cpu | head -0` used to end in a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)                       # the reader is gone before the report is written
    with os.fdopen(write, "w") as pipe:
        status, err = _run_with_stdout(pipe, *args)
    assert status == 1 and err == ""


@pytest.mark.parametrize("redirect, message", [(">&-", "it is closed"), (">/dev/full", "No space left on device")])
@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_a_stdout_it_cannot_write_is_one_line_not_a_traceback(redirect, message, json_flag):
    """A closed stdout (`>&-`) used to be an AttributeError traceback (the text report) or silence with
    status 0 (--json); a full disk an OSError traceback."""
    if redirect == ">/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    status, err = _run_with_stdout(None, "-m", "ktfp8.cpu", *json_flag, shell_redirect=redirect)
    assert status == 1
    assert err == f"python -m ktfp8.cpu: error: cannot write to standard output: {message}\n"
