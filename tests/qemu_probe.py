"""Checks run on an emulated CPU: `qemu-x86_64 -cpu <model> python tests/qemu_probe.py [check ...]`.

Prints one JSON line {check name: result}.  Each check is a function `check_<name>()` returning
JSON-able data; tests/test_qemu_fallback.py runs the same functions in its own process to get the
host's answer and compares.  To add a check, add a function (it runs by default).

No BLAS here: these machines set OPENBLAS_CORETYPE=Haswell, so NumPy's `@` / `dot` die with SIGILL
under -cpu SandyBridge.  Inputs are built with integer arithmetic only (no sin/exp, whose SIMD
paths may round differently on another CPU), so they are bit-identical everywhere."""
import hashlib
import json
import sys

import os

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # moe_oracle beside this file


def fixed_floats(n):
    """n float32 values from an integer LCG: random signs, exponents 2^-20 .. 2^20, mantissas;
    every 16th value replaced by a special (0, -0, +-Inf, NaN, 448, 464, 480, E4M3 ties)."""
    state = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
    state ^= state >> np.uint64(29)
    bits = (state & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    sign = bits & np.uint32(0x80000000)
    exponent = (np.uint32(107) + (bits >> np.uint32(8)) % np.uint32(41)) << np.uint32(23)
    values = (sign | exponent | (bits & np.uint32(0x7FFFFF))).view(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 464.0, -480.0, 2.0 ** -10, 3 * 2.0 ** -10,
                         1.0625, -1.1875, 15 * 2.0 ** -10, 1e-40, 17.0, -0.001], np.float32)
    values[::16] = np.resize(specials, values[::16].size)
    return values


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def check_backends():
    import ktfp8
    from ktfp8 import backends

    features = ktfp8.cpu_features()
    return {
        "features": {k: features[k] for k in ("avx", "avx2", "fma", "f16c", "avx512f", "os_avx512")},
        "compiled": backends.compiled_variants(),
        "usable": backends.usable_variants(),
        "available": ktfp8.available_backends(),
        "resolved": backends.resolve_backend(None),
    }


def check_codec():
    """Digests of the codec's outputs for every variant this CPU runs (and for the default one)."""
    from ktfp8 import backends, fp8

    w = fixed_floats(40 * 136).reshape(40, 136)
    with np.errstate(over="ignore"):  # float16 overflows to Inf: one more case
        w16 = w.astype(np.float16)
    out = {}
    for variant in backends.usable_variants() + [None]:
        kw = {"backend": variant, "threads": 2}
        codes_pc, scale_pc = fp8.quantize(w, **kw)
        codes_bw, scale_bw = fp8.quantize(w.reshape(2, 20, 136), per_channel=False, block=(8, 48), **kw)
        all_codes = np.arange(256, dtype=np.uint8)
        out[variant or "default"] = {
            "encode_f32": digest(fp8.encode(w, **kw)),
            "encode_bf16": digest(fp8.encode(w.astype(ml_dtypes.bfloat16), **kw)),
            "encode_f16": digest(fp8.encode(w16, **kw)),
            "decode": digest(fp8.decode(all_codes, **kw), fp8.decode(all_codes, ml_dtypes.bfloat16, **kw)),
            "quantize_per_channel": digest(codes_pc, scale_pc),
            "quantize_blockwise": digest(codes_bw, scale_bw),
            "dequantize": digest(fp8.dequantize(codes_bw, scale_bw, block=(8, 48), **kw)),
        }
    return out


def check_read_probe():
    """The read probe's sums over a buffer of fixed words, by (threads, streams): every 128-byte step
    read once, whether the AVX2 loop or the portable one runs."""
    from ktfp8 import roofline
    from ktfp8._native import _ext
    buf = roofline.probe_buffer(128 * 1001)  # 1001 steps: shares and runs that do not divide evenly, and
    # at 64 streams runs (5 steps) shorter than the rotation (37 steps a stream)
    buf.view(np.uint64)[:] = np.arange(buf.nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return {f"{threads},{streams}": str(_ext.probe_read(buf, threads, streams))
            for threads in (1, 2, 3) for streams in (1, 2, 3, 4, 8, 64)}


def check_moe():
    """NMSE of a small FP8 per-channel MoE forward, per usable variant, against the float64 oracle
    (elementwise NumPy only, see moe_oracle.moe_fp64)."""
    import ktfp8
    from ktfp8 import backends
    from moe_oracle import moe_fp64, nmse

    E, H, I, K, T = 4, 40, 24, 2, 3
    lcg = np.nan_to_num(fixed_floats(3 * E * I * H + T * H), posinf=1, neginf=-1)
    codes = [np.clip(lcg[i * E * I * H:(i + 1) * E * I * H] * 8, -448, 448).astype(ml_dtypes.float8_e4m3fn)
             .view(np.uint8) for i in range(3)]
    gate, up = (c.reshape(E, I, H) for c in codes[:2])
    down = codes[2].reshape(E, H, I)
    scales = [np.full((E, n, 1), s, np.float32) for n, s in ((I, 2.0 ** -9), (I, 2.0 ** -9), (H, 2.0 ** -8))]
    experts = ktfp8.ExpertWeights("fp8_per_channel", gate, up, down, *scales)
    x = np.clip(lcg[-T * H:], -4, 4).reshape(T, H).astype(np.float32)
    ids = np.array([[0, 3], [2, -1], [1, 2]], np.int64)
    weights = np.array([[0.75, 0.25], [1.0, 0.5], [0.5, 0.5]], np.float32)
    dense = [c.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * s for c, s in zip((gate, up, down), scales)]
    want = moe_fp64(x, ids, weights, *dense)
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    out = {}
    for variant in backends.usable_variants():
        moe = ktfp8.MoE(cfg, experts, backend=variant, threads=2)
        out[variant] = nmse(moe(x, ids, weights), want)
    out["default"] = ktfp8.MoE(cfg, experts, threads=2).backend
    return out


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}


def main(argv):
    names = argv or list(CHECKS)
    print(json.dumps({name: CHECKS[name]() for name in names}))


if __name__ == "__main__":
    main(sys.argv[1:])
