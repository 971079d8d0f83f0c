/* The elementwise steps of the MoE driver, written as plain loops over arrays that GCC vectorises
 * with whatever SIMD the including unit is compiled for, with no libm call and no branch per
 * element.  On the AMX Xeon the scalar versions (expf per element, a dtype switch per store) took
 * 11 % of a T = 512 call.
 *
 *   ktfp8_glu(g, u, n, activation, limit)
 *                                   g[i] = act(min(g[i], limit)) * clamp(u[i], -limit, limit), act
 *                                   SiLU or tanh-GELU (enum ktfp8_activation; FP32, in place; limit
 *                                   +inf: act(g) * u.  The clamped SwiGLU of DeepSeek-V4 and
 *                                   GLM-5-Next; NaN stays NaN, as torch.clamp keeps it)
 *   ktfp8_store_row(dst, act, src, n)   src FP32 -> dst in the activation dtype (BF16: nearest even)
 *   ktfp8_load_row(dst, src, dtype, n)  F32 / BF16 / F16 -> FP32
 *   ktfp8_axpy(y, w, z, n)          y[i] += w * z[i]
 *   KTFP8_EPILOGUE_OPS(name)        a ktfp8_epilogue_ops table (abi.h) of the per-item steps built
 *                                   from these, compiled with the unit's flags: each ISA unit defines
 *                                   one for its kernel, so the driver (baseline SSE2, 4 lanes) hands
 *                                   the hot loops to the kernel's SIMD width (AVX2 8 lanes + FMA,
 *                                   AVX-512 16).  The driver itself uses them for its cold steps.
 *                                   FMA contraction may differ by unit: the bounds below hold for all.
 *
 * Both activations are x * sigmoid(z): silu(x) = x * sigmoid(x), and Gemma's tanh GELU
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = x * sigmoid(z) with z = x (A + B x^2),
 * A = 2 sqrt(2/pi), B = 0.044715 A, since (1 + tanh(t)) / 2 = sigmoid(2t).
 * x * sigmoid(z) is evaluated as x * s with s = 1 / (1 + e) for z >= 0 and s = e / (1 + e) for
 * z < 0, e = exp(-|z|) <= 1 (no overflow).  exp on [-86, 0]: Cody-Waite reduction
 * x = n ln2 + r, |r| <= ln2 / 2, Cephes' degree-7 polynomial for e^r, 2^n added to the exponent
 * bits.  Max relative error of silu against float64, measured over every float in [-86, 86] with
 * test_moe_epilogue.py: see SILU_MAX_ULP there (2 ulp); the GELU's adds z's own rounding (up to
 * 2.5 ulp), times |z| (GELU_ULP_PER_Z there).  For z < -86, where |x sigmoid(z)| < 5e-38 |x| (silu: < 4e-36), the
 * result is -0 (the scalar x / (1 + expf(-z)) gives a value below that or -0 there too).  NaN stays
 * NaN; act(+inf) = +inf; act(-inf) = NaN, as x / (1 + expf(-z)) and torch's tanh GELU. */
#ifndef KTFP8_MOE_EPILOGUE_H
#define KTFP8_MOE_EPILOGUE_H

#include <stdint.h>
#include <string.h>

#include "ktfp8/abi.h"
#include "ktfp8/fp8.h"

/* e^x for x in [-86, 0]; below, a meaningless finite or NaN value that callers discard. */
static inline float ktfp8_exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f, round = 12582912.0f; /* 1.5 * 2^23 */
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;  /* ln2_hi exact in 9 bits */
    const float t = x * log2e + round;  /* n = nearest integer of x / ln2, in t's low mantissa bits */
    const float n = t - round;
    uint32_t tb;
    memcpy(&tb, &t, 4);
    const int32_t ni = (int32_t)(tb - 0x4B400000u); /* bits of 1.5 * 2^23 */
    const float r = (x - n * ln2_hi) - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;                        /* e^r in [0.70, 1.42] */
    uint32_t pb;
    memcpy(&pb, &p, 4);
    pb += (uint32_t)ni << 23;                          /* n >= -124: stays a normal float */
    memcpy(&p, &pb, 4);
    return p;
}

/* x * sigmoid(z) after the choices above.  Straight-line so that GCC vectorises the loops that call
 * it: every choice is an integer mask on the bits, and the exp runs on every lane, its value for
 * |z| > 86 (meaningless: 2^n leaves the float range) masked to 0.  (With selects, GCC sinks the exp
 * into a branch, and it does not if-convert a branch holding floating-point arithmetic under the
 * default -ftrapping-math.) */
