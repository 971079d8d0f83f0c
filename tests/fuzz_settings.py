"""Hypothesis budgets shared by the property and fuzz tests.

Default run (CI): few examples, derandomized (the same examples every run, so CI never flakes on a
newly found case; a fixed seed is still a fresh, independent input set for the code under test).
KTFP8_FUZZ_LONG=1: many more examples, randomized, for a local or nightly hunt."""
import os

from hypothesis import HealthCheck, settings

LONG = os.environ.get("KTFP8_FUZZ_LONG") == "1"


def budget(examples, long_examples=None):
    """Settings for a test that runs `examples` examples by default (`long_examples`, default 20x,
    with KTFP8_FUZZ_LONG=1)."""
    return settings(
        max_examples=(long_examples or 20 * examples) if LONG else examples,
        derandomize=not LONG,
        deadline=None,                      # kernel timings vary with the load of a shared CI machine
        database=None,                      # no .hypothesis folder written into the checkout
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.function_scoped_fixture],
        print_blob=True,
    )
