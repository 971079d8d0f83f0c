"""The packed layout each backend's kernel reads (include/ktfp8/abi.h), built here by NumPy from its
description alone and compared byte for byte with what MoE construction packs: tiles of NB rows,
[K_pad / KP][NB][KP] weights, zero outside the matrix, FP8 codes permuted inside each 64-byte group
into the kernel's order, scales times scale_mul, NaN where the row (block) holds a NaN code.  The
packer takes whole 16-row tiles through SSE2 transposes and the rest weight by weight; shapes with
both are drawn."""
import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8 import backends

K_ALIGN = 32
# variant (emulated twins as their native kernel) -> (NB, KP, FP8 code order, scale_mul), as each
# kernel's ktfp8_layout says
LAYOUTS = {"reference": (1, 1, "natural", 1.0), "avx2": (16, 1, "pairs32", 256.0),
           "avx512": (16, 1, "natural", 256.0), "avx512_bf16": (16, 2, "vbmi64", 1.0), "amx": (16, 2, "vbmi64", 1.0)}
SHAPES = [(32, 16), (64, 48), (17, 33), (100, 19), (48, 40), (7, 1)]
BLOCK = 16


def _vbmi64(group):
    """KTFP8_CODES_VBMI64: lane L of the 64 bytes holds natural bytes 8L..8L+7, then 32+8L..32+8L+7."""
    lanes = [np.concatenate([group[8 * L:8 * L + 8], group[32 + 8 * L:40 + 8 * L]]) for L in range(4)]
    return np.concatenate(lanes)


def _pairs32(group):
    """KTFP8_CODES_PAIRS32: per 32 bytes (two K steps of 16 rows), dword d = bytes of (row d + 8, step 1),
    (d + 8, step 0), (d, step 1), (d, step 0)."""
    out = np.empty(64, np.uint8)
    for half in (0, 32):
        for d in range(8):
            out[half + 4 * d:half + 4 * d + 4] = [group[half + 16 + d + 8], group[half + d + 8],
                                                 group[half + 16 + d], group[half + d]]
    return out


