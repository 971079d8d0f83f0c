"""The MoE kernel test harness, in the style of XNNPACK's GEMM micro-kernel tester.

A `Case` says what to run: weight format and block, hidden / intermediate size, how many tokens each
expert receives, the input dtype.  `check(variant, case)` runs it on one variant through the public
`ktfp8.MoE(..., backend=variant)` and compares the output with two independent answers:

  1. the float64 NumPy MoE of moe_oracle on the same dequantized weights, rounded where the kernel
     rounds: x and h to the activation dtype `act` the kernel reads (an argument; by default the
     kernel's own, from KERNELS), y to the output dtype.  NMSE <= oracle_budget(act, y.dtype);
  2. the `reference` backend (portable C, float32 activations): NMSE <= reference_budget(...).
NaN must appear exactly where the oracle has NaN, and exact zeros where it has exact zeros.
`check_inputs` does the same for hand-made weights and inputs (every FP8 code, NaN codes, ...).

Everything the harness knows about a kernel is in KERNELS: its activation dtype and the token counts
at which it changes path; `token_counts(variant)` turns those into the m values to run.

This module is the one place the kernel tests share; nothing here imports a test module."""
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Tuple

import ml_dtypes
import numpy as np

import ktfp8
import ktfp8._native
from ktfp8 import backends
from moe_oracle import make_experts, moe_fp64, nmse, round_to

BF16 = ml_dtypes.bfloat16
F32 = np.float32
SOURCES = os.path.dirname(os.path.abspath(ktfp8._native.__file__))   # the C sources ship with the package
THREADS = 2


# ------------------------------------------------------------------ what the harness knows of each kernel

@dataclass(frozen=True)
class Kernel:
    source: str                     # ktfp8/_native/<source>, where the facts below are written
    act: type                       # activation dtype its micro-kernel reads (.act_dtype of its table)
    defines: dict                   # the #define NAME value in `source` that pick the path by m
    edges: Callable[[dict], tuple]  # m at which a path starts or a register block fills


# m is the number of tokens routed to one expert (the rows of one micro-kernel call).  A test
# (test_kernels.test_kernel_table_matches_the_sources) reads `defines` back from the sources, so a
# kernel that moves a threshold fails there until this table follows it.  The *_emulated variants
# are the same sources compiled against SIMDe / the tile emulation: they share their twin's entry.
KERNELS = {
    # one path for every m; a few m so that grouping by expert is exercised
    "reference": Kernel("moe_reference.c", F32, {}, lambda d: (2,)),
    # m <= DECODE_M: codes converted in registers (KTFP8_FOR_M6); above, the first KEEP_M tokens
    # stream the codes and keep the converted tile in scratch, MR tokens per pass over it after them
    # (KTFP8_FOR_M6 for the last one)
    "avx2": Kernel("moe_avx2.c", F32, {"DECODE_M": 6, "MR": 6, "KEEP_M": 5},
                   lambda d: (d["MR"], d["DECODE_M"] + 1, d["KEEP_M"] + d["MR"])),
    # m <= DECODE_M: codes converted in registers (KTFP8_FOR_M4); above, MR tokens per pass, the
    # first streaming the weights and keeping the converted tile in scratch for the others
    # (KTFP8_FOR_M5_TO_8 for the first, KTFP8_FOR_M8 for the last)
    "avx512": Kernel("moe_avx512.c", F32, {"DECODE_M": 4, "MR": 8},
                     lambda d: (d["DECODE_M"] + 1, d["MR"], 2 * d["MR"])),
    # the fewest passes of up to MR tokens, as even as they go, each converting the codes in
    # registers (KTFP8_FOR_M8); more accumulators per token in a pass of at most DECODE_M, which a
    # later pass is at MR + 1 (5 + 4); 2 MR + 1 takes three passes
    "avx512_bf16": Kernel("moe_avx512bf16.c", BF16, {"DECODE_M": 4, "MR": 8},
                          lambda d: (d["DECODE_M"] + 1, d["MR"], 2 * d["MR"])),
    # m < AMX_MIN_M: the avx512_bf16 micro-kernel; from it on tiles of CHUNK tokens (one short
    # tile below CHUNK, whole ones from it on), PAIR_CHUNKS per pass of two weight tiles (the third
    # one's second C tile in another register), CHUNKS per pass of one (FP8 weights of PAIR_CHUNKS
    # CHUNK + 1 .. PARK_MAX_CHUNKS CHUNK tokens take both weight tiles in one pass, the chunks after
    # the first PAIR_CHUNKS parked between K blocks); past that, passes of PAIR_CHUNKS (two full ones,
    # then a single chunk after them)
    "amx": Kernel("moe_amx.c", BF16, {"AMX_MIN_M": 2, "CHUNK": 16, "PAIR_CHUNKS": 3, "CHUNKS": 5,
                                      "PARK_MAX_CHUNKS": 16},
                  lambda d: (d["AMX_MIN_M"], d["CHUNK"], 2 * d["CHUNK"], d["CHUNK"] * d["PAIR_CHUNKS"],
                             d["CHUNK"] * d["CHUNKS"], d["CHUNK"] * d["PARK_MAX_CHUNKS"],
                             2 * d["CHUNK"] * d["PAIR_CHUNKS"])),
}


