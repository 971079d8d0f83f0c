"""Prefill benchmark: AMX tiles vs the avx512_bf16 micro-kernel on the benchmark MoE layer.

Layer (the MoE forward issue's benchmark): 64 experts, top-8, hidden 2048, intermediate 768, FP8
per-channel weights (302 MB, larger than any cache); prefill T = 512 tokens, so about 64 tokens
reach each expert.  Reports the median time of each backend and the ratio avx512_bf16 / amx.

    python bench/bench_amx.py [--tokens 512] [--threads N] [--repeats 5] [--format per_channel]

Needs a CPU with AMX-TILE + AMX-BF16 and an OS that grants tile state (native backend `amx`);
elsewhere it prints why and exits 0.  The `amx_emulated` backend is never timed: its speed is that
of a scalar emulator and means nothing.
"""
import argparse
import os
import statistics
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ktfp8 import backends  # noqa: E402
from ktfp8._native import _ext  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 64, 8, 2048, 768
FORMATS = {"per_channel": 0, "block": 1, "bf16": 2}


def why_not_amx():
    """None when native amx runs here, else the reason."""
    if "amx" in backends.usable_variants():
        return None
    if "amx" not in backends.compiled_variants():
        return "this build did not compile the native amx unit (compiler without -mamx-tile/-mamx-bf16, or KTFP8_ENABLE_AMX=OFF)"
    f = backends.cpu_features()
    missing = [name for name in ("amx_tile", "amx_bf16", "avx512_bf16", "avx512_vbmi", "os_amx") if not f.get(name)]
    if missing:
        return f"this CPU/OS lacks {', '.join(missing)} ({f.get('brand') or f.get('vendor')})"
    return "the OS refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"


def make_layer(fmt, rng):
    """Random FP8 codes (NaN codes replaced) with per-row or per-block scales, or random BF16."""
    shapes = [(EXPERTS, INTER, HIDDEN), (EXPERTS, INTER, HIDDEN), (EXPERTS, HIDDEN, INTER)]
    if fmt == 2:
        weights = [(rng.standard_normal(s, np.float32) * 0.02).astype(ml_dtypes.bfloat16).view(np.uint16)
                   for s in shapes]
        return (EXPERTS, HIDDEN, INTER, fmt, 0, 0), weights, [None] * 3
    weights = []
    for s in shapes:
        codes = rng.integers(0, 256, s, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x7E
        weights.append(codes)
    if fmt == 0:
        scales = [rng.uniform(1e-4, 1e-3, s[:2]).astype(np.float32) for s in shapes]
        return (EXPERTS, HIDDEN, INTER, fmt, 0, 0), weights, scales
    scales = [rng.uniform(1e-4, 1e-3, (s[0], -(-s[1] // 128), -(-s[2] // 128))).astype(np.float32) for s in shapes]
    return (EXPERTS, HIDDEN, INTER, fmt, 128, 128), weights, scales


def time_backend(backend, shape, weights, scales, x, ids, w, threads, repeats):
    packed = _ext.moe_pack(backend, shape, *weights, *scales, threads)
    act = _ext.moe_act_dtype(backend)
    y = np.zeros_like(x)
    _ext.moe_forward(backend, shape, packed, x, ids, w, y, False, threads, act)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _ext.moe_forward(backend, shape, packed, x, ids, w, y, False, threads, act)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), y


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--format", choices=sorted(FORMATS), default="per_channel")
    args = p.parse_args(argv)

    reason = why_not_amx()
    if reason:
        print(f"bench_amx: skipped: {reason}")
        return 0
    threads = backends.default_threads(args.threads)
    rng = np.random.default_rng(0)
    shape, weights, scales = make_layer(FORMATS[args.format], rng)
    x = rng.standard_normal((args.tokens, HIDDEN)).astype(np.float32)
    ids = np.argsort(rng.random((args.tokens, EXPERTS)), axis=1)[:, :TOP_K].astype(np.int64)
    w = rng.uniform(0.05, 0.2, (args.tokens, TOP_K)).astype(np.float32)

    print(f"layer E={EXPERTS} top-{TOP_K} hidden={HIDDEN} inter={INTER} {args.format}, T={args.tokens}, "
          f"threads={threads}, median of {args.repeats}")
    results = {}
    for backend in ("avx512_bf16", "amx"):
        t, y = time_backend(backend, shape, weights, scales, x, ids, w, threads, args.repeats)
        results[backend] = (t, y)
        print(f"  {backend:12s} {t * 1e3:9.2f} ms  {args.tokens / t:10.1f} tokens/s")
    y_vec, y_amx = results["avx512_bf16"][1], results["amx"][1]
    err = float(np.sum((y_amx.astype(np.float64) - y_vec) ** 2) / max(np.sum(y_vec.astype(np.float64) ** 2), 1e-300))
    print(f"  speed-up amx vs avx512_bf16: {results['avx512_bf16'][0] / results['amx'][0]:.2f}x  "
          f"(outputs agree: NMSE {err:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
