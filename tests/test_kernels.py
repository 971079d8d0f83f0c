"""Every MoE kernel variant this machine runs (native and emulated, the reference included) through
the kernel harness (kernel_tester.py): every weight format at the token counts where the variant
changes path, odd shapes, bfloat16 input, many tokens, and hand-made edge cases, each against the
float64 oracle and the reference backend."""
import ml_dtypes
import numpy as np
import pytest

from ktfp8 import backends
from kernel_tester import (BF16, KERNELS, SHAPES, WEIGHT_FORMATS, Case, assert_matches, check, check_inputs,
                           defines_in_source, expected, inputs, kernel, layer, oracle_budget, routing, run,
                           token_counts, variants)
from moe_oracle import dequantize

E4M3 = ml_dtypes.float8_e4m3fn
VARIANTS = variants()
NATIVE_FAST = [v for v in VARIANTS if v != "reference" and not v.endswith("_emulated")]


def test_every_variant_has_a_kernel_entry():
    for v in backends.compiled_variants():
        assert v.removesuffix("_emulated") in KERNELS, f"{v}: add its kernel to kernel_tester.KERNELS"


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_table_matches_the_sources(name):
    """The thresholds the harness tests around are the ones the kernel source uses."""
    k = KERNELS[name]
    found = defines_in_source(k.source)
    assert {d: found.get(d) for d in k.defines} == k.defines, f"update kernel_tester.KERNELS[{name!r}]"


