"""The plain call (MoE._plain_call): MoE(x, ids, w) on NumPy arrays of the usual kinds skips the full
checks of _checked_call; any other arguments reach them and give the same sums bit for bit, or the same
error as before."""
import ml_dtypes
import numpy as np
import pytest

from ktfp8.moe import MoE
from kernel_tester import moe_config
from moe_oracle import make_experts, moe_fp64, nmse, random_routing

E, H, I, K, T = 6, 200, 72, 3, 5
CONFIG = moe_config("fp8_per_channel", E, H, I, K, block=64)


@pytest.fixture(scope="module")
def weights():
    return make_experts("fp8_per_channel", E, H, I, seed=1)


@pytest.fixture(scope="module")
def layer(weights):
    experts, dense = weights
    return MoE(CONFIG, experts, threads=2), dense


def plain_arguments(dtype=np.float32):
    rng = np.random.default_rng(3)
    ids, w = random_routing(T, E, K, seed=3, skip_fraction=0.1)
    return rng.standard_normal((T, H)).astype(dtype), ids, w


def checked(layer, x, ids, w):
    """The same call through the full checks (out= always takes them)."""
    out = np.empty(x.shape, x.dtype)
    return layer(x, ids, w, out=out)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_plain_call_skips_the_full_checks(layer, monkeypatch, dtype):
    moe, dense = layer
    x, ids, w = plain_arguments(dtype)

    def full_checks(*args, **kwargs):
        raise AssertionError("the plain call went through the full checks")
    with monkeypatch.context() as m:
        m.setattr(MoE, "_checked_call", full_checks)
        y = moe(x, ids, w)
    assert type(y) is np.ndarray and y.dtype == x.dtype and y.shape == x.shape and y.flags.c_contiguous
    np.testing.assert_array_equal(y, checked(moe, x, ids, w))
    assert nmse(y, moe_fp64(x.astype(np.float32), ids, w, *dense)) <= (2e-5 if dtype == np.float32 else 1e-4)


class Sub(np.ndarray):
    pass


def misaligned(a):
    """A C-contiguous copy of `a` one byte off its buffer's alignment."""
    raw = np.empty(a.nbytes + 1, np.uint8)
    view = raw[1:].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert not view.flags.aligned
    return view


# arguments _plain_call leaves to the full checks, each with what the call then gives:
# None (the plain call's sums), or the error the full checks raise
REFUSED = {
    "int32 ids": (lambda x, ids, w: (x, ids.astype(np.int32), w), None),
    "x a subclass": (lambda x, ids, w: (x.view(Sub), ids, w), None),
    "ids a subclass": (lambda x, ids, w: (x, ids.view(Sub), w), None),
    "x misaligned": (lambda x, ids, w: (misaligned(x), ids, w), None),
    "weights misaligned": (lambda x, ids, w: (x, ids, misaligned(w)), None),
    "x not C-contiguous": (lambda x, ids, w: (np.asfortranarray(x), ids, w), (ValueError, "x must be C-contiguous")),
    "x float64": (lambda x, ids, w: (x.astype(np.float64), ids, w), (TypeError, "x must have dtype")),
    "weights big-endian": (lambda x, ids, w: (x, ids, w.astype(">f4")), (TypeError, "topk_weights must have dtype")),
    "ids 1-D": (lambda x, ids, w: (x, ids.ravel(), w), (ValueError, "topk_ids must be 2-D")),
    "ids one column short": (lambda x, ids, w: (x, ids[:, 1:].copy(), w), (ValueError, "topk_ids must have shape")),
    "weights a row short": (lambda x, ids, w: (x, ids, w[1:].copy()), (ValueError, "topk_weights must have shape")),
    "x a list": (lambda x, ids, w: (x.tolist(), ids, w), (TypeError, "x must be a numpy array")),
    "weights bfloat16": (lambda x, ids, w: (x, ids, w.astype(ml_dtypes.bfloat16)),
                         (TypeError, "topk_weights must have dtype")),
}


@pytest.mark.parametrize("case", REFUSED)
def test_other_arguments_reach_the_full_checks(layer, case):
    moe, _ = layer
    change, outcome = REFUSED[case]
    x, ids, w = plain_arguments()
    want = moe(x, ids, w)
    args = change(x, ids, w)
    assert moe._plain_call(*args) is None
    if outcome is None:
        np.testing.assert_array_equal(moe(*args), want)
    else:
        with pytest.raises(outcome[0], match=outcome[1]):
            moe(*args)


