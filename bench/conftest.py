"""Shared benchmark fixtures: the machine's measured limits per thread count, and the summary printed at
the end of the run (ratios are only meaningful between figures measured side by side in one run)."""
import dataclasses

import pytest

from ktfp8 import backends, roofline
from ktfp8.bench import report

_CODEC = {}   # (dtype, impl) -> (median seconds, input bytes)
_MOE = []     # rows as ktfp8.bench.run.Runner makes them
_LIMITS = {}  # threads -> Roofline
_INTERLEAVED = {}  # "result": ktfp8.bench.interleaved's result, when bench_moe.py's decode step ran


BENCH_LAYERS = ("bench", "deepseek-v3")


def pytest_addoption(parser):
    parser.addoption("--bench-layers", default=",".join(BENCH_LAYERS),
                     help=f"comma-separated layers for bench_moe.py: {', '.join(BENCH_LAYERS)}")


def pytest_configure(config):
    """--bench-layers checked before collection: bench_moe.py ran any other name as the DeepSeek-V3
    slice (GBs of weights), and a repeated one twice."""
    names = config.getoption("bench_layers").split(",")
    unknown = [n for n in names if n not in BENCH_LAYERS]
    if unknown:
        raise pytest.UsageError(f"--bench-layers: unknown layer(s) {', '.join(map(repr, unknown))}; "
                                f"choose from {', '.join(BENCH_LAYERS)}")
    config.option.bench_layers = ",".join(dict.fromkeys(names))


@pytest.fixture(scope="session")
def limits_by_threads():
    def measure(threads):
        if threads not in _LIMITS:
            _LIMITS[threads] = roofline.measure(threads=threads)
        return _LIMITS[threads]
    return measure


@pytest.fixture(scope="session")
def codec_results():
    return _CODEC


@pytest.fixture(scope="session")
def moe_rows():
    return _MOE


@pytest.fixture(scope="session")
def interleaved_results():
    return _INTERLEAVED


def _codec_summary(tr):
    tr.section("FP8 codec: per-channel quantize, this run")
    for (dtype, impl), (median, nbytes) in sorted(_CODEC.items()):
        line = f"{dtype:9s} {impl:10s} median {median * 1e3:8.2f} ms  {nbytes / median / 1e9:6.2f} GB/s"
        base = _CODEC.get((dtype, "ml_dtypes"))
        if base and impl != "ml_dtypes":
            line += f"  {base[0] / median:6.1f}x faster than ml_dtypes"
        tr.write_line(line)


def _moe_summary(tr):
    limits = {str(n): dataclasses.asdict(r) for n, r in _LIMITS.items()}
    tr.section("MoE layers, ktfp8 and peers, this run (best thread count of each side)")
    default = backends.resolve_backend(None)
    for part in (report.results_table(_MOE, limits, default), report.scaling_table(_MOE)):
        for line in part.splitlines():
            tr.write_line(line)
    names = {r["layer"] for r in _MOE}
    from ktfp8.bench.layers import BENCH_LAYER
    if BENCH_LAYER.name in names:
        for line in report.goals_lines(report.goals(_MOE, limits, BENCH_LAYER.name, default,
                                                           _INTERLEAVED.get("result"))).splitlines():
            tr.write_line(line)


def pytest_terminal_summary(terminalreporter):
    if _CODEC:
        _codec_summary(terminalreporter)
    if _MOE and _LIMITS:
        _moe_summary(terminalreporter)
