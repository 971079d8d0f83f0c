"""Benchmark summary: speed-up of each ktfp8 backend over the ml_dtypes route, same run."""
import pytest

_RESULTS = {}  # (dtype, impl) -> (median seconds, input bytes)


@pytest.fixture(scope="session")
def codec_results():
    return _RESULTS


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    terminalreporter.section("FP8 codec: per-channel quantize, this run")
    for (dtype, impl), (median, nbytes) in sorted(_RESULTS.items()):
        line = f"{dtype:9s} {impl:10s} median {median * 1e3:8.2f} ms  {nbytes / median / 1e9:6.2f} GB/s"
        base = _RESULTS.get((dtype, "ml_dtypes"))
        if base and impl != "ml_dtypes":
            line += f"  {base[0] / median:6.1f}x faster than ml_dtypes"
        terminalreporter.write_line(line)