def _expected_tiles(w, nb, kp, order):
    """The weight region of one projection: w [E, N, K] (uint8 codes or uint16 BF16 bits)."""
    E, N, K = w.shape
    n_tiles, k_pad = -(-N // nb), -(-K // K_ALIGN) * K_ALIGN
    padded = np.zeros((E, n_tiles * nb, k_pad), w.dtype)
    padded[:, :N, :K] = w
    # [E, tile, row, k] -> [E, tile, k / kp, row, kp]
    tiles = padded.reshape(E, n_tiles, nb, k_pad // kp, kp).transpose(0, 1, 3, 2, 4)
    raw = np.ascontiguousarray(tiles).view(np.uint8).reshape(E * n_tiles, -1)
    if w.dtype == np.uint8 and order != "natural":
        permute = _vbmi64 if order == "vbmi64" else _pairs32
        raw = np.stack([np.concatenate([permute(t[g:g + 64]) for g in range(0, t.size, 64)]) for t in raw])
    return raw.reshape(-1)


def _expected_scales(codes, scale, nb, scale_mul, block):
    """The scale region of one projection: [E][tile][k-block][NB] float32."""
    E, N, K = codes.shape
    n_tiles = -(-N // nb)
    kbs = -(-K // block) if block else 1
    out = np.zeros((E, n_tiles * nb, kbs), np.float32)
    nan = (codes & 0x7F) == 0x7F
    for kb in range(kbs):
        k0, k1 = (kb * block, min(K, kb * block + block)) if block else (0, K)
        v = scale[:, np.arange(N) // block, kb] if block else scale[:, :, 0]
        out[:, :N, kb] = np.where(nan[:, :, k0:k1].any(axis=2), np.float32(np.nan), v * np.float32(scale_mul))
    return out.reshape(E, n_tiles, nb, kbs).transpose(0, 1, 3, 2).reshape(-1)


def _regions(packed, sizes):
    """Split the packed buffer into its regions (each starts on a 64-byte boundary)."""
    out, at = [], 0
    for size in sizes:
        out.append(packed[at:at + size])
        at += -(-size // 64) * 64
    assert at == packed.size
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}xI{s[1]}")
@pytest.mark.parametrize("fmt", ["fp8_per_channel", "fp8_block", "bf16"])
@pytest.mark.parametrize("variant", backends.usable_variants())
def test_packed_bytes_are_the_layout_the_kernel_reads(variant, fmt, shape):
    H, I = shape
    rng = np.random.default_rng(H * 100 + I)
    dims = [(I, H), (I, H), (H, I)]
    if fmt == "bf16":
        w = [rng.integers(0, 1 << 16, (2, n, k), dtype=np.uint16) & 0x7F7F for n, k in dims]   # finite bits
    else:
        w = [rng.integers(0, 256, (2, n, k), dtype=np.uint8) for n, k in dims]     # NaN codes among them
    _check_packing(variant, fmt, w, rng)


@pytest.mark.parametrize("shape", [(130, 48), (33, 100)], ids=lambda s: f"H{s[0]}xI{s[1]}")
@pytest.mark.parametrize("fmt", ["fp8_per_channel", "fp8_block"])
@pytest.mark.parametrize("variant", backends.usable_variants())
def test_one_nan_code_anywhere_in_a_row_makes_its_scale_nan(variant, fmt, shape):
    """Every other row holds one NaN code and the rows between none, the NaN at a position that moves
    on by one from row to row (across the experts too, so each matrix meets every position of its
    width): a scan that misses a NaN code in some part of a row -- a vector body, its tail, a block's
    edge -- leaves a finite scale where the layout has NaN, and one that sees NaN where there is none
    a NaN scale where it has a finite one."""
    H, I = shape
    E = 8
    rng = np.random.default_rng(H + I)
    w = []
    for n, k in [(I, H), (I, H), (H, I)]:
        codes = rng.integers(0, 256, (E * n, k), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 1               # no NaN code ...
        rows = np.arange(0, E * n, 2)
        assert len(rows) >= k
        codes[rows, rows // 2 % k] |= 0x7F               # ... but one in every other row
        w.append(codes.reshape(E, n, k))
    _check_packing(variant, fmt, w, rng)


def _check_packing(variant, fmt, w, rng):
    """MoE construction on gate, up, down = w ([E, I, H], [E, I, H], [E, H, I]: uint16 BF16 bits, or
    uint8 codes with random scales) against the layout built here from abi.h's description."""
    nb, kp, order, scale_mul = LAYOUTS[variant.removesuffix("_emulated")]
    E, I, H = w[0].shape
    dims = [(I, H), (I, H), (H, I)]
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=1, hidden_size=H, intermediate_size=I)
    if fmt == "bf16":
        cfg.quant_config.method = "BF16"
        experts = ktfp8.ExpertWeights("bf16", *(a.view(ml_dtypes.bfloat16) for a in w))
        scales, block = [None] * 3, None
    else:
        block = BLOCK if fmt == "fp8_block" else None
        if block:
            cfg.quant_config.per_channel, cfg.quant_config.group_size = False, BLOCK
        scales = [rng.uniform(0.5, 2.0, (E, -(-n // BLOCK), -(-k // BLOCK)) if block else (E, n, 1))
                  .astype(np.float32) for n, k in dims]
        experts = ktfp8.ExpertWeights(fmt, *w, *scales, block=(BLOCK, BLOCK) if block else None)
    packed = np.asarray(ktfp8.MoE(cfg, experts, backend=variant, threads=2)._kernel.packed).view(np.uint8).reshape(-1)
    sizes, expected = [], []
    for a, sc in zip(w, scales):
        expected.append(_expected_tiles(a, nb, kp, order))
        sizes.append(expected[-1].size)
        if fmt != "bf16":
            expected.append(_expected_scales(a, sc, nb, scale_mul, block))
            sizes.append(expected[-1].nbytes)
    for i, (got, want) in enumerate(zip(_regions(packed, sizes), expected)):
        if want.dtype == np.float32:
            np.testing.assert_array_equal(got.view(np.float32), want, err_msg=f"scale region {i // 2}")
        else:
            np.testing.assert_array_equal(got, want, err_msg=f"weight region {i // (1 if fmt == 'bf16' else 2)}")