# kernels with a tile_matmul2 (the driver's gate-and-up call; amx's hands m < AMX_MIN_M to avx512_bf16's)
PAIRING = ("avx2", "avx512_bf16", "amx")


def kernel(variant):
    return KERNELS[variant.removesuffix("_emulated")]


def activation_bytes(variant, a):
    """float32 activations a as the variant's micro-kernel reads them, raw bytes: bfloat16 bits, or
    float32 times 2^112 (the scaling the driver applies for the FP32 kernels' FP8 conversion,
    layout.act_exp)."""
    if kernel(variant).act is F32:
        return np.ldexp(a, 112).astype(np.float32).view(np.uint8)
    return (a.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def token_counts(variant):
    """1, and every edge - 1, edge, edge + 1 of the variant's kernel, ascending."""
    k = kernel(variant)
    return tuple(sorted({1} | {m for e in k.edges(k.defines) for m in (e - 1, e, e + 1) if m > 0}))


def variants():
    """Every variant this machine runs, native and emulated, the reference included."""
    return backends.usable_variants()


# ------------------------------------------------------------------ tolerances

# NMSE against the float64 oracle rounded at the kernel's rounding points, keyed by the narrowest
# dtype anything is rounded to (the activations, or y for bfloat16 input).  FP32 sums in another
# order: relative error ~1e-7, NMSE ~1e-13.  With a BF16 rounding, a value that the FP32 kernel and
# float64 place on either side of a rounding tie differs by one BF16 ulp (2^-8 relative); rare, but
# one such element in a small output weighs a lot: 1e-6, the budget two BF16 paths are held to.
ORACLE_NMSE = {F32: 1e-9, BF16: 1e-6}


def oracle_budget(act, out_dtype):
    """ORACLE_NMSE for a kernel reading `act` activations and writing `out_dtype`."""
    return ORACLE_NMSE[BF16 if BF16 in (act, np.dtype(out_dtype).type) else F32]


# NMSE between two FP32 kernels (the `reference` backend and an FP32 kernel): summation order only.
FP32_ORDER_NMSE = 1e-6


# ------------------------------------------------------------------ cases

# name: (format, block).  block (block_n, block_k) edges chosen against the sizes below: 128 is
# larger than intermediate 72 (one K block for down); 64 leaves short last blocks; 32 x 34: 34 = 2
# mod 4 starts K blocks inside the avx512_bf16 kernel's 64-byte code groups and inside every K
# unroll, and is not square (the seam path, see run); 48 splits the AMX kernel's 32-K slabs (it
# hands such jobs to avx512_bf16); 5 x 10: many tiny blocks, a scale per 10 K, an odd block_n.
WEIGHT_FORMATS = {
    "per_channel": ("fp8_per_channel", None),
    "block128": ("fp8_block", (128, 128)),
    "block64": ("fp8_block", (64, 64)),
    "block32x34": ("fp8_block", (32, 34)),
    "block48": ("fp8_block", (48, 48)),
    "block5x10": ("fp8_block", (5, 10)),
    "bf16": ("bf16", None),
}

# (hidden, intermediate): neither a multiple of 16 nor 32 (K padded, a part-empty last tile); both
# multiples of 32 (no padding: a kernel stopping short of k shows); one expert row and column.
SHAPES = {"200x72": (200, 72), "256x96": (256, 96), "17x33": (17, 33), "1x1": (1, 1)}


@dataclass(frozen=True)
class Case:
    fmt: str = "per_channel"        # a key of WEIGHT_FORMATS
    hidden: int = 200
    inter: int = 72
    m: Tuple[int, ...] = (1, 5)     # tokens routed to expert e = m[e]; experts = len(m)
    x_dtype: type = F32             # the input (and output) dtype
    seed: int = 0
    threads: int = THREADS


def layer(case):
    """(ExpertWeights, float64 dense weights) with outlier rows, so that scales differ a lot."""
    fmt, block = WEIGHT_FORMATS[case.fmt]
    return make_experts(fmt, len(case.m), case.hidden, case.inter, seed=case.seed, block=block or 64,
                        outliers=True)


def routing(m, seed=0, tokens=None):
    """topk_ids [T, E], topk_weights: expert e receives exactly m[e] of the T = max(m) tokens (random
    ones), the other slots hold -1 (expert held elsewhere), in a random slot order."""
    rng = np.random.default_rng(seed)
    T, E = tokens or max(m), len(m)
    ids = np.full((T, E), -1, np.int64)
    for e, count in enumerate(m):
        ids[rng.choice(T, size=count, replace=False), e] = e
    ids = np.take_along_axis(ids, rng.permuted(np.tile(np.arange(E), (T, 1)), axis=1), axis=1)
    return ids, rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)