def test_out_accumulate_and_shards_take_the_full_checks(layer, weights, monkeypatch):
    """out=, accumulate= and a shard's global ids are the full checks' (_plain_call never sees them)."""
    moe, _ = layer
    x, ids, w = plain_arguments()
    want = moe(x, ids, w)
    shards = [MoE(CONFIG, weights[0].shard(part), threads=2) for part in (range(0, 2), range(2, E))]
    calls = []
    original = MoE._checked_call

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(MoE, "_checked_call", counted)
    np.testing.assert_array_equal(checked(moe, x, ids, w), want)
    acc = np.zeros_like(x)
    np.testing.assert_array_equal(moe(x, ids, w, out=acc, accumulate=True), want)
    assert len(calls) == 2
    # each shard skips the ids the other holds: their outputs sum to the layer's (up to rounding)
    total = sum(shard(x, ids, w).astype(np.float64) for shard in shards)
    assert len(calls) == 4
    assert nmse(total, want) <= 1e-10


def test_an_expert_id_past_the_layer_is_named(layer):
    moe, _ = layer
    x, ids, w = plain_arguments()
    ids[2, 1] = E + 3
    with pytest.raises(ValueError, match=f"topk_ids holds expert id {E + 3} >= expert_num {E}"):
        moe(x, ids, w)


# plain CPU tensors go to the kernel by address (_torch.plain_layer_memory): MoE's call, and ktfp8.hf's
# TorchMoE, which takes the router's bfloat16 weights too

@pytest.fixture(scope="module")
def torch_layer(weights):
    torch = pytest.importorskip("torch")
    from ktfp8.hf.layer import build_layer
    return torch, build_layer(CONFIG, weights[0], threads=2)


def tensors(torch, weights_dtype):
    x, ids, w = plain_arguments()
    return (torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(ids),
            torch.from_numpy(w).to(weights_dtype))


def taken_by_address(torch, args, bf16_weights=True):
    from ktfp8._torch import plain_layer_memory
    return plain_layer_memory(*args, H, K, bf16_weights) is not None


@pytest.mark.parametrize("weights_dtype", ["float32", "bfloat16"])
def test_plain_tensors_skip_the_full_checks(torch_layer, monkeypatch, weights_dtype):
    torch, layer = torch_layer
    x, ids, w = tensors(torch, getattr(torch, weights_dtype))
    assert taken_by_address(torch, (x, ids, w))

    def full_checks(*args, **kwargs):
        raise AssertionError("plain tensors went through the full checks")
    with monkeypatch.context() as m:
        m.setattr(MoE, "_checked_call", full_checks)
        y = layer(x, ids, w)
    assert type(y) is torch.Tensor and y.dtype == torch.bfloat16 and y.shape == x.shape and y.is_contiguous()
    # the weights widened exactly: the same bits as float32 weights holding the same values, and as
    # the full checks' path
    want = layer.moe(x, ids, w.float(), out=torch.empty_like(x))
    assert torch.equal(y, want)


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_moe_takes_plain_tensors_by_address(layer, monkeypatch, x_dtype):
    """MoE's own call on plain CPU tensors (a user's torch model): the same bits as on NumPy arrays,
    without the full checks; bfloat16 weights are not the core's contract and still meet them."""
    torch = pytest.importorskip("torch")
    moe, _ = layer
    x, ids, w = plain_arguments()
    xt = torch.from_numpy(x).to(getattr(torch, x_dtype))
    args = (xt, torch.from_numpy(ids), torch.from_numpy(w))
    assert taken_by_address(torch, args, bf16_weights=False)

    def full_checks(*a, **kwargs):
        raise AssertionError("plain tensors went through the full checks")
    with monkeypatch.context() as m:
        m.setattr(MoE, "_checked_call", full_checks)
        y = moe(*args)
    assert type(y) is torch.Tensor and y.dtype == xt.dtype and y.shape == xt.shape
    want = moe(xt.float().numpy() if x_dtype == "float32" else xt.view(torch.int16).numpy().view(ml_dtypes.bfloat16),
               ids, w)
    np.testing.assert_array_equal(y.float().numpy(), want.astype(np.float32))
    assert not taken_by_address(torch, (xt, args[1], args[2].to(torch.bfloat16)), bf16_weights=False)
    with pytest.raises(TypeError, match="topk_weights must have dtype"):
        moe(xt, args[1], args[2].to(torch.bfloat16))


