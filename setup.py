"""Build of ktfp8: one Cython seam plus C kernels, one translation unit per ISA level.

The ISA levels -- their compiler flags, build options and emulated twins -- are the rows of
include/ktfp8/variants.def, the table dispatch.c reads too.  Each unit of a level
(``ktfp8/_native/<name>_<level>.c``) is compiled with that level's ``-m`` flags, never
``-march=native`` (unless KTFP8_NATIVE=1), and only when its build options allow and the compiler
accepts the flags.  The dispatcher, built with baseline flags, picks among them at run time.

Two extension modules:
  ktfp8._native._ext      everything ``import ktfp8`` needs
  ktfp8._native._testing  test-only: the *_emulated twins (the same kernel sources compiled against
                          SIMDe + the AMX tile emulation) and the tile-emulation hook; built unless
                          KTFP8_ENABLE_EMULATED=OFF (twins only where SIMDe's headers are found)

Build options (environment), each ON | OFF | AUTO (default AUTO = build when the compiler can):
  KTFP8_ENABLE_<option> for every option variants.def names (AVX2, AVX512, AVX512_BF16,
  AVX512_VBMI, AMX), and KTFP8_ENABLE_EMULATED.  KTransformers' CPUINFER_ENABLE_* spellings are
  read when ours are unset.  KTFP8_SANITIZE=address,undefined compiles everything with those
  sanitizers.
"""
import os
import platform
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
NATIVE = Path("ktfp8") / "_native"
VARIANTS_DEF = ROOT / "include" / "ktfp8" / "variants.def"
INCLUDE = ["include", np.get_include()]
# -falign-functions=64: every function starts on a cache line, so where a kernel's hot loop falls
# within the 64-byte windows the core fetches and decodes depends on that kernel's own source only,
# not on how much code the units linked before it hold (the ISA units link best first, so a change
# to the amx kernel used to move the avx2 loops).  Measured on the Zen 3 VM: the avx2 one-token loop
# (tile_matmul2's dot_pair) started 8 or 56 bytes into a line in the fast builds, 24 or 40 in two
# builds that took 1.07x-1.11x the time at T = 1 on 1 thread with the same avx2 source
# (docs/tuning-notes.md).
BASE_CFLAGS = ["-O3", "-falign-functions=64", "-std=gnu11", "-fopenmp", "-fno-strict-aliasing", "-Wall"]
# -g1 (line tables: a failing test's backtrace still names file and line): full -g on SIMDe's inlined
# emulation took 35-40 % of these test-only units' compile time (Zen 3 VM: moe_avx512bf16 29 s -> 19 s)
EMULATION_FLAGS = ["-DKTFP8_EMULATE_SIMD", "-DKTFP8_EMULATE_AMX", "-Wno-psabi", "-g1"]
TWIN_BASES = ("fp8_codec", "moe")  # kernels worth checking under emulation (not the speed probes)


def isa_levels():
    """{unit: (flags, options, twin)} from include/ktfp8/variants.def, best first; flags and options
    include those of the levels a level extends."""
    text = VARIANTS_DEF.read_text()
    while "/*" in text:  # drop comments
        start = text.index("/*")
        text = text[:start] + text[text.index("*/", start) + 2:]
    rows = {}
    for row in text.split("KTFP8_ISA(")[1:]:
        args = [a.strip() for a in row.strip().removesuffix(")").split(",")]
        if len(args) != 8:
            sys.exit(f"ktfp8 build: {VARIANTS_DEF.name}: a KTFP8_ISA row needs 8 arguments, got {args}")
        unit, _variant, extends, _needs, flags, options, _codec, twin = args
        rows[unit] = (extends, flags.strip('"').split(), options.strip('"').split(), twin)

    def inherited(unit):
        if unit == "none":
            return [], []
        extends, flags, options, _ = rows[unit]
        below_flags, below_options = inherited(extends)
        return below_flags + flags, below_options + options

    return {unit: (*inherited(unit), rows[unit][3]) for unit in rows}


ISA = isa_levels()


def option(name):
    """ON / OFF / AUTO for one build option, honouring KTransformers' CPUINFER_ENABLE_* spelling."""
    var = next((v for v in (f"KTFP8_ENABLE_{name}", f"CPUINFER_ENABLE_{name}") if os.environ.get(v)), None)
    given = os.environ[var] if var else "AUTO"
    aliases = {"1": "ON", "TRUE": "ON", "YES": "ON", "0": "OFF", "FALSE": "OFF", "NO": "OFF"}
    value = given.strip().upper()
    value = aliases.get(value, value)
    if value not in ("ON", "OFF", "AUTO"):
        sys.exit(f"ktfp8 build: {var}={given!r}; expected ON, OFF or AUTO")   # the variable as set, not its twin
    return value


