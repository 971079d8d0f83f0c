"""Shared benchmark fixtures: the machine's measured limits, and summary tables printed at the end
of the run (ratios are only meaningful between figures measured side by side in one run)."""
import pytest

from ktfp8 import roofline

_CODEC = {}  # (dtype, impl) -> (median seconds, input bytes)
_MOE = []    # (backend, format, T, info dict)
_LIMITS = []


@pytest.fixture(scope="session")
def limits():
    r = roofline.measure()
    _LIMITS.append(r)
    return r


@pytest.fixture(scope="session")
def codec_results():
    return _CODEC


@pytest.fixture(scope="session")
def moe_results():
    return _MOE


def _codec_summary(tr):
    tr.section("FP8 codec: per-channel quantize, this run")
    for (dtype, impl), (median, nbytes) in sorted(_CODEC.items()):
        line = f"{dtype:9s} {impl:10s} median {median * 1e3:8.2f} ms  {nbytes / median / 1e9:6.2f} GB/s"
        base = _CODEC.get((dtype, "ml_dtypes"))
        if base and impl != "ml_dtypes":
            line += f"  {base[0] / median:6.1f}x faster than ml_dtypes"
        tr.write_line(line)


def _moe_summary(tr):
    r = _LIMITS[0]
    tr.section("MoE layer E=64 top-8 hidden 2048 intermediate 768, this run")
    tr.write_line(f"measured limits: {r.threads} threads, read {r.read_gbs:.1f} GB/s, FP32 FMA "
                  f"{r.fma_gflops:.0f} GFLOP/s, vdpbf16ps {r.dpbf16_gflops or 0:.0f} GFLOP/s")
    tr.write_line("backend       format           T       ms     GB/s  of-bw  TFLOP/s  of-peak")
    for backend, fmt, T, i in _MOE:
        tr.write_line(f"{backend:12s}  {fmt:15s} {T:4d} {i['ms']:8.2f} {i['gbs']:8.1f} {i['bw_fraction']:6.0%} "
                      f"{i['tflops']:8.3f} {i['peak_fraction']:7.0%}")
    ms = {(b, f, T): i["ms"] for b, f, T, i in _MOE}
    for (b, f, T), t in sorted(ms.items()):
        if f == "fp8_per_channel":
            for other in ("bf16", "fp8_block"):
                if (b, other, T) in ms:
                    tr.write_line(f"{b} T={T}: FP8 per-channel is {ms[(b, other, T)] / t:.2f}x the speed of {other}")


def pytest_terminal_summary(terminalreporter):
    if _CODEC:
        _codec_summary(terminalreporter)
    if _MOE and _LIMITS:
        _moe_summary(terminalreporter)
