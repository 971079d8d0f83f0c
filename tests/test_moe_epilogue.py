"""The driver's elementwise steps against float64: act(gate) * up through a layer whose projections
are identities, so y = act(x) * x with no other rounding (FP32 activations) or with the BF16
roundings of the activation dtype, for both activations (SiLU; Gemma's tanh GELU, written from its
definition).  Bounds are the ones stated in include/ktfp8/moe_epilogue.h."""
import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8 import backends
from ktfp8.experts import ExpertWeights
from ktfp8.moe import MoE
from kernel_tester import F32, kernel

T = 48  # tokens of N values each, H = I = N
# 256: whole tiles of 16 columns (pairs of them to the scatter, for the kernels that take two a call);
# 264: a last tile of 8 columns; 272: 17 tiles, the last down item a single one
WIDTHS = (256, 264, 272)
SILU_MAX_ULP = 2  # of silu(x) * x against float64, FP32 activations (moe_epilogue.h)
# the tanh GELU is x * sigmoid(z), z = x (A + B x^2) in float32: four roundings of half an ulp each and
# the constants' own (A 0.24 ulp, B 0.28) put z within 2.5 ulp, which grow |z| times through the
# exponential, so its bound is SILU_MAX_ULP + GELU_ULP_PER_Z |z| ulp (a helper's sweep of every 7th float
# in [-10, -5], where |z| is large and the result still above the flush: at most 1.43 |z| + 2)
GELU_ULP_PER_Z = 2.5
ONE = 0x38  # e4m3 code of 1.0


def _identity_layer(backend, N, act="silu"):
    eye = np.zeros((1, N, N), np.uint8)
    eye[0, np.arange(N), np.arange(N)] = ONE
    ones = np.ones((1, N, 1), np.float32)
    cfg = ktfp8.MoeConfig(expert_num=1, num_experts_per_tok=1, hidden_size=N, intermediate_size=N, hidden_act=act)
    cfg.quant_config.method = "FP8"
    cfg.quant_config.per_channel = True
    return MoE(cfg, ExpertWeights("fp8_per_channel", eye, eye, eye, ones, ones, ones), backend=backend)


def _inputs(N):
    """Dense near 0 where silu bends, densest on [-10, -5] where the GELU's z is large and its result not
    yet flushed to -0, then out to where e^-|x| underflows; never 0 (relative error)."""
    x = np.concatenate([np.linspace(-12, 12, T * N // 3), np.linspace(-10, -5, T * N // 3),
                        np.linspace(-95, 95, T * N // 3)])
    x = x[x != 0].astype(np.float32)
    x = np.concatenate([x, np.full(T * N - x.size, 1.5, np.float32)])
    return x.reshape(T, N)


def _sigmoid_argument(x, act):
    """z of act(x) = x * sigmoid(z), float64."""
    x = x.astype(np.float64)
    return x if act == "silu" else 2 * np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)


def _act_times_x(x, act):
    """act(x) * x in float64: x * sigmoid(z) * x (for the GELU, its definition 0.5 x (1 + tanh(z / 2))
    written that way, which float64 keeps exact where 1 + tanh cancels)."""
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x64 / (1 + np.exp(-_sigmoid_argument(x, act))) * x64


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("backend", backends.usable_variants())
def test_activation_times_up_against_float64(backend, N, act):
    moe = _identity_layer(backend, N, act)
    x = _inputs(N)
    ids, w = np.zeros((T, 1), np.int64), np.ones((T, 1), np.float32)
    y = moe(x, ids, w).astype(np.float64)
    z = _sigmoid_argument(x, act)
    if kernel(backend).act is F32:  # FP32 activations: only the epilogue rounds
        want = _act_times_x(x, act)
        ulp = SILU_MAX_ULP + (0 if act == "silu" else GELU_ULP_PER_Z * np.abs(z))
        tol = ulp * 2.0 ** -23 * np.abs(want)
    else:  # BF16 activations: x and h are rounded to bf16 (half an ulp, 2^-9 relative, each)
        xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        want = _act_times_x(xb, act)
        z = _sigmoid_argument(xb, act)
        tol = 2.0 ** -8 * np.abs(want)
    # below z = -86 the epilogue returns -0 (|act| < 4e-36 |x| there): an absolute bound
    tol = np.where(z < -86, 1e-30, tol)
    bad = np.abs(y - want) > tol
    assert not bad.any(), f"{bad.sum()} values off, e.g. x={x[bad][:3]} y={y[bad][:3]} want={want[bad][:3]}"
