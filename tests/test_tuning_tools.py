"""tools/kernel_ab and tools/amx_limits, the stand-alone timing tools of docs/tuning-notes.md: they build
against this tree's headers with the ISA flags setup.py reads from variants.def, on every machine, refuse
bad arguments, and where the CPU can run them (the avx2 kernel on every CPU the suite runs on with AVX2),
kernel_ab's two builds are checked against each other before anything is timed."""
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

import ktfp8

ROOT = Path(__file__).resolve().parent.parent
KERNEL_AB = ROOT / "tools" / "kernel_ab" / "kernel_ab.sh"
AMX_LIMITS = ROOT / "tools" / "amx_limits" / "amx_limits.sh"
NATIVE = ROOT / "ktfp8" / "_native"
HAS_AMX = "amx" in ktfp8.available_backends()
HAS_BF16 = "avx512_bf16" in ktfp8.available_backends()
HAS_AVX2 = "avx2" in ktfp8.available_backends()
AB_LINE = re.compile(r"hot K=256 m=\s*(\d+): old\s+([\d.]+) us  new\s+([\d.]+) us .* new/old ([\d.]+)")
# a timed line's scales (" block-wise" or "") and m
TIMED_SCALES_M = re.compile(r"hot( block-wise)? K=256 m=\s*(\d+): old\s+[\d.]+ us  new\s+[\d.]+ us")


def run(*args):
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=300)


def isa_flags(unit):
    """tools/isa_flags.sh's answer for one level, as the tools' scripts source it."""
    return subprocess.run(["bash", "-c", f'source "{ROOT}/tools/isa_flags.sh" && isa_flags "$0"', unit],
                          capture_output=True, text=True, timeout=60)


def test_isa_flags_agree_with_setup_py_for_every_level():
    # setup.py's own parse of variants.def is the oracle (importing it builds nothing)
    spec = importlib.util.spec_from_file_location("ktfp8_setup", ROOT / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)
    levels = setup_py.isa_levels()
    assert {"amx", "avx512bf16", "avx512", "avx2"} <= set(levels)
    for unit, (flags, _options, _twin) in levels.items():
        done = isa_flags(unit)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == flags, unit
    missing = isa_flags("avx1024")
    assert missing.returncode == 1
    assert "no level 'avx1024'" in missing.stderr


def test_amx_limits_builds_and_refuses_an_unknown_mix():
    done = run(AMX_LIMITS, 128, "vpermt2b")
    assert done.returncode == 2, done.stderr  # 1 would be a failed build
    assert "mix | permute | shift | add" in done.stderr


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX tiles")
def test_amx_limits_times_every_piece_of_the_tile_pair():
    done = run(AMX_LIMITS, 16, "shift")
    assert done.returncode == 0, done.stderr
    assert "16 vector instructions per slab (shift)" in done.stdout
    times = dict(re.findall(r"^  (\S+(?: A1| L1)?)\s+([\d.]+) us", done.stdout, re.M))
    assert set(times) == {"peak", "passes", "passes A1", "convert", "passes+cvt", "A1+cvt", "passes+alu",
                          "alu", "peak+alu", "loads", "loads L1"}
    assert all(float(t) > 0 for t in times.values())
    assert re.search(r"^  peak .* 100 % of peak$", done.stdout, re.M)


@pytest.mark.parametrize("level, unit", [(None, "moe_avx512bf16.c"), ("amx", "moe_amx.c"),
                                         ("avx512", "moe_avx512.c"), ("avx2", "moe_avx2.c")])
def test_kernel_ab_builds_every_level_and_refuses_an_unknown_mode(level, unit):
    # the build links (moe_avx512.c has no tile_matmul2: its tiles are timed one after the other), and
    # the usage check comes before any instruction of the level runs
    isa = ["--isa", level] if level else []
    done = run(KERNEL_AB, *isa, NATIVE / unit, NATIVE / unit, "warm", 256, 1)
    assert done.returncode == 2, done.stderr
    assert "usage" in done.stderr


def test_kernel_ab_refuses_an_unknown_level():
    unit = NATIVE / "moe_avx2.c"
    done = run(KERNEL_AB, "--isa", "avx1024", unit, unit, "hot", 256, 1)
    assert done.returncode == 2
    assert "no level 'avx1024'" in done.stderr


def altered_jobs_build(unit, tmp_path, name, change):
    """A build of `unit` whose tile_matmul2 runs on copies a, b of its two jobs after the C statements
    `change` (lines) altered them."""
    bad = tmp_path / f"{name}.c"
    bad.write_text(f'#include "{unit}"\n'
                   f"static void {name}(const ktfp8_tile_job *j0, const ktfp8_tile_job *j1) {{\n"
                   "    ktfp8_tile_job a = *j0, b = *j1;\n" +
                   "".join(f"    {line}\n" for line in change) +
                   "    tile_matmul2(&a, &b);\n"
                   "}\n"
                   f"#define tile_matmul2 {name}\n")
    return bad


def swapped_outputs_build(unit, tmp_path):
    """A build of `unit` whose tile_matmul2 writes the first job's sums into the second job's output
    and the reverse: fast as the original, wrong for every m."""
    return altered_jobs_build(unit, tmp_path, "swapped", ["a.c = j1->c;", "b.c = j0->c;"])


