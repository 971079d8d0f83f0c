"""What is particular to the AMX backend.  Its kernel itself (the tile path from AMX_MIN_M
tokens per expert, passes of 4 x 16 tokens, every weight format, block 48 splitting the 32-K slabs)
is checked by test_kernels.py through kernel_tester, as `amx_emulated` (the same source compiled
against the tile emulation, any CPU with AVX2) and as native `amx` where the CPU and OS allow it."""
import numpy as np
import pytest

from ktfp8 import backends
from kernel_tester import KERNELS, Case, inputs, layer, run


def test_threshold_splits_the_two_paths():
    """Below AMX_MIN_M tokens per expert the AMX backend *is* the avx512_bf16 micro-kernel
    (bit-identical output); from it on the tiles sum in another order, so the bits differ."""
    edge = KERNELS["amx"].defines["AMX_MIN_M"]
    for m, same in ((edge - 1, True), (edge, False)):
        case = Case(m=(m,), seed=m)
        experts, _ = layer(case)
        x, ids, w = inputs(case)
        y_amx = run("amx_emulated", experts, x, ids, w)
        y_vec = run("avx512_bf16_emulated", experts, x, ids, w)
        assert np.array_equal(y_amx, y_vec) == same, m


def test_amx_emulated_is_listed_but_never_chosen():
    assert "amx_emulated" in backends.compiled_variants()
    assert "amx_emulated" not in backends.available_backends()


@pytest.mark.skipif("amx" not in backends.usable_variants(), reason="this CPU (or OS) runs no AMX tiles")
def test_a_forward_leaves_no_tiles_configured():
    """The kernel keeps its tile configuration from one call to the next and the driver lets it go
    after each thread's last call (kernel.release): on one thread the calling thread runs every
    call, and holds no tiles afterwards, whichever path the last call took."""
    _testing = pytest.importorskip("ktfp8._native._testing", reason="the test module is not built")
    for m in ((64, 5), (5, 64), (1,)):  # last call: a short chunk, parked_pass, the small-m kernel
        case = Case(m=m, seed=len(m))
        experts, _ = layer(case)
        x, ids, w = inputs(case)
        run("amx", experts, x, ids, w, threads=1)
        assert _testing.tile_palette() == 0, m
