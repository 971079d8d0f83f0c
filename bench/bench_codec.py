"""Per-channel FP8 quantization of a 4096 x 4096 matrix: ktfp8 (each native backend, all threads)
against the ml_dtypes route, float32 and bfloat16 input.

    python -m pytest bench/bench_codec.py --benchmark-only

Reports the median time, GB/s of input, and (in the summary at the end) the speed-up over
ml_dtypes measured in this same run.  The ml_dtypes route is what one writes without ktfp8:
scale = amax(|row|) / 448 (all-zero rows: 1) with NumPy, then
(w / scale).clip(-448, 448).astype(float8_e4m3fn)."""
import ml_dtypes
import numpy as np
import pytest

from ktfp8 import available_backends, fp8
from ktfp8.backends import default_threads

SHAPE = (4096, 4096)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
IMPLS = available_backends() + ["ml_dtypes"]


@pytest.fixture(scope="module")
def matrices():
    w = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    return {name: w.astype(dtype) for name, dtype in DTYPES.items()}


def ml_dtypes_per_channel(w):
    scale = np.abs(w).max(axis=-1, keepdims=True).astype(np.float32) / np.float32(448)
    scale[scale == 0] = 1
    codes = (w / scale).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_quantize_per_channel(benchmark, codec_results, matrices, dtype, impl):
    w = matrices[dtype]
    if impl == "ml_dtypes":
        run = lambda: ml_dtypes_per_channel(w)  # noqa: E731
        rounds = 5
    else:
        threads = default_threads()
        run = lambda: fp8.quantize(w, backend=impl, threads=threads)  # noqa: E731
        rounds = 30
    benchmark.group = f"per-channel quantize {SHAPE[0]}x{SHAPE[1]} {dtype}"
    codes, scale = benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=1)
    # both routes must produce the same codes, or the comparison means nothing
    ref_codes, ref_scale = ml_dtypes_per_channel(w)
    assert np.array_equal(np.asarray(codes).view(np.uint8), ref_codes.view(np.uint8))
    assert np.array_equal(scale, ref_scale)
    median = benchmark.stats.stats.median
    benchmark.extra_info["GB/s"] = round(w.nbytes / median / 1e9, 2)
    codec_results[(dtype, impl)] = (median, w.nbytes)