@pytest.mark.skipif(not HAS_BF16, reason="needs AVX-512 BF16 and VBMI")
def test_kernel_ab_times_builds_that_agree_and_refuses_one_that_does_not(tmp_path):
    old = NATIVE / "moe_avx512bf16.c"
    if HAS_AMX:  # the tiles for every m against the register kernel: different summation orders
        new = tmp_path / "amx_all.c"
        source = (NATIVE / "moe_amx.c").read_text()
        new.write_text(re.sub(r"(?m)^#define AMX_MIN_M .*$", "#define AMX_MIN_M 1", source))
        assert new.read_text() != source
    else:
        new = old
    done = run(KERNEL_AB, old, new, "hot", 256, 1, 3, 17)
    assert done.returncode == 0, done.stderr
    lines = AB_LINE.findall(done.stdout)
    assert [int(m) for m, *_ in lines] == [1, 3, 17], done.stdout
    assert all(float(t) > 0 for _, *times in lines for t in times)

    done = run(KERNEL_AB, old, swapped_outputs_build(new, tmp_path), "hot", 256, 3)
    assert done.returncode == 1
    assert "m = 3: the builds disagree" in done.stderr
    assert not AB_LINE.search(done.stdout)


@pytest.mark.skipif(not HAS_AVX2, reason="needs AVX2 and FMA")
def test_kernel_ab_times_avx2_builds_on_fp32_activations_and_refuses_wrong_sums(tmp_path):
    # m = 1 (the paired one-token loop), 6 (two streaming passes), 7 and 17 (scratch sweeps); the
    # driver's scaled FP32 activations come from the kernel's own table (layout.act_exp)
    unit = NATIVE / "moe_avx2.c"
    done = run(KERNEL_AB, "--isa", "avx2", unit, unit, "hot", 256, 1, 6, 7, 17)
    assert done.returncode == 0, done.stderr
    lines = AB_LINE.findall(done.stdout)
    assert [int(m) for m, *_ in lines] == [1, 6, 7, 17], done.stdout
    assert all(float(t) > 0 for _, *times in lines for t in times)

    done = run(KERNEL_AB, "--isa", "avx2", unit, swapped_outputs_build(unit, tmp_path), "hot", 256, 7)
    assert done.returncode == 1
    assert "m = 7: the builds disagree" in done.stderr

    # --timing-only (to time a copy with a piece taken out): the same wrong build is timed, and the
    # output says its sums were not compared; with --block-k before or after it
    for options in (["--timing-only"], ["--block-k", "128", "--timing-only"], ["--timing-only", "--block-k", "128"]):
        done = run(KERNEL_AB, "--isa", "avx2", unit, swapped_outputs_build(unit, tmp_path), *options, "hot", 256, 7)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("timing only: the two builds' results are not compared")
        timed = TIMED_SCALES_M.findall(done.stdout)
        assert timed == [(" block-wise" if "--block-k" in options else "", "7")], done.stdout


@pytest.mark.skipif(not HAS_AVX2, reason="needs AVX2 and FMA")
def test_kernel_ab_times_block_wise_scales_and_refuses_a_build_that_ignores_them(tmp_path):
    # --block-k hands the builds block-wise jobs: a build that reads them as per-channel (block 0's
    # scales for the whole K) must disagree, which it could not if the option were dropped
    unit = NATIVE / "moe_avx2.c"
    done = run(KERNEL_AB, "--isa", "avx2", unit, unit, "--block-k", 128, "hot", 256, 1, 6)
    assert done.returncode == 0, done.stderr
    lines = TIMED_SCALES_M.findall(done.stdout)
    assert lines == [(" block-wise", "1"), (" block-wise", "6")], done.stdout

    per_channel = altered_jobs_build(unit, tmp_path, "as_per_channel", ["a.format = b.format = KTFP8_FMT_FP8_CHANNEL;"])
    done = run(KERNEL_AB, "--isa", "avx2", unit, per_channel, "--block-k", 128, "hot", 256, 1)
    assert done.returncode == 1
    assert "m = 1: the builds disagree" in done.stderr

    for bad in (0, 7, -128):
        done = run(KERNEL_AB, "--isa", "avx2", unit, unit, "--block-k", bad, "hot", 256, 1)
        assert done.returncode == 2, (bad, done.stderr)
        assert "usage" in done.stderr


@pytest.mark.skipif(not HAS_AVX2, reason="needs AVX2 and FMA")
def test_kernel_ab_dram_walk_outgrows_the_l3():
    # the walk is 4x the L3 glibc reports, at least 256 MiB: a fixed 256 MiB lay within the Emerald
    # Rapids VM's 300 MiB L3, so "dram" timed the L3 there.  (avx512_bf16 where it runs: on Intel
    # the avx2 kernel meets the random codes' subnormals at microcode speed, 40x slower.)
    isa = "avx512bf16" if HAS_BF16 else "avx2"
    unit = NATIVE / f"moe_{isa}.c"
    done = run(KERNEL_AB, "--isa", isa, unit, unit, "dram", 2048, 1)
    assert done.returncode == 0, done.stderr
    walk = re.search(r"^dram: a walk of (\d+) MiB \(L3 (-?\d+) KiB\)$", done.stdout, re.M)
    assert walk, done.stdout
    getconf = subprocess.run(["getconf", "LEVEL3_CACHE_SIZE"], capture_output=True, text=True, timeout=60)
    l3 = int(getconf.stdout.strip() or 0)  # glibc's figure, as the tool's sysconf reads it
    assert int(walk[2]) == l3 >> 10
    assert int(walk[1]) == max(256 << 20, 4 * l3) >> 20
    assert re.search(r"^dram K=2048 m= 1: old\s+[\d.]+ us  new\s+[\d.]+ us", done.stdout, re.M), done.stdout