static inline float ktfp8_x_sigmoid(float x, float z) {
    uint32_t bits;
    memcpy(&bits, &z, 4);
    const uint32_t naz_bits = bits | 0x80000000u; /* -|z| */
    const uint32_t keep = (uint32_t)((int32_t)(bits & 0x7FFFFFFFu) > 0x42AC0000) - 1u; /* |z| <= 86 */
    const uint32_t neg = (uint32_t)-(int32_t)(bits >> 31);                             /* z < 0 */
    float naz, e, num;
    memcpy(&naz, &naz_bits, 4);
    const float e0 = ktfp8_exp_nonpos(naz);
    uint32_t e_bits;
    memcpy(&e_bits, &e0, 4);
    e_bits &= keep;                                          /* e = exp(-|z|), 0 for |z| > 86 */
    const uint32_t num_bits = (e_bits & neg) | (0x3F800000u & ~neg); /* z < 0 ? e : 1 */
    memcpy(&e, &e_bits, 4);
    memcpy(&num, &num_bits, 4);
    return x * (num / (1.0f + e));
}

/* The clamps are selects: NaN fails both compares and stays.  One loop per activation, each
 * vectorised on its own (a per-element choice would cost both). */
static inline void ktfp8_glu(float *restrict g, const float *restrict u, int64_t n, int activation, float limit) {
    if (activation == KTFP8_ACT_GELU_TANH) {
        const float a = 1.59576912f, b = 0.0713548162f; /* 2 sqrt(2/pi), 0.044715 x that */
        for (int64_t i = 0; i < n; i++) {
            const float x = g[i] > limit ? limit : g[i];
            const float up = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
            g[i] = ktfp8_x_sigmoid(x, x * (a + b * (x * x))) * up;
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i] > limit ? limit : g[i];
        const float up = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
        g[i] = ktfp8_x_sigmoid(x, x) * up;
    }
}

/* Same rounding as ktfp8_bf16_from_f32 (fp8.h), branch-free. */
static inline void ktfp8_store_row(void *restrict dst, int act, const float *restrict src, int64_t n) {
    if (act != KTFP8_BF16) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    const uint32_t *b = (const uint32_t *)src;
    uint16_t *out = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t rounded = (b[i] + 0x7FFFu + ((b[i] >> 16) & 1u)) >> 16;
        const uint32_t quiet = (b[i] >> 16) | 0x40u;
        out[i] = (uint16_t)((int32_t)(b[i] & 0x7FFFFFFFu) > 0x7F800000 ? quiet : rounded);
    }
}

static inline void ktfp8_load_row(float *restrict dst, const void *restrict src, int dtype, int64_t n) {
    if (dtype == KTFP8_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else if (dtype == KTFP8_BF16) {
        const uint16_t *h = (const uint16_t *)src;
        uint32_t *out = (uint32_t *)dst;
        for (int64_t i = 0; i < n; i++) out[i] = (uint32_t)h[i] << 16;
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = ktfp8_load_f32(src, dtype, (size_t)i);
    }
}

static inline void ktfp8_axpy(float *restrict y, float w, const float *restrict z, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += w * z[i];
}

static inline void ktfp8_epilogue_glu_store(float *g, const float *u, int64_t m, int64_t nb, int64_t cols, void *h,
                                            int64_t h_stride, int act, int activation, float limit) {
    const size_t esz = act == KTFP8_BF16 ? 2 : 4;
    ktfp8_glu(g, u, m * nb, activation, limit);
    for (int64_t i = 0; i < m; i++) ktfp8_store_row((char *)h + esz * (size_t)(i * h_stride), act, g + i * nb, cols);
}

static inline void ktfp8_epilogue_scatter_add(float *acc, int64_t acc_stride, const int64_t *token, int64_t token0,
                                              const float *weight, const float *z, int64_t z_stride, int64_t m,
                                              int64_t cols) {
    for (int64_t i = 0; i < m; i++)
        ktfp8_axpy(acc + (token[i] - token0) * acc_stride, weight[i], z + i * z_stride, cols);
}

#define KTFP8_EPILOGUE_OPS(name)                                 \
    static const ktfp8_epilogue_ops name = {                     \
        .glu_store = ktfp8_epilogue_glu_store,                   \
        .scatter_add = ktfp8_epilogue_scatter_add,               \
    }

#endif