def inputs(case):
    ids, w = routing(case.m, seed=case.seed + 1)
    x = np.random.default_rng(case.seed + 2).standard_normal((ids.shape[0], case.hidden)).astype(np.float32)
    return x.astype(case.x_dtype), ids, w


# ------------------------------------------------------------------ running a variant

def moe_config(fmt, experts, hidden, inter, top_k, block=None):
    """MoeConfig for ExpertWeights of format `fmt` ("fp8_per_channel", "fp8_block", "bf16")."""
    quant = ktfp8.QuantConfig(method="BF16" if fmt == "bf16" else "FP8", per_channel=fmt != "fp8_block",
                              group_size=block if fmt == "fp8_block" else 0)
    return ktfp8.MoeConfig(experts, top_k, hidden, inter, quant_config=quant)


def run(variant, experts, x, ids, w, threads=THREADS):
    """y = the layer on `variant`, through ktfp8.MoE.  MoeConfig names one block edge (group_size),
    so non-square blocks go through the seam MoE itself calls (_run_seam)."""
    block = experts.block
    if block is not None and block[0] != block[1]:
        return _run_seam(variant, experts, x, ids, w, threads)
    cfg = moe_config(experts.format, experts.expert_num, experts.hidden_size, experts.intermediate_size,
                     ids.shape[1], block[0] if block else None)
    return ktfp8.MoE(cfg, experts, backend=variant, threads=threads)(x, ids, w)


