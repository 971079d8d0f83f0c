"""MoE over contiguous shards of a layer's experts: partial outputs sum to the whole layer's output;
the loader and quantize_experts produce shards holding (and mapping) only their experts' bytes.
Oracles: the unsharded MoE, the float64 layer of moe_oracle with the other experts' ids skipped, and
the checkpoint bytes written here."""
import ml_dtypes
import numpy as np
import pytest
try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:                     # NumPy 1.x (tools/oldest_deps_tests.sh)
    from numpy import byte_bounds

import ktfp8
from ktfp8.experts import ExpertWeights
from ktfp8.loader import FP8SafeTensorLoader
from ktfp8.moe import MoE
from ktfp8.safetensors_io import write_file
from moe_oracle import make_experts, moe_fp64, nmse, random_routing

E, H, I, K = 7, 136, 40, 3          # 7 experts: every split below is uneven
FORMATS = ["fp8_per_channel", "fp8_block", "bf16"]
BACKENDS = ktfp8.available_backends()   # native ones only: the sharding is the same Python for all
SPLITS = {2: [range(0, 3), range(3, 7)], 3: [range(0, 2), range(2, 5), range(5, 7)]}


def config(fmt):
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    cfg.quant_config.method = "BF16" if fmt == "bf16" else "FP8"
    cfg.quant_config.per_channel = fmt != "fp8_block"
    cfg.quant_config.group_size = 32 if fmt == "fp8_block" else 0
    return cfg


@pytest.fixture(scope="module", params=FORMATS)
def layer(request):
    fmt = request.param
    experts, dense = make_experts(fmt, E, H, I, seed=3, block=32)
    return fmt, config(fmt), experts, dense


def _inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, w = random_routing(T, E, K, seed=seed, skip_fraction=0.1)
    return x, ids, w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", sorted(SPLITS))
def test_partial_outputs_sum_to_the_whole(layer, backend, n):
    fmt, cfg, experts, dense = layer
    x, ids, w = _inputs(37, seed=n)
    whole = MoE(cfg, experts, backend=backend, threads=1)(x, ids, w)
    total = np.zeros_like(x)
    for part in SPLITS[n]:
        shard = experts.shard(part)
        moe = MoE(cfg, shard, backend=backend, threads=1)
        y = moe(x, ids, w)
        outside = np.where((ids >= part.start) & (ids < part.stop), ids, -1)
        assert nmse(y, moe_fp64(x, outside, w, *dense)) < 1e-4    # the shard's own share, independently
        moe(x, ids, w, out=total, accumulate=True)
    # FP32 sums of the same products in another grouping: a few ulps of the largest output
    np.testing.assert_allclose(total, whole, rtol=0, atol=8 * np.finfo(np.float32).eps * np.abs(whole).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [24, 1500])
def test_tokens_routed_inside_one_shard_are_bit_identical(layer, backend, T):
    """When all of a token's experts live in one shard, its row is that shard's row, bit for bit
    (the other shards add exact zeros), in float32 and bfloat16.  T = 1500 runs phase 2 in token
    blocks (moe_driver.c, phase2_block_tokens), which must come out the same for a shard as for the whole
    layer: the first shard gets a twentieth of the tokens, the others the rest in turn."""
    fmt, cfg, experts, _ = layer
    parts = SPLITS[3]
    rng = np.random.default_rng(5)
    ids = np.full((T, K), -1, np.int64)
    for t in range(T):
        part = parts[0] if t % 20 == 0 else parts[1 + t % 2]
        chosen = rng.permutation(part)[:K]
        ids[t, :len(chosen)] = chosen
    w = rng.random((T, K)).astype(np.float32)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        x = rng.standard_normal((T, H)).astype(dtype)
        whole = MoE(cfg, experts, backend=backend, threads=1)(x, ids, w)
        total = np.zeros_like(x)
        for part in parts:
            MoE(cfg, experts.shard(part), backend=backend, threads=1)(x, ids, w, out=total, accumulate=True)
        np.testing.assert_array_equal(total.view(np.uint8), whole.view(np.uint8))


def test_quantize_experts_shard_equals_the_same_experts_of_the_whole(layer):
    fmt, cfg, _, dense = layer
    gate, up, down = (a.astype(np.float32) for a in dense)
    whole = ktfp8.quantize_experts(gate, up, down, cfg.quant_config)
    part = range(2, 5)
    shard = ktfp8.quantize_experts(gate, up, down, cfg.quant_config, experts=part)
    assert (shard.first_expert, shard.total_experts, shard.expert_range) == (2, E, part)
    for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"):
        a, b = getattr(shard, name), getattr(whole, name)
        if b is not None:
            np.testing.assert_array_equal(a.view(np.uint8), b[2:5].view(np.uint8))


def test_shard_memory_is_its_fraction_of_the_layer(layer):
    fmt, cfg, experts, _ = layer
    whole = MoE(cfg, experts, threads=1)
    for n, parts in SPLITS.items():
        shards = [MoE(cfg, experts.shard(p), threads=1) for p in parts]
        assert sum(s.nbytes for s in shards) == pytest.approx(whole.nbytes, rel=0.02)
        for p, s in zip(parts, shards):
            assert s.nbytes == pytest.approx(whole.nbytes * len(p) / E, rel=0.02)
            assert experts.shard(p).nbytes == experts.nbytes * len(p) // E


