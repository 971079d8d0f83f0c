"""From a checkpoint to a packed MoE without a copy of the expert weights, however the checkpoint lays
its experts out: one after another (gate, up, down of expert 0, then of expert 1: a strided view),
in safetensors' string order of names (experts 0, 1, 10, 11, ..., 2, ...: no view covers them), or
over two shards.  Oracles: tracemalloc (NumPy reports its allocations to it) for the bytes, the
codes written for the values, and the MoE over the same experts stacked for the output."""
import tracemalloc

import numpy as np
import pytest

import ktfp8
from ktfp8.experts import ExpertMatrices, ExpertWeights
from ktfp8.loader import FP8SafeTensorLoader
from ktfp8.safetensors_io import write_file
from moe_oracle import make_experts, random_routing

E, H, I, K = 16, 256, 128, 4
ROLES = ("gate", "up", "down")


def _tensors(experts, ids):
    """{name: (dtype, array)} of experts `ids`, expert after expert, DeepSeek/Qwen naming."""
    out = {}
    for e in ids:
        for role in ROLES:
            prefix = f"model.layers.0.mlp.experts.{e}.{role}_proj"
            out[f"{prefix}.weight"] = ("F8_E4M3", getattr(experts, role)[e])
            out[f"{prefix}.weight_scale"] = ("F32", getattr(experts, f"{role}_scale")[e])
    return out


