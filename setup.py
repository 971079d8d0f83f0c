"""Build of ktfp8: one Cython seam plus C kernels, one translation unit per ISA level.

Each ISA unit (``ktfp8/_native/<name>_<isa>.c``) is compiled with its own ``-m`` flags, never
``-march=native`` (unless KTFP8_NATIVE=1), and only when its build option allows and the compiler
accepts the flags.  The dispatcher, built with baseline flags, picks among them at run time.

Build options (environment), each ON | OFF | AUTO (default AUTO = build when the compiler can):
  KTFP8_ENABLE_AVX2, KTFP8_ENABLE_AVX512, KTFP8_ENABLE_AVX512_BF16, KTFP8_ENABLE_AVX512_VBMI,
  KTFP8_ENABLE_AMX, KTFP8_ENABLE_EMULATED (test-only variants against SIMDe + tile emulation).
  KTransformers' CPUINFER_ENABLE_AVX512_BF16 / _AVX512_VBMI / _AMX are read when ours are unset.
  KTFP8_SANITIZE=address,undefined  compiles everything with those sanitizers.
"""
import os
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
INCLUDE = ["include", np.get_include()]
BASE_CFLAGS = ["-O3", "-std=gnu11", "-fopenmp", "-fno-strict-aliasing", "-Wall", "-Wno-unused-function"]

AVX2 = ["-mavx", "-mavx2", "-mfma", "-mf16c"]
AVX512 = AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
AVX512_BF16 = AVX512 + ["-mavx512bf16", "-mavx512vbmi"]
AMX = AVX512_BF16 + ["-mamx-tile", "-mamx-bf16"]

# isa suffix -> (flags, options that must allow it, probe source)
ISA = {
    "avx2": (AVX2, ["AVX2"],
             "#include <immintrin.h>\nint f(float*p){__m256 a=_mm256_fmadd_ps(_mm256_loadu_ps(p),"
             "_mm256_cvtph_ps(_mm_setzero_si128()),_mm256_set1_ps(1));_mm256_storeu_ps(p,a);return 0;}"),
    "avx512": (AVX512, ["AVX512"],
               "#include <immintrin.h>\nint f(short*p){__m512i a=_mm512_add_epi16(_mm512_loadu_si512(p),"
               "_mm512_set1_epi16(1));_mm512_storeu_si512(p,a);return 0;}"),
    "avx512bf16": (AVX512_BF16, ["AVX512", "AVX512_BF16", "AVX512_VBMI"],
                   "#include <immintrin.h>\nint f(float*p){__m512i t=_mm512_permutex2var_epi8("
                   "_mm512_setzero_si512(),_mm512_setzero_si512(),_mm512_setzero_si512());"
                   "__m512 a=_mm512_dpbf16_ps(_mm512_loadu_ps(p),(__m512bh)t,(__m512bh)t);"
                   "_mm512_storeu_ps(p,a);return 0;}"),
    "amx": (AMX, ["AVX512", "AVX512_BF16", "AVX512_VBMI", "AMX"],
            "#include <immintrin.h>\nint f(void){_tile_zero(0);_tile_dpbf16ps(0,1,2);return 0;}"),
}
EMULATED_FLAGS = AVX2 + ["-DKTFP8_EMULATE_SIMD", "-DKTFP8_EMULATE_AMX", "-Wno-psabi"]
EMULATED_PROBE = ("#define SIMDE_ENABLE_NATIVE_ALIASES\n#include <simde/x86/avx512.h>\n"
                  "int f(float*p){__m512 a=_mm512_dpbf16_ps(_mm512_loadu_ps(p),(__m512bh)"
                  "_mm512_permutex2var_epi8(_mm512_setzero_si512(),_mm512_setzero_si512(),"
                  "_mm512_setzero_si512()),(__m512bh)_mm512_setzero_si512());_mm512_storeu_ps(p,a);return 0;}")
EMULATED_ISAS = ("avx512", "avx512bf16", "amx")
EMULATED_BASES = ("fp8_codec", "moe")  # kernels worth checking under emulation (not the speed probes)


def option(name):
    """ON / OFF / AUTO for one build option, honouring KTransformers' CPUINFER_ENABLE_* spelling."""
    value = os.environ.get(f"KTFP8_ENABLE_{name}") or os.environ.get(f"CPUINFER_ENABLE_{name}") or "AUTO"
    value = value.strip().upper()
    aliases = {"1": "ON", "TRUE": "ON", "YES": "ON", "0": "OFF", "FALSE": "OFF", "NO": "OFF"}
    value = aliases.get(value, value)
    if value not in ("ON", "OFF", "AUTO"):
        sys.exit(f"ktfp8 build: KTFP8_ENABLE_{name}={value!r}; expected ON, OFF or AUTO")
    return value


