"""Shared benchmark fixtures: the machine's measured limits, printed once per run."""
import pytest

from ktfp8 import roofline


@pytest.fixture(scope="session")
def limits():
    r = roofline.measure()
    print(f"\n[roofline] threads={r.threads} read={r.read_gbs:.1f} GB/s "
          f"fma_fp32={r.fma_gflops:.0f} GFLOP/s dpbf16={r.dpbf16_gflops or 0:.0f} GFLOP/s")
    return r
