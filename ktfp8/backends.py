"""Backend registry: which kernel variants this build compiled, which this CPU runs, which to use.

Preference order, best first: amx > avx512_bf16 > avx512 > avx2 > reference (the rows of
include/ktfp8/variants.def).  The registry is read once per process: a backend is then a Variant
object holding its function tables, which the codec and MoE seams call through without looking a
name up or asking CPUID again.

The *_emulated variants (the AVX-512 / AMX sources compiled against software emulation) exist for
the test suite and live in the test-only module ktfp8._native._testing, which is imported only when
one of them is named or listed: they can be forced by name but are never chosen automatically."""
import importlib
import numbers
import os
import re
import warnings

from . import cpu_quota, numa
from ._native import _ext
from .config import check_threads

ENV_BACKEND = "KTFP8_BACKEND"
ENV_THREADS = "KTFP8_NUM_THREADS"
ENV_OMP_THREADS = "OMP_NUM_THREADS"
# Why a CPU that runs the AVX-512-BF16 level still gets a fallback (python -m ktfp8.cpu, the AMX classes)
NATIVE_LEFT_OUT = "this build did not compile the avx512_bf16 / amx kernels (KTFP8_ENABLE_AVX512_BF16)"

# os.environ.get() of an unset variable raises and catches KeyError inside os.environ, which costs
# microseconds on every codec call (three variables are read there).  os.environ's own backing dict,
# keyed by the encoded name, holds the same live state (os.environ writes through it, monkeypatch
# included) and answers in tens of nanoseconds; plain os.environ where it has no such dict.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS = {name: os.fsencode(name) for name in (ENV_BACKEND, ENV_THREADS, ENV_OMP_THREADS)}


def _getenv(name):
    """$name (one of the variables above), or None when unset."""
    if _ENVIRON_DATA is None:
        return os.environ.get(name)
    value = _ENVIRON_DATA.get(_ENV_KEYS[name])
    return None if value is None else os.fsdecode(value)


_NATIVE = {v.name: v for v in _ext.variants()}          # this build's variants, best first
_BEST = next(v for v in _NATIVE.values() if v.usable)  # `reference` runs everywhere
_emulated = None                                       # name -> Variant, once the test module is asked for


def _emulated_variants():
    """The test module's *_emulated variants; empty when this build has no test module."""
    global _emulated
    if _emulated is None:
        try:
            module = importlib.import_module("ktfp8._native._testing")
        except ImportError:
            _emulated = {}
        else:
            _emulated = {v.name: v for v in _ext.test_variants(module)}
    return _emulated


def cpu_features():
    """CPUID/XGETBV facts: {'vendor': ..., 'brand': ..., 'family': 25, 'model': 1, 'stepping': 1,
    'avx2': 1, 'avx512f': 0, ..., 'os_avx512': 0}."""
    return _ext.cpu_features()


def isa_levels():
    """{level: (features it needs, usable here)} for every ISA level, best first."""
    return _ext.isa_levels()


def compiled_variants():
    """Names of every variant compiled into this build, best first (emulated ones last)."""
    return [*_NATIVE, *_emulated_variants()]


def usable_variants():
    """Compiled variants this CPU and OS can run, emulated ones included."""
    return [name for name, v in {**_NATIVE, **_emulated_variants()}.items() if v.usable]


def available_backends():
    """Backends this build *and* this CPU can run, best first; never empty ('reference')."""
    return [name for name, v in _NATIVE.items() if v.usable]


def variant(name=None):
    """The Variant to run: `name`, else $KTFP8_BACKEND, else the best available one."""
    if name is None:
        name = _getenv(ENV_BACKEND)
        if not name:
            return _BEST
        source = ENV_BACKEND
    else:
        source = "backend"
    found = _NATIVE.get(name) if isinstance(name, str) else None
    if found is not None and found.usable:
        return found
    return _named_elsewhere(name, source)