def test_bfloat16_weights_are_widened_exactly(torch_layer):
    """The router's bfloat16 weights go to the driver as they are, which widens each to the float32 of
    the same value: the sums are those of the float32 weights, whatever their signs and sizes."""
    torch, layer = torch_layer
    x, ids, w = tensors(torch, torch.float32)
    w = (w * torch.tensor([1, -3e-3, 2.5e4])).to(torch.bfloat16)
    x32 = x.float()
    assert taken_by_address(torch, (x32, ids, w))
    np.testing.assert_array_equal(layer(x32, ids, w).numpy(), layer.moe(x32.numpy(), ids.numpy(), w.float().numpy()))


def test_an_expert_id_past_the_layer_is_named_by_address(torch_layer):
    torch, layer = torch_layer
    x, ids, w = tensors(torch, torch.float32)
    ids[2, 1] = E + 3
    assert taken_by_address(torch, (x, ids, w))
    with pytest.raises(ValueError, match=f"topk_ids holds expert id {E + 3} >= expert_num {E}"):
        layer(x, ids, w)


def test_other_tensors_reach_the_full_checks(torch_layer):
    torch, layer = torch_layer
    x, ids, w = tensors(torch, torch.float32)
    want = layer(x, ids, w)
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
    wide[:, ::2] = x
    others = {
        "x not contiguous": (wide[:, ::2], ids, w),
        "int32 ids": (x, ids.int(), w),
        "float16 weights exactly float32's": (x, ids, w.half().float().half()),
        "x requiring a gradient": (x.clone().requires_grad_(True), ids, w),
    }
    for name, args in others.items():
        assert not taken_by_address(torch, args), name
        got = layer(*args)
        if name.startswith("float16"):
            want16 = layer(x, ids, w.half().float())
            assert torch.equal(got, want16), name
        else:
            assert torch.equal(got.detach(), want), name


def test_a_tensor_with_its_negative_bit_set_is_named(torch_layer):
    """Its memory holds the negatives of its values: refused by name on both paths, never read as is."""
    torch, layer = torch_layer
    x, ids, w = tensors(torch, torch.float32)
    negated = torch._neg_view(-w)
    assert negated.is_neg() and torch.equal(negated, w)
    assert not taken_by_address(torch, (x, ids, negated))
    with pytest.raises(TypeError, match=r"topk_weights is a tensor with its negative bit set.*resolve_neg"):
        layer(x, ids, negated)


def test_plain_layer_memory_refuses_all_but_plain_tensors_of_the_layer():
    torch = pytest.importorskip("torch")
    x, ids, w = torch.ones(3, H), torch.zeros(3, K, dtype=torch.int64), torch.ones(3, K)
    assert taken_by_address(torch, (x, ids, w))
    from ktfp8._torch import plain_layer_memory
    T, x_address, x_bf16, ids_address, w_address, w_bf16 = plain_layer_memory(x, ids, w, H, K, False)
    assert (T, x_address, ids_address, w_address, x_bf16, w_bf16) == (3, x.data_ptr(), ids.data_ptr(),
                                                                       w.data_ptr(), False, False)
    misaligned = torch.frombuffer(bytearray(4 * 3 * K + 1), dtype=torch.float32, offset=1, count=3 * K)
    refused = {
        "x a NumPy array": (x.numpy(), ids, w),
        "x needs autograd": (x.clone().requires_grad_(True), ids, w),
        "x on the meta device": (x.to("meta"), ids, w),
        "x sparse": (x.to_sparse(), ids, w),
        "x float16": (x.half(), ids, w),
        "x float64": (x.double(), ids, w),
        "x 1-D": (x.ravel(), ids, w),
        "x of another width": (torch.ones(3, H + 1), ids, w),
        "ids int32": (x, ids.int(), w),
        "ids a row short": (x, ids[1:], w),
        "ids not contiguous": (x, ids.t().contiguous().t(), w),
        "weights a column short": (x, ids, w[:, 1:]),
        "weights float8": (x, ids, w.to(torch.float8_e4m3fn)),
        "weights misaligned": (x, ids, misaligned.reshape(3, K)),
    }
    for name, args in refused.items():
        assert not taken_by_address(torch, args), name
