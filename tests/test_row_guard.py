"""No micro-kernel reads an activation row it is not allowed to (abi.h, layout.row_pad).

A job of m rows may read past them only where its kernel reads whole tiles of rows (amx: 16) and m
is more than one tile; then up to the end of its last tile.  A job of at most one tile reads its m
rows only, so the driver leaves the padding rows unwritten at decode (moe_driver.c, prepare_call).
Here every variant this machine runs, native or emulated, gets activation rows that end where an
inaccessible page begins (mprotect PROT_NONE), one tile pair at a time through
ktfp8._native._testing.tile_pair, paired and as two single tiles: a read past the allowed rows is a
SIGSEGV.  The calls run in a child process, so that such a read fails this test with the job it
was on instead of ending the test session."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ktfp8 import backends
from kernel_tester import KERNELS

pytest.importorskip("ktfp8._native._testing", reason="the test module is not built (KTFP8_ENABLE_EMULATED=OFF)")

CHUNK = KERNELS["amx"].defines["CHUNK"]  # the amx kernel's layout.row_pad
# every m of one tile, the first past it, a whole second tile and one row into a third
TOKEN_COUNTS = tuple(range(1, CHUNK + 1)) + (CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1)
# 192: six 32-K AMX slabs; 32: one (the smallest padded K)
KS = (192, 32)

CHILD = textwrap.dedent("""
    import ctypes, mmap, sys
    import numpy as np
    from ktfp8 import backends
    from ktfp8._native import _testing
    from ktfp8.moe import _FORMAT_CODES

    variant, esz, nb, row_pad = sys.argv[1], *map(int, sys.argv[2:5])
    ks, token_counts = ([int(v) for v in arg.split(",")] for arg in sys.argv[5:7])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    PAGE = mmap.PAGESIZE
    v = backends.variant(variant)
    rng = np.random.default_rng(0)

    def guarded(nbytes):
        # nbytes of activations (bf16 ones or float32 ones of 1.0) whose last byte is the last before
        # a PROT_NONE page
        body = -(-nbytes // PAGE) * PAGE
        mem = mmap.mmap(-1, body + PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        if libc.mprotect(base + body, PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        view = np.frombuffer(mem, np.uint8, count=nbytes, offset=body - nbytes)
        view.view(np.uint16 if esz == 2 else np.float32)[:] = 0x3F80 if esz == 2 else 1.0
        return mem, view

    for K in ks:
        a_stride = K + 32  # elements: rows not back to back, as the driver's
        for fmt in ("fp8_per_channel", "bf16"):
            code = _FORMAT_CODES[fmt]
            w = rng.integers(0, 0x70, K * nb * (2 if fmt == "bf16" else 1), dtype=np.uint8)
            s = np.ones(nb, np.float32)
            for m in token_counts:
                rows = -(-m // row_pad) * row_pad if m > row_pad > 1 else m
                mem, a = guarded(esz * ((rows - 1) * a_stride + K))
                for paired in (True, False):
                    print(variant, "K =", K, fmt, "m =", m, "paired" if paired else "single", flush=True)
                    c = [np.full(m * nb, np.nan, np.float32) for _ in range(2)]
                    _testing.tile_pair(v, paired, code, K, 0, 1, w, w, s, s, a, a_stride, m, c[0], c[1])
                    assert all(np.isfinite(ci).all() for ci in c), (variant, K, fmt, m, paired)
                del a
                mem.close()
    print("done")
""")


@pytest.mark.parametrize("variant", backends.usable_variants())
def test_kernels_read_no_row_past_what_they_may(variant):
    unit = variant.removesuffix("_emulated")
    esz = np.dtype(KERNELS[unit].act).itemsize  # bytes per activation the kernel reads
    nb = 1 if unit == "reference" else 16  # layout.rows_per_tile: the reference's tile is one row
    row_pad = CHUNK if unit == "amx" else 0
    proc = subprocess.run([sys.executable, "-c", CHILD, variant, str(esz), str(nb), str(row_pad),
                           ",".join(map(str, KS)), ",".join(map(str, TOKEN_COUNTS))],
                          capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines[-1:] == ["done"], (
        f"exit status {proc.returncode} during: {lines[-1] if lines else 'start-up'}\n{proc.stderr[-2000:]}")