def sanitize_flags():
    wanted = os.environ.get("KTFP8_SANITIZE", "").strip()
    if not wanted:
        return []
    # no recovery: a UBSan finding aborts the process (a failed test run), as ASan's do.  -g1: the line
    # tables a report's stack trace needs; full -g doubled the sanitized SIMDe units' compile time
    # (Zen 3 VM: the emulated moe_avx512bf16, 111 s -> 56 s)
    return [f"-fsanitize={wanted}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g1", "-O1"]


def usable_cores():
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def unit_sources(level, bases=None):
    """The level's sources <base>_<level>.c, optionally only those of the given bases."""
    return [src for src in sorted((ROOT / NATIVE).glob(f"*_{level}.c"))
            if bases is None or src.stem[: -len(level) - 1] in bases]


class BuildNative(build_ext):
    """Compiles each ISA unit with its own flags, then links them into their extension."""

    def compiles(self, source, flags):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "probe.c"
            path.write_text(source + "\n")
            try:
                self.compiler.compile([str(path)], output_dir=tmp, extra_postargs=flags)
                return True
            except Exception:
                return False

    def plan(self):
        """{extension name: [(source, variant dir, flags)]}: the ISA units (and emulated twins) this
        build compiles, announced in one line."""
        refuse_other_compilers(self.compiler.compiler_type)
        units = {"ktfp8._native._ext": [], "ktfp8._native._testing": []}
        levels = [(level, flags, [option(o) for o in options]) for level, (flags, options, _) in ISA.items()]
        levels = [(level, flags, modes) for level, flags, modes in levels if "OFF" not in modes]
        emulated = option("EMULATED")
        twins = [] if emulated == "OFF" else [(level, ISA[twin][0] + EMULATION_FLAGS)
                                              for level, (_, _, twin) in ISA.items() if twin != "none"]
        # the compiler checks side by side: one after the other they took 6 s of a build
        with ThreadPoolExecutor(max_workers=usable_cores()) as pool:
            level_checks = [pool.submit(self.compiles, "#include <immintrin.h>\nint f(void) { return 0; }", flags)
                            for _, flags, _ in levels]
            twin_checks = [pool.submit(self.compiles, "#include <simde/x86/avx512.h>\nint f(void) { return 0; }",
                                       flags) for _, flags in twins]
        for (level, flags, modes), check in zip(levels, level_checks):
            if check.result():
                units["ktfp8._native._ext"] += [(src, level, flags) for src in unit_sources(level)]
            elif "ON" in modes:
                sys.exit(f"ktfp8 build: {level} was requested (ON) but this compiler does not accept "
                         f"{' '.join(flags)} with its intrinsics; upgrade the compiler or set it to OFF/AUTO")
        if all(check.result() for check in twin_checks):   # (none where EMULATED is OFF)
            units["ktfp8._native._testing"] += [(src, level + "_emulated", flags) for level, flags in twins
                                                 for src in unit_sources(level, TWIN_BASES)]
        elif emulated == "ON":
            sys.exit("ktfp8 build: emulated variants requested (ON) but SIMDe headers were not found "
                     "(Debian/Ubuntu: apt-get install libsimde-dev)")
        compiled = sorted({variant for unit_list in units.values() for _, variant, _ in unit_list})
        print(f"ktfp8 build: ISA units compiled: {', '.join(compiled) or 'none (portable C only)'}")
        return units

    def run(self):
        if not any(ext.name == "ktfp8._native._testing" for ext in self.extensions):
            self.remove_stale_test_module()
        super().run()

    def remove_stale_test_module(self):
        """A test module an earlier build left in build/lib (or in place) would ship in this build's wheel
        and still offer the *_emulated variants that KTFP8_ENABLE_EMULATED=OFF leaves out."""
        for folder in {Path(self.build_lib) / NATIVE, *([ROOT / NATIVE] if self.inplace else [])}:
            for stale in folder.glob("_testing*.so"):
                stale.unlink()

    def build_extensions(self):
        # Every extension's ISA units go on one pool of the cores this process may use, the SIMDe twins
        # first (the longest compiles: 20-30 s each on the Zen 3 VM, a native unit 5-12 s), and the
        # extensions build side by side: the serial part of each (its Cython module and baseline C, then
        # the link) overlaps the other's units instead of following them.  Zen 3 VM, a full build from
        # clean: 87-92 s -> 69-74 s, with plan()'s compiler checks side by side too.
        plan = self.plan()
        queue = sorted(((name, unit) for name, units in plan.items() for unit in units),
                       key=lambda job: not job[1][1].endswith("_emulated"))
        with ThreadPoolExecutor(max_workers=usable_cores()) as pool:
            self.unit_jobs = {name: [] for name in plan}
            for name, unit in queue:
                self.unit_jobs[name].append(pool.submit(self.compile_unit, name, unit))
            self.parallel = len(self.extensions)
            super().build_extensions()

    def common_flags(self, ext_name):
        common = BASE_CFLAGS + sanitize_flags()
        # not in the emulated twins: with the CPU's own instructions enabled, SIMDe would hand every
        # intrinsic to the hardware, and the twins' tests would test no emulation
        if os.environ.get("KTFP8_NATIVE") == "1" and ext_name == "ktfp8._native._ext":
            common = common + ["-march=native"]
        return common

    def compile_unit(self, ext_name, unit):
        src, variant, flags = unit
        return self.compiler.compile(
            [str(src.relative_to(ROOT))], output_dir=os.path.join(self.build_temp, "isa", variant),
            include_dirs=INCLUDE, macros=[("KTFP8_VARIANT", variant)],
            extra_postargs=self.common_flags(ext_name) + flags)

    def build_extension(self, ext):
        ext.extra_objects = [obj for job in self.unit_jobs[ext.name] for obj in job.result()]
        ext.extra_compile_args = self.common_flags(ext.name)
        ext.extra_link_args = ["-fopenmp"] + sanitize_flags()
        # Always relink: the .so depends on which ISA objects were chosen, which setuptools'
        # timestamp check does not see.
        self.force = True
        super().build_extension(ext)


