"""Backend registry: which kernel variants this build compiled, which this CPU runs, which to use.

Preference order, best first: amx > avx512_bf16 > avx512 > avx2 > reference.  The *_emulated
variants (the AVX-512 / AMX sources compiled against software emulation) exist for the test suite:
they can be forced by name but are never chosen automatically."""
import os

from ._native import _ext

ENV_BACKEND = "KTFP8_BACKEND"
ENV_THREADS = "KTFP8_NUM_THREADS"
ENV_OMP_THREADS = "OMP_NUM_THREADS"


def cpu_features():
    """CPUID/XGETBV facts: {'avx2': 1, 'avx512f': 0, ..., 'os_avx512': 0, 'brand': '...'}."""
    return _ext.cpu_features()


def compiled_variants():
    """Names of every variant compiled into this build, best first (emulated ones last)."""
    return [name for name, _, _ in _ext.variants()]


def usable_variants():
    """Compiled variants this CPU and OS can run, emulated ones included."""
    return [name for name, usable, _ in _ext.variants() if usable]


def available_backends():
    """Backends this build *and* this CPU can run, best first; never empty ('reference')."""
    return [name for name, usable, emulated in _ext.variants() if usable and not emulated]


def resolve_backend(name=None):
    """The backend to use: `name`, else $KTFP8_BACKEND, else the best available one."""
    source = "backend"
    if name is None:
        name = os.environ.get(ENV_BACKEND) or None
        source = ENV_BACKEND
    if name is None:
        return available_backends()[0]
    if not isinstance(name, str):
        raise TypeError(f"{source} must be a str, got {type(name).__name__}")
    usable = usable_variants()
    if name not in usable:
        why = "is not compiled in this build" if name not in compiled_variants() else \
            "is compiled but this CPU/OS cannot run it"
        raise ValueError(f"{source}={name!r} {why}; usable backends: {', '.join(usable)}")
    return name


def default_threads(threads=None):
    """Thread count: `threads`, else $KTFP8_NUM_THREADS, else OpenMP's $OMP_NUM_THREADS (its first,
    outermost level), else the cores this process may use.  A set but invalid variable raises
    ValueError naming it (a typo should not silently mean "all cores")."""
    if threads is None:
        for var in (ENV_THREADS, ENV_OMP_THREADS):
            env = os.environ.get(var, "").strip()
            if env:
                return _positive_env(var, env.split(",")[0] if var == ENV_OMP_THREADS else env)
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    return threads


def _positive_env(var, text):
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{var}={os.environ[var]!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"{var}={os.environ[var]!r} must be a positive integer")
    return value