@pytest.mark.parametrize("bad, error, match", [
    (range(0, 0), ValueError, "at least one expert"),
    (range(3, 3), ValueError, "at least one expert"),
    (range(5, 9), ValueError, r"outside the layer's experts range\(0, 7\)"),
    (range(-1, 2), ValueError, "outside"),
    (range(0, 6, 2), ValueError, "contiguous"),
    ([0, 1, 2], TypeError, "must be a range"),
    (slice(0, 3), TypeError, "must be a range"),
])
def test_bad_ranges_are_refused(layer, bad, error, match):
    fmt, cfg, experts, dense = layer
    with pytest.raises(error, match=match):
        experts.shard(bad)
    with pytest.raises(error, match=match):
        ktfp8.quantize_experts(*(a.astype(np.float32) for a in dense), cfg.quant_config, experts=bad)


def test_shard_consistency_errors(layer):
    fmt, cfg, experts, _ = layer
    shard = experts.shard(range(2, 5))
    with pytest.raises(ValueError, match="not inside the experts held"):
        shard.shard(range(0, 3))
    x, ids, w = _inputs(4)
    ids[1, 0] = E                              # a global id past the layer: refused, even on a shard
    with pytest.raises(ValueError, match="expert_num"):
        MoE(cfg, shard)(x, ids, w)
    arrays = (shard.gate, shard.up, shard.down, shard.gate_scale, shard.up_scale, shard.down_scale)
    with pytest.raises(ValueError, match="beyond total_experts"):
        ExpertWeights(fmt, *arrays, block=shard.block, first_expert=5, total_experts=E)
    with pytest.raises(ValueError, match="first_expert must be a non-negative int"):
        ExpertWeights(fmt, *arrays, block=shard.block, first_expert=-1)
    with pytest.raises(ValueError, match="config says"):   # a shard of a 9-expert layer, config of 7
        MoE(cfg, ExpertWeights(fmt, *arrays, block=shard.block, first_expert=2, total_experts=9))


# -- the loader maps only a shard's bytes -------------------------------------------------------

def _write_checkpoint(folder, experts):
    """One safetensors file in DeepSeek/Qwen naming, expert after expert (as HF writes them)."""
    names = {"fp8_per_channel": "weight_scale", "fp8_block": "weight_scale_inv"}
    tensors = {}
    for e in range(experts.expert_num):
        for role in ("gate", "up", "down"):
            prefix = f"model.layers.0.mlp.experts.{e}.{role}_proj"
            w = getattr(experts, role)[e]
            if experts.format == "bf16":
                tensors[f"{prefix}.weight"] = ("BF16", w)
            else:
                tensors[f"{prefix}.weight"] = ("F8_E4M3", w.view(np.uint8))
                tensors[f"{prefix}.{names[experts.format]}"] = ("F32", getattr(experts, f"{role}_scale")[e])
    folder.mkdir()
    write_file(folder / "model.safetensors", tensors)
    if experts.format == "fp8_block":
        (folder / "config.json").write_text('{"quantization_config": {"weight_block_size": [32, 32]}}')
    return folder


def test_loader_shard_maps_only_its_experts(layer, tmp_path):
    fmt, cfg, experts, _ = layer
    loader = FP8SafeTensorLoader(_write_checkpoint(tmp_path / fmt, experts))
    whole = loader.load_experts(0)
    assert loader.expert_count(0) == E
    for part in SPLITS[3]:
        shard = loader.load_experts(0, experts=part)
        assert (shard.expert_range, shard.total_experts) == (part, E)
        for role in ("gate", "up", "down"):
            got = getattr(shard, role)
            np.testing.assert_array_equal(got.view(np.uint8), getattr(experts, role)[part.start:part.stop]
                                          .view(np.uint8))
            # a view on the file's memory map spanning exactly this shard's experts: experts lie
            # `step` bytes apart in the file, so n of them span (n - 1) * step + one expert's bytes
            lo, hi = byte_bounds(got)
            whole_lo, whole_hi = byte_bounds(getattr(whole, role))
            one = got[0].nbytes
            step = (whole_hi - whole_lo - one) // (E - 1)
            assert not got.flags.owndata and not got.flags.writeable
            assert (lo, hi) == (whole_lo + part.start * step, whole_lo + (part.stop - 1) * step + one)
        assert shard.nbytes == whole.nbytes * len(part) // E
    x, ids, w = _inputs(9)
    total = np.zeros_like(x)
    for part in SPLITS[2]:
        MoE(cfg, loader.load_experts(0, experts=part), threads=1)(x, ids, w, out=total, accumulate=True)
    want = MoE(cfg, whole, threads=1)(x, ids, w)
    np.testing.assert_allclose(total, want, rtol=0, atol=8 * np.finfo(np.float32).eps * np.abs(want).max())
    with pytest.raises(ValueError, match="outside"):
        loader.load_experts(0, experts=range(6, 8))
    with pytest.raises(TypeError, match="must be a range"):
        loader.load_experts(0, experts=3)