def baseline_sources(pyx, c_sources):
    """A Cython seam and the C files compiled with baseline flags (left out: every ISA unit, and
    the C that Cython generates from a .pyx)."""
    units = {src for level in ISA for src in unit_sources(level)}
    return [str(NATIVE / pyx)] + [str(p.relative_to(ROOT)) for p in sorted(c_sources)
                                  if p not in units and not p.with_suffix(".pyx").exists()]


def extension(name, sources):
    return Extension(name, sources=sources, include_dirs=INCLUDE,
                     define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])


# every build option read once up front: a misspelt value stops the build before Cython runs, not after
for name in sorted({o for _, options, _ in ISA.values() for o in options}) + ["EMULATED"]:
    option(name)
extensions = [extension("ktfp8._native._ext", baseline_sources("_ext.pyx", (ROOT / NATIVE).glob("*.c")))]
if option("EMULATED") != "OFF":
    extensions.append(extension("ktfp8._native._testing",
                                baseline_sources("_testing.pyx", (ROOT / NATIVE / "testing").glob("*.c"))))


def refuse_other_compilers(compiler_type):
    """The sources are GNU C (attributes, GCC's per-ISA flags, OpenMP by -fopenmp): MSVC, which pip uses on
    Windows, would print hundreds of errors instead of one sentence."""
    if compiler_type == "msvc":
        sys.exit("ktfp8 build: ktfp8's kernels are GNU C and build with GCC or clang only, not MSVC; on Windows, "
                 "install it under WSL2 (Linux)")


def refuse_other_cpus():
    """The kernels are x86-64 SIMD code, SSE2 their baseline: on another CPU (an ARM server) or under a
    32-bit Python the build would stop at the first intrinsics header with a compiler error."""
    machine = platform.machine()
    if machine.lower() not in ("x86_64", "amd64") or sys.maxsize < 2**32:
        bits = 64 if sys.maxsize >= 2**32 else 32
        sys.exit(f"ktfp8 build: ktfp8's kernels are x86-64 SIMD code (SSE2, AVX2, AVX-512, AMX) and build for "
                 f"x86-64 CPUs only; this is a {machine or 'unknown'} machine with a {bits}-bit Python")


if __name__ == "__main__":  # as pip and `python setup.py` run it; tests import it for isa_levels()
    refuse_other_cpus()
    setup(
        ext_modules=cythonize(extensions, language_level=3, compiler_directives={"boundscheck": False,
                                                                                  "wraparound": False}),
        cmdclass={"build_ext": BuildNative},
    )
