"""What is particular to the AMX backend.  Its kernel itself (the tile path from AMX_MIN_M
tokens per expert, passes of 4 x 16 tokens, every weight format, block 48 splitting the 32-K slabs)
is checked by test_kernels.py through kernel_tester, as `amx_emulated` (the same source compiled
against the tile emulation, any CPU with AVX2) and as native `amx` where the CPU and OS allow it."""
import numpy as np

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