def _run_seam(variant, experts, x, ids, w, threads):
    """The only use of ktfp8's private extension in the kernel tests: what MoE.__call__ does, for a
    block MoeConfig cannot express.  Mirror MoE when the seam changes."""
    from ktfp8._native import _ext
    from ktfp8.moe import _FORMAT_CODES
    v = backends.variant(variant)
    shape = (experts.expert_num, experts.hidden_size, experts.intermediate_size,
             _FORMAT_CODES[experts.format], *experts.block)
    bits = np.uint16 if experts.format == "bf16" else np.uint8
    proj = [np.ascontiguousarray(p).view(bits) for p in (experts.gate, experts.up, experts.down)]
    scales = [None if s is None else np.ascontiguousarray(s, dtype=np.float32)
              for s in (experts.gate_scale, experts.up_scale, experts.down_scale)]
    kernel = _ext.PackedMoE(v, shape, *proj, *scales, threads)
    y = np.empty_like(x)
    kernel.forward(x, ids, w, y, False, v.act_dtype, threads)
    return y


# ------------------------------------------------------------------ checking

def expected(dense, x, ids, w, act, base=None):
    """The float64 oracle rounded where a kernel reading `act` activations rounds; `base`: the
    array the result is accumulated into.  Returned in float64, rounded to x's dtype."""
    y = moe_fp64(x, ids, w, *dense, act=act)
    if base is not None:
        y = y + np.asarray(base, np.float64)
    return round_to(y, x.dtype.type)


def assert_matches(got, want, budget, what):
    """Same NaN positions and exact zeros; NMSE <= budget over the rest."""
    got = np.asarray(got, np.float64)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN at {np.argwhere(np.isnan(got) != nan)[:5]}"
    zero = want == 0
    assert np.all(got[zero] == 0), f"{what}: nonzero where exactly zero is due"
    err = nmse(got[~nan], want[~nan])
    assert err <= budget, f"{what}: NMSE {err:.3g} > {budget:g}"


def reference_budget(rounded, dense, x, ids, w, act):
    """NMSE allowed against the `reference` backend, which reads float32 activations.  FP32 kernels:
    FP32_ORDER_NMSE.  A BF16 kernel also rounds x and h to BF16, and that moves y as far as it moves
    the float64 oracle on these very inputs: typically ~1e-6, but 2e-5 was seen with K = 17, where
    short sums cancel (a fixed 2e-5 was the budget until then).  The three deviations (that one, the
    kernel's from its oracle, the reference's summation order) may add up in amplitude.  `rounded`:
    expected(dense, x, ids, w, act), which the caller has already computed."""
    if act is F32:
        return FP32_ORDER_NMSE
    unrounded = expected(dense, x, ids, w, F32)
    finite = np.isfinite(rounded) & np.isfinite(unrounded)  # NaN weights give NaN rows in both
    shift = nmse(rounded[finite], unrounded[finite])
    return (math.sqrt(shift) + math.sqrt(ORACLE_NMSE[BF16]) + math.sqrt(FP32_ORDER_NMSE)) ** 2


def check_inputs(variant, experts, dense, x, ids, w, act=None, threads=THREADS, what=""):
    """Run `variant` on these weights and inputs, compare with the oracle and the reference backend
    (see the module docstring); returns y for further asserts."""
    act = act or kernel(variant).act
    y = run(variant, experts, x, ids, w, threads)
    assert y.dtype == x.dtype and y.shape == x.shape
    what = f"{variant} {what}".strip()
    want = expected(dense, x, ids, w, act)
    assert_matches(y, want, oracle_budget(act, x.dtype), f"{what} vs float64")
    if variant != "reference":
        ref = run("reference", experts, x, ids, w, threads)
        assert_matches(y, np.asarray(ref, np.float64), reference_budget(want, dense, x, ids, w, act),
                       f"{what} vs reference")
    return y


def check(variant, case, act=None):
    """Run `case` on `variant`; see the module docstring for what is compared."""
    experts, dense = layer(case)
    x, ids, w = inputs(case)
    return check_inputs(variant, experts, dense, x, ids, w, act=act, threads=case.threads, what=str(case))


def defines_in_source(source):
    """{NAME: int value} of the `#define NAME <integer>` lines of ktfp8/_native/<source>."""
    with open(os.path.join(SOURCES, source)) as f:
        return {m[1]: int(m[2]) for m in re.finditer(r"^#define\s+(\w+)\s+(\d+)\b", f.read(), re.M)}