def sanitize_flags():
    wanted = os.environ.get("KTFP8_SANITIZE", "").strip()
    if not wanted:
        return []
    # no recovery: a UBSan finding aborts the process (a failed test run), as ASan's do
    return [f"-fsanitize={wanted}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1"]


class BuildNative(build_ext):
    """Compiles each ISA unit with its own flags, then links them into the one extension."""

    def compiles(self, source, flags):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "probe.c"
            path.write_text(source + "\n")
            try:
                self.compiler.compile([str(path)], output_dir=tmp, extra_postargs=flags)
                return True
            except Exception:
                return False

    def decide(self):
        """Which ISA levels (and the emulated set) this build compiles."""
        chosen = {}
        for isa, (flags, options, probe) in ISA.items():
            modes = [option(o) for o in options]
            if "OFF" in modes:
                continue
            if self.compiles(probe, flags):
                chosen[isa] = flags
            elif "ON" in modes:
                sys.exit(f"ktfp8 build: {isa} was requested (ON) but this compiler does not accept "
                         f"{' '.join(flags)} with its intrinsics; upgrade the compiler or set it to OFF/AUTO")
        emulated = option("EMULATED")
        if emulated != "OFF":
            if self.compiles(EMULATED_PROBE, EMULATED_FLAGS):
                chosen["emulated"] = EMULATED_FLAGS
            elif emulated == "ON":
                sys.exit("ktfp8 build: emulated variants requested (ON) but SIMDe headers were not found "
                         "(Debian/Ubuntu: apt-get install libsimde-dev)")
        return chosen

    def build_extension(self, ext):
        chosen = self.decide()
        common = BASE_CFLAGS + sanitize_flags()
        if os.environ.get("KTFP8_NATIVE") == "1":
            common = common + ["-march=native"]
        units, macros = [], []
        for src in sorted((ROOT / NATIVE).glob("*.c")):
            stem = src.stem
            isa = next((i for i in ISA if stem.endswith("_" + i)), None)
            if isa is None:
                continue
            base = stem[: -len(isa) - 1]  # e.g. "moe" or "fp8_codec"
            if isa in chosen:
                units.append((src, isa, chosen[isa]))
                macros.append(f"KTFP8_HAVE_{base_macro(base)}_{isa.upper()}")
            if isa in EMULATED_ISAS and base in EMULATED_BASES and "emulated" in chosen:
                units.append((src, isa + "_emulated", chosen["emulated"]))
                macros.append(f"KTFP8_HAVE_{base_macro(base)}_{isa.upper()}_EMULATED")

        def compile_unit(unit):
            src, variant, flags = unit
            return self.compiler.compile(
                [str(src.relative_to(ROOT))], output_dir=os.path.join(self.build_temp, "isa", variant),
                include_dirs=INCLUDE, macros=[("KTFP8_VARIANT", variant)], extra_postargs=common + flags)

        # The ISA units are independent and dominate the build time (SIMDe-emulated ones above all,
        # sanitized builds even more): compile them on every core this process may use.
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            ext.extra_objects = [obj for objs in pool.map(compile_unit, units) for obj in objs]
        ext.define_macros = list(ext.define_macros or []) + [(m, "1") for m in macros]
        ext.extra_compile_args = common
        ext.extra_link_args = ["-fopenmp"] + sanitize_flags()
        compiled = sorted({v for _, v, _ in units})
        print(f"ktfp8 build: ISA units compiled: {', '.join(compiled) or 'none (portable C only)'}")
        # Always rebuild and relink: the baseline objects depend on the chosen macros and the .so on
        # the ISA objects, neither of which setuptools' timestamp check sees.
        self.force = True
        super().build_extension(ext)


def base_macro(base):
    return {"fp8_codec": "CODEC"}.get(base, base.upper())


def baseline_sources():
    """The Cython seam and every C file that is not an ISA unit (compiled with baseline flags)."""
    isa_suffixes = tuple("_" + i + ".c" for i in ISA)
    return [str(NATIVE / "_ext.pyx")] + [
        str(p.relative_to(ROOT)) for p in sorted((ROOT / NATIVE).glob("*.c"))
        if not p.name.endswith(isa_suffixes) and p.name != "_ext.c"]


extension = Extension("ktfp8._native._ext", sources=baseline_sources(), include_dirs=INCLUDE,
                      define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])

setup(
    ext_modules=cythonize([extension], language_level=3, compiler_directives={"boundscheck": False,
                                                                               "wraparound": False}),
    cmdclass={"build_ext": BuildNative},
)