def _named_elsewhere(name, source):
    """An emulated variant by that name, else the error saying why `name` cannot run."""
    if not isinstance(name, str):
        raise TypeError(f"{source} must be a str, got {type(name).__name__}")
    found = _emulated_variants().get(name)
    if found is not None and found.usable:
        return found
    twins = [n for n in usable_variants() if n not in _NATIVE]
    near = name.strip().lower()         # 'AVX2' or ' avx2': a spelling, not a build without that backend
    if near != name and near in compiled_variants():
        why = f"is not a backend name (they are lower case, without spaces: {near!r} is one)"
    elif name not in compiled_variants():
        why = "is not compiled in this build"
    else:
        why = "is compiled but this CPU/OS cannot run it"
    also = f" (and, for tests, the emulated twins {', '.join(twins)})" if twins else ""
    raise ValueError(f"{source}={name!r} {why}; usable backends: {', '.join(available_backends())}{also}")


def resolve_backend(name=None):
    """The name of the backend variant(name) picks."""
    return variant(name).name


def default_threads(threads=None):
    """Thread count: `threads`, else $KTFP8_NUM_THREADS, else OpenMP's $OMP_NUM_THREADS (its first,
    outermost level), else the cores this process may use (usable_cores).  A set but invalid variable raises
    ValueError naming it (a typo should not silently mean "all cores")."""
    threads = requested_threads(threads)
    warn_if_one_thread(threads)
    return threads


def affinity_cores():
    """The cores that hold the CPUs in this process's affinity mask (taskset, cgroups' cpusets): an SMT
    core's two hardware threads are two CPUs and one core (numa.cores_of)."""
    return len(numa.cores_of_affinity())


def usable_cores():
    """The cores this process may run on (affinity_cores), and no more than its cgroup CPU quota
    allows, rounded up (cpu_quota.py: a container's --cpus, a Kubernetes CPU limit): the default
    thread count.  One thread per core, as PyTorch's and llama.cpp's defaults: a core's second hardware
    thread adds no multiply units or AMX unit for a prefill, and shares the core's L1 miss buffers, which
    bound its decode stream (docs/tuning-notes.md); $KTFP8_NUM_THREADS sets any other count.
    os.cpu_count() counts the machine's CPUs."""
    return cpu_quota.within_quota(affinity_cores())


_warned_one_thread = False


def warn_if_one_thread(threads):
    """Warns once per process when `threads` > 1 will run on one thread because this process was
    forked after ktfp8 ran a thread team (include/ktfp8/team.h)."""
    global _warned_one_thread
    if threads > 1 and not _warned_one_thread and _ext.forked_after_teams():
        _warned_one_thread = True
        warnings.warn("ktfp8 runs on 1 thread in this process: it was forked after ktfp8 ran OpenMP "
                      "threads, and OpenMP cannot start threads in such a child.  Start worker "
                      "processes with multiprocessing's 'spawn' or 'forkserver' method to use more.",
                      RuntimeWarning, stacklevel=3)


def requested_threads(threads):
    """default_threads without its one-thread warning."""
    if threads is None:
        for var in (ENV_THREADS, ENV_OMP_THREADS):
            env = (_getenv(var) or "").strip()
            if env and var == ENV_OMP_THREADS:
                return _positive_env(var, _outer_level(env))
            if env:
                return _positive_env(var, env)
        return usable_cores()
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads <= 0:
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    return check_threads("threads", int(threads))


def _outer_level(omp_num_threads):
    """The first count of $OMP_NUM_THREADS, a list of one per nesting level ("8,2"); a list with an
    invalid count ("2,abc", "2,") is refused whole, as OpenMP's runtime ignores it (with a warning)."""
    levels = omp_num_threads.split(",")
    if len(levels) > 1 and not all(re.fullmatch(r"\s*\+?[0-9]*[1-9][0-9]*\s*", level) for level in levels):
        raise ValueError(f"{ENV_OMP_THREADS}={os.environ[ENV_OMP_THREADS]!r} is not a list of positive integers "
                         f"(one per OpenMP nesting level)")
    return levels[0]


def _positive_env(var, text):
    # digits only, as OpenMP reads it: Python's int() would also take "1_0" and non-ASCII digits
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
        raise ValueError(f"{var}={os.environ[var]!r} is not an integer")
    value = int(text)
    if value <= 0:
        raise ValueError(f"{var}={os.environ[var]!r} must be a positive integer")
    return check_threads(var, value)