def _write(folder, experts, layout):
    folder.mkdir()
    if layout == "expert_after_expert":            # as ktfp8's writer and a hand-made file may have it
        write_file(folder / "model.safetensors", _tensors(experts, range(E)))
    elif layout == "string_order":                 # as safetensors' writer sorts names (F8 before F32)
        tensors = _tensors(experts, range(E))
        write_file(folder / "model.safetensors", {n: tensors[n] for n in sorted(tensors, key=lambda n: (
            tensors[n][0] != "F8_E4M3", n))})
    else:                                          # a layer over two shards
        write_file(folder / "model-00001-of-00002.safetensors", _tensors(experts, range(E // 2)))
        write_file(folder / "model-00002-of-00002.safetensors", _tensors(experts, range(E // 2, E)))
    return folder


@pytest.mark.parametrize("layout", ["expert_after_expert", "string_order", "two_shards"])
def test_experts_are_packed_from_where_they_lie(layout, tmp_path):
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=11)
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    loader = FP8SafeTensorLoader(_write(tmp_path / layout, experts, layout))
    weight_bytes = sum(getattr(experts, role).nbytes for role in ROLES)
    tracemalloc.start()
    try:
        loaded = loader.load_experts(0)
        load_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        moe = ktfp8.MoE(cfg, loaded, backend="reference", threads=1)
        pack_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a copy of the weights would be weight_bytes more: at load (np.stack) or at packing
    # (np.ascontiguousarray of a strided view); the packed copy itself is moe.nbytes
    assert load_peak < weight_bytes / 8, f"load_experts allocated {load_peak} bytes for {weight_bytes}"
    assert pack_peak < moe.nbytes + weight_bytes / 8, f"MoE() allocated {pack_peak} beside {moe.nbytes} packed"
    if layout != "expert_after_expert":
        assert isinstance(loaded.gate, ExpertMatrices)
    for role in ROLES:
        np.testing.assert_array_equal(np.asarray(getattr(loaded, role)).view(np.uint8),
                                      getattr(experts, role).view(np.uint8))
    stacked = ExpertWeights("fp8_per_channel", *(np.asarray(getattr(loaded, r)) for r in ROLES),
                            *(getattr(loaded, f"{r}_scale") for r in ROLES))
    x = np.random.default_rng(3).standard_normal((9, H)).astype(np.float32)
    ids, w = random_routing(9, E, K, seed=4)
    np.testing.assert_array_equal(moe(x, ids, w), ktfp8.MoE(cfg, stacked, backend="reference", threads=1)(x, ids, w))
    # a shard of it, as a rank or NUMA node takes it: views again
    part = loaded.shard(range(3, 11))
    np.testing.assert_array_equal(np.asarray(part.down).view(np.uint8), experts.down[3:11].view(np.uint8))


def test_expert_matrices_behave_as_the_stacked_array():
    rng = np.random.default_rng(0)
    mats = [rng.integers(0, 255, (5, 7), dtype=np.uint8) for _ in range(4)]
    stack, whole = ExpertMatrices(mats), np.stack(mats)
    assert stack.shape == whole.shape and stack.dtype == whole.dtype and stack.ndim == 3 and len(stack) == 4
    assert stack.nbytes == whole.nbytes
    assert stack[2] is mats[2]
    np.testing.assert_array_equal(stack[1, 3], whole[1, 3])
    np.testing.assert_array_equal(np.asarray(stack[1:3]), whole[1:3])
    np.testing.assert_array_equal(stack[:, 0], whole[:, 0])
    np.testing.assert_array_equal(np.asarray(stack.view(np.int8)), whole.view(np.int8))
    with pytest.raises(ValueError, match="one shape and dtype"):
        ExpertMatrices([mats[0], mats[1][:, :3]])
    with pytest.raises(ValueError, match="at least one"):
        ExpertMatrices([])


@pytest.mark.parametrize("per_channel", [True, False])
def test_quantizing_a_fused_layout_copies_no_stack(per_channel):
    """transformers' fused gate_up_proj [E, 2I, H] cut in halves (as ktfp8.hf quantizes it) is a stack
    whose experts are each in C order but not one after another: quantize_experts made a C-order copy of
    each half, and the finiteness check another (a helper's audit: peak 384 MiB for 289 of output on the
    benchmark layer).  The peak is now the output alone."""
    import ml_dtypes
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((E, 2 * I, H), dtype=np.float32).astype(ml_dtypes.bfloat16)
    down = rng.standard_normal((E, H, I), dtype=np.float32).astype(ml_dtypes.bfloat16)
    quant = ktfp8.QuantConfig("FP8", per_channel=per_channel, group_size=0 if per_channel else 64)
    tracemalloc.start()
    try:
        got = ktfp8.quantize_experts(gate_up[:, :I], gate_up[:, I:], down, quant)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out = sum(getattr(got, f).nbytes for f in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"))
    assert peak < out + gate_up[0].nbytes, f"peak {peak} bytes for {out} of output"
    want = ktfp8.quantize_experts(np.ascontiguousarray(gate_up[:, :I]), np.ascontiguousarray(gate_up[:, I:]),
                                  down, quant)
    for f in ("gate", "up", "gate_scale", "up_scale"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))


def _mapped_rss(folder):
    """Resident bytes of this process's maps of files under `folder` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:           # a mapping's first line: address range ... path
                inside = len(head) >= 6 and head[5].startswith(str(folder))
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.parametrize("layout", ["expert_after_expert", "two_shards"])
def test_release_experts_gives_a_packed_layers_mapped_pages_back(layout, tmp_path):
    """While the loader is open a layer's mapped codes stayed resident after packing, so a model loaded
    layer by layer (ktfp8.hf.from_pretrained) held every layer twice until close (a helper's audit: peak
    2668 MiB for 1156 MiB packed).  release_experts drops them; the experts stay valid."""
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=11)
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    folder = _write(tmp_path / layout, experts, layout)
    weight_bytes = sum(getattr(experts, role).nbytes for role in ROLES)
    with FP8SafeTensorLoader(folder) as loader:
        loaded = loader.load_experts(0)
        ktfp8.MoE(cfg, loaded, threads=1)
        assert _mapped_rss(folder) >= weight_bytes            # the packer read every code
        loader.release_experts(0)
        assert _mapped_rss(folder) <= 2 * 4096 * 3 * E        # at most the shared pages at tensors' ends
        for role in ROLES:                                    # read back from the page cache
            np.testing.assert_array_equal(np.asarray(getattr(loaded, role)).view(np.uint8),
                                          getattr(experts, role).view(np.uint8))