@pytest.mark.parametrize("fmt", list(WEIGHT_FORMATS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_token_counts_at_the_thresholds(variant, fmt):
    """One expert per token count m in token_counts(variant): every path of the kernel, and the
    first m of each, in one forward call."""
    check(variant, Case(fmt=fmt, m=token_counts(variant)))


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "200x72"])  # 200x72: the test above
@pytest.mark.parametrize("fmt", ["per_channel", "block32x34", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_odd_shapes(variant, fmt, shape):
    hidden, inter = SHAPES[shape]
    check(variant, Case(fmt=fmt, hidden=hidden, inter=inter, m=token_counts(variant), seed=3))


@pytest.mark.parametrize("fmt", ["block128", "block64"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_block_wise_decode_in_whole_blocks(variant, fmt):
    """K a multiple of 2 blocks (hidden 512, intermediate 256): avx512_bf16 reads one token's tiles
    as two streams of whole scale blocks each (decode_blocks), every half's blocks scaled by their
    own scales; one- and few-token experts beside it."""
    check(variant, Case(fmt=fmt, hidden=512, inter=256, m=(1, 1, 2, 5), seed=13))


@pytest.mark.parametrize("fmt", ["per_channel", "block64", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_input(variant, fmt):
    """x and y in bfloat16: the kernel's activation rounding plus the output's."""
    check(variant, Case(fmt=fmt, m=token_counts(variant), x_dtype=BF16, seed=5))


AMX = [v for v in VARIANTS if v.removesuffix("_emulated") == "amx"]


@pytest.mark.skipif(not AMX, reason="no amx variant in this build")
@pytest.mark.parametrize("fmt", ["per_channel", "block128", "bf16"])
@pytest.mark.parametrize("variant", AMX)
def test_amx_parked_chunks_over_several_k_blocks(variant, fmt):
    """Experts of 49..256 tokens over a K of several of amx's parked-pass K blocks (8 slabs of 32):
    hidden 704 = 22 slabs (blocks of 8, 8, 6), intermediate 288 = 9 (8, 1), so the chunks beyond
    the third (up to 13 of them, the last one short) are parked and picked up again across block
    ends in both projections; block-wise weights with a short last scale block (704 = 5.5 x 128),
    BF16 weights on their own path."""
    check(variant, Case(fmt=fmt, hidden=704, inter=288, m=(49, 64, 80, 81, 250), seed=17))


@pytest.mark.parametrize("variant", NATIVE_FAST)  # software emulation is ~100x slower: T <= 65 above
def test_many_tokens(variant):
    """Hundreds of rows per expert: the prefill paths reuse a converted tile many times."""
    check(variant, Case(m=(700, 300, 41), seed=7))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_code_is_exact(variant):
    """Row j of down holds the single code j at K index 0.  Gate and up rows hold 448 and 1 at K 0,
    and x = e_0, so h = silu(448) * 1 = 448 exactly (exp(-448) is 0 in float32), in BF16 too.
    So y[t, j] = 448 * decode(j) * scale[j]: one rounding in every kernel, the same as float64's
    rounded once -- bit-identical for all 256 codes, subnormals and +-0 included; the NaN codes
    0x7F, 0xFF give NaN in their own column only.  Each expert gets one of the variant's token
    counts, each token one expert."""
    m = token_counts(variant)
    E, hidden, inter = len(m), 256, 16
    code = lambda v: np.float32(v).astype(E4M3).view(np.uint8)  # noqa: E731
    gate = np.zeros((E, inter, hidden), np.uint8)
    gate[:, :, 0] = code(448)
    up = np.zeros_like(gate)
    up[:, :, 0] = code(1)
    down = np.zeros((E, hidden, inter), np.uint8)
    down[:, :, 0] = np.arange(hidden)
    ones = np.ones((E, inter, 1), np.float32)
    down_scale = np.random.default_rng(5).uniform(0.5, 2.0, (E, hidden, 1)).astype(np.float32)
    down_scale[:] = down_scale[:1]
    from ktfp8.experts import ExpertWeights
    experts = ExpertWeights("fp8_per_channel", gate, up, down, ones, ones, down_scale)
    dense = [dequantize(gate, ones), dequantize(up, ones), dequantize(down, down_scale)]
    ids = np.repeat(np.arange(E), m)[:, None]
    x = np.zeros((ids.shape[0], hidden), np.float32)
    x[:, 0] = 1
    y = check_inputs(variant, experts, dense, x, ids, np.ones(ids.shape, np.float32), what="every code")
    values = np.arange(hidden, dtype=np.uint8).view(E4M3).astype(np.float64)
    expected = (448 * values * down_scale[0, :, 0]).astype(np.float32)
    assert np.all(expected[[0x01, 0x81, 0x07, 0x87]] != 0)  # subnormal codes are in the check
    np.testing.assert_array_equal(y, np.broadcast_to(expected, y.shape))  # NaN columns: NaN == NaN
    assert np.array_equal(np.flatnonzero(np.isnan(y[0])), [0x7F, 0xFF])


@pytest.mark.parametrize("fmt", ["per_channel", "block64", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_nan_stays_where_it_belongs(variant, fmt):
    """A NaN weight in down row 7 of expert 2 makes column 7 NaN for expert 2's tokens; one in a gate
    row of expert 1 makes all of y NaN for expert 1's tokens (through h); a NaN in x makes its own
    token's row NaN.  Everything else stays finite and equal to the oracle (check: NaN exactly where
    the float64 MoE on the same NaN weights has it).  FP8: the NaN codes 0x7F / 0xFF."""
    case = Case(fmt=fmt, m=token_counts(variant), seed=9)
    experts, dense = layer(case)
    nan = np.nan if fmt == "bf16" else np.uint8(0xFF)
    experts.down[2, 7, 40] = nan
    experts.gate[1, 3, 5] = 0x7F if fmt != "bf16" else nan
    dense[2][2, 7, 40] = dense[0][1, 3, 5] = np.nan
    ids, w = routing(case.m, seed=10, tokens=max(case.m) + 4)  # + 4: tokens that meet no NaN
    x = np.random.default_rng(11).standard_normal((ids.shape[0], case.hidden)).astype(np.float32)
    x[-1, 17] = np.nan
    y = check_inputs(variant, experts, dense, x, ids, w, what=f"NaN {fmt}")
    assert np.isnan(y[:, 7]).any() and np.isfinite(y).any()


@pytest.mark.parametrize("x_dtype", [np.float32, BF16])
@pytest.mark.parametrize("scale", [1e-15, 1e-12, 3e4, 1e6, 1e15])
@pytest.mark.parametrize("fmt", ["per_channel", "block32x34"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_activations_of_any_magnitude(variant, fmt, scale, x_dtype):
    """x times 1e-15 .. 1e15, so h spans about 1e-31 .. 1e29, given as float32 or bfloat16.  avx2
    reads FP8 activations times 2^112 (layout.act_exp): from |x| or |h| of 2^14 on, the driver must
    apply a smaller power and the kernel put the difference back; tiny ones must lose nothing to
    underflow."""
    case = Case(fmt=fmt, m=token_counts(variant), seed=21, x_dtype=x_dtype)
    experts, dense = layer(case)
    x, ids, w = inputs(case)
    x = (x.astype(np.float32) * np.float32(scale)).astype(x_dtype)
    check_inputs(variant, experts, dense, x, ids, w, what=f"x * {scale:g} {np.dtype(x_dtype).name}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_infinite_activation_spoils_only_its_token(variant):
    """One x value is +inf, the others about 1e10 (x * 2^112 would overflow): every other token
    stays equal to the oracle, so the scaling of act_exp kernels is chosen by the finite values."""
    case = Case(fmt="per_channel", m=token_counts(variant), seed=22)
    experts, dense = layer(case)
    x, ids, w = inputs(case)
    x *= np.float32(1e10)
    x[0, 3] = np.inf
    y = np.asarray(run(variant, experts, x, ids, w), np.float64)
    want = expected(dense, x, ids, w, kernel(variant).act)
    assert not np.isfinite(y[0]).all()
    assert_matches(y[1:], want[1:], oracle_budget(kernel(variant).act, x.dtype), f"{variant} +inf in token 0")


@pytest.mark.parametrize("variant", VARIANTS)
def test_zeros_and_skipped_slots(variant):
    """Exact zeros: a down row of zero codes gives a zero column; a zero token, and a token whose
    every slot is < 0 (experts held elsewhere), a zero row.  A token also meets one expert twice."""
    case = Case(fmt="block64", m=token_counts(variant), seed=11)
    experts, dense = layer(case)
    experts.down[:, 9, :] = 0
    dense[2][:, 9, :] = 0
    ids, w = routing(case.m, seed=12, tokens=max(case.m) + 2)
    ids[-1] = -1
    ids[0, :2] = ids[0, 0] if ids[0, 0] >= 0 else 0
    x = np.random.default_rng(13).standard_normal((ids.shape[0], case.hidden)).astype(np.float32)
    x[-2] = 0
    y = check_inputs(variant, experts, dense, x, ids, w, what="zeros")
    routed = (ids >= 0).any(axis=1)
    routed[-2] = False
    assert np.all(y[:, 9] == 0) and np.all(y[-2:] == 0) and np.all(y[routed][:, :9] != 0)


def test_token_counts_cover_each_threshold():
    """The m the harness runs straddle every path change: e.g. avx512's DECODE_M = 4."""
    for name, k in KERNELS.items():
        m = token_counts(name)
        for edge in k.edges(k.defines):
            assert {edge - 1, edge, edge + 1} <= set(m) | {0}, name
    assert {4, 5}.issubset(token_counts("avx512")) and kernel("avx512_emulated") is KERNELS["avx512"]
