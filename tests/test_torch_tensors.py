"""PyTorch tensors at every entry point: the same bytes as the NumPy inputs they hold, tensors of the
right dtype back, and no copy of the input (every view ktfp8 takes is checked against data_ptr)."""
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ktfp8
from ktfp8 import _torch, fp8
from ktfp8.experts import ExpertWeights

torch = pytest.importorskip("torch")
from torch_fakes import cuda_tensor  # noqa: E402

E, H, I, K, T = 4, 64, 32, 2, 5
REPO = Path(__file__).resolve().parents[1]


def as_numpy(t):
    """The NumPy array with the values of tensor `t`, made without ktfp8 (bfloat16 exactly via float32)."""
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def raw(r):
    """The bytes of an array or a (contiguous) tensor."""
    if isinstance(r, np.ndarray):
        return r.tobytes()
    return r.contiguous().view(torch.uint8).numpy().tobytes() if r.numel() else b""


def assert_same(from_tensors, from_arrays, dtype):
    assert isinstance(from_tensors, torch.Tensor) and from_tensors.dtype == dtype
    assert tuple(from_tensors.shape) == from_arrays.shape
    assert raw(from_tensors) == raw(from_arrays)


@pytest.fixture
def views(monkeypatch):
    """Records every (argument name, tensor, array) conversion; asserts at the end that each array is
    the tensor's own memory."""
    seen = []
    real = _torch.to_numpy

    def spy(obj, name, copy_to_cpu=None):
        a = real(obj, name, copy_to_cpu)
        if isinstance(obj, torch.Tensor):
            seen.append((name, obj, a))
        return a
    monkeypatch.setattr(_torch, "to_numpy", spy)
    yield seen
    assert seen, "no tensor reached the conversion"
    for name, t, a in seen:
        assert a.ctypes.data == t.data_ptr() and a.shape == tuple(t.shape), f"{name} was copied"
        assert a.strides == tuple(s * t.element_size() for s in t.stride()), name


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    w = {"gate": torch.randn(E, I, H) / 8, "up": torch.randn(E, I, H) / 8, "down": torch.randn(E, H, I) / 8}
    experts = ktfp8.quantize_experts(*(w[n].numpy() for n in ("gate", "up", "down")), cfg.quant_config)
    return cfg, w, experts, ktfp8.MoE(cfg, experts)


def routing():
    ids = torch.tensor([[0, 1], [2, -1], [3, 3], [1, 0], [2, 3]], dtype=torch.int32)
    return ids, torch.rand(T, K)


def test_import_ktfp8_does_not_import_torch():
    code = ("import sys, ktfp8, ktfp8.fp8, ktfp8.moe, ktfp8.loader, ktfp8.convert\n"
            "assert 'torch' not in sys.modules, 'import ktfp8 imported torch'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ------------------------------------------------------------------------------------ ktfp8.fp8

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encode(views, dtype):
    x = (torch.randn(7, 9) * 300).to(dtype)
    assert_same(fp8.encode(x), fp8.encode(as_numpy(x)), torch.uint8)


@pytest.mark.parametrize("codes_dtype", [torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("out", [(torch.float32, np.float32), (torch.bfloat16, ml_dtypes.bfloat16)])
def test_decode_all_codes(views, codes_dtype, out):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(codes_dtype)
    torch_dtype, numpy_dtype = out
    want = fp8.decode(as_numpy(codes), numpy_dtype)
    assert_same(fp8.decode(codes, torch_dtype), want, torch_dtype)      # a torch dtype is a dtype too
    assert_same(fp8.decode(codes, numpy_dtype), want, torch_dtype)


@pytest.mark.parametrize("per_channel", [True, False])
def test_quantize_and_dequantize(views, per_channel):
    w = (torch.randn(3, 40, 72) * 5).to(torch.bfloat16)
    codes, scale = fp8.quantize(w, per_channel, block=(32, 32))
    want_codes, want_scale = fp8.quantize(as_numpy(w), per_channel, block=(32, 32))
    assert_same(codes, want_codes, torch.uint8)
    assert_same(scale, want_scale, torch.float32)
    back = fp8.dequantize(codes, scale, torch.bfloat16, block=(32, 32))
    assert_same(back, fp8.dequantize(want_codes, want_scale, ml_dtypes.bfloat16, block=(32, 32)), torch.bfloat16)


def test_non_contiguous_tensor_is_read_like_a_non_contiguous_array(views):
    x = torch.randn(6, 10)[:, ::2]
    assert not x.is_contiguous()
    assert_same(fp8.encode(x), fp8.encode(as_numpy(x)), torch.uint8)


# ------------------------------------------------------------------------------------ route

@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route(views, scoring, dtype):
    cfg = ktfp8.MoeConfig(expert_num=8, num_experts_per_tok=3, hidden_size=H, intermediate_size=I,
                          scoring_func=scoring, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    logits, bias = torch.randn(T, 8).to(dtype), torch.randn(8) / 10
    ids, w = ktfp8.route(logits, cfg, correction_bias=bias)
    want_ids, want_w = ktfp8.route(as_numpy(logits), cfg, correction_bias=bias.numpy())
    assert_same(ids, want_ids, torch.int64)
    assert_same(w, want_w, torch.float32)


# ------------------------------------------------------------------------------------ experts

@pytest.mark.parametrize("method", ["FP8", "BF16"])
def test_quantize_experts(views, setup, method):
    cfg, w, _, _ = setup
    qc = ktfp8.QuantConfig(method)
    bf16 = [w[n].to(torch.bfloat16) for n in ("gate", "up", "down")]
    got, want = ktfp8.quantize_experts(*bf16, qc), ktfp8.quantize_experts(*(as_numpy(t) for t in bf16), qc)
    assert got.format == want.format
    for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or (isinstance(a, np.ndarray) and raw(a) == raw(b)), name


def test_expert_weights_hold_views_of_the_tensors(setup):
    _, _, experts, _ = setup
    tensors = {n: torch.from_numpy(getattr(experts, n).copy()) for n in ("gate", "up", "down", "gate_scale",
                                                                       "up_scale", "down_scale")}
    tensors.update({n: tensors[n].view(torch.float8_e4m3fn) for n in ("gate", "up", "down")})
    held = ExpertWeights("fp8_per_channel", **tensors)
    for name, t in tensors.items():
        a = getattr(held, name)
        assert isinstance(a, np.ndarray) and a.ctypes.data == t.data_ptr(), name
        assert raw(a) == raw(getattr(experts, name)), name


# ------------------------------------------------------------------------------------ MoE

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_moe_call(views, setup, dtype, ids_dtype):
    cfg, _, experts, moe = setup
    x = torch.randn(T, H).to(dtype)
    ids, tw = routing()
    ids = ids.to(ids_dtype)
    want = moe(as_numpy(x), ids.numpy(), tw.numpy())
    assert_same(moe(x, ids, tw), want, dtype)
    assert_same(ktfp8.moe_forward(x, experts, ids, tw, cfg), want, dtype)


def test_moe_forward_with_router_logits(views, setup):
    cfg, _, _, moe = setup
    x, logits = torch.randn(T, H).to(torch.bfloat16), torch.randn(T, E)
    want = moe.forward(as_numpy(x), router_logits=logits.numpy())
    assert_same(moe.forward(x, router_logits=logits), want, torch.bfloat16)


@pytest.mark.parametrize("accumulate", [False, True])
def test_out_tensor_is_written_in_place_and_returned(views, setup, accumulate):
    _, _, _, moe = setup
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, tw = routing()
    start = torch.randn(T, H).to(torch.bfloat16)
    out, want = start.clone(), as_numpy(start)
    ptr = out.data_ptr()
    got = moe(x, ids, tw, out=out, accumulate=accumulate)
    moe(as_numpy(x), ids.numpy(), tw.numpy(), out=want, accumulate=accumulate)
    assert got is out and out.data_ptr() == ptr
    assert raw(out) == raw(want)


def test_out_tensor_written_under_no_grad_is_seen_by_autograd(setup):
    """out= is written through a NumPy view; its version counter moves as after any in-place write, so
    a tensor saved for a backward pass and overwritten is refused there, not used with the new values
    (a helper's review: the gradient came out silently wrong)."""
    _, _, _, moe = setup
    ids, tw = routing()
    a = torch.randn(T, H, requires_grad=True)
    saved = a.exp()                     # exp keeps its output for the backward pass
    version = saved._version
    with torch.no_grad():
        moe(torch.randn(T, H), ids, tw, out=saved)
    assert saved._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_out_inference_tensor_is_written(setup):
    _, _, _, moe = setup
    ids, tw = routing()
    x = torch.randn(T, H)
    with torch.inference_mode():
        out = torch.empty(T, H)
    assert moe(x, ids, tw, out=out) is out
    assert raw(out) == raw(moe(x.numpy(), ids.numpy(), tw.numpy()))


def test_out_tensor_with_array_inputs_is_returned(setup):
    _, _, _, moe = setup
    ids, tw = routing()
    x, out = torch.randn(T, H), torch.empty(T, H)
    assert moe(x.numpy(), ids.numpy(), tw.numpy(), out=out) is out
    assert raw(out) == raw(moe(x.numpy(), ids.numpy(), tw.numpy()))


def test_tensors_that_require_grad_are_read_detached(setup):
    _, _, _, moe = setup
    x = torch.randn(T, H, requires_grad=True)
    ids, tw = routing()
    y = moe(x, ids, tw)
    assert not y.requires_grad
    assert raw(y) == raw(moe(x.detach().numpy(), ids.numpy(), tw.numpy()))


def test_inference_mode_tensors(setup):
    _, _, _, moe = setup
    ids, tw = routing()
    with torch.inference_mode():
        x = torch.randn(T, H).to(torch.bfloat16)
        y = moe(x, ids, tw)
    assert raw(y) == raw(moe(as_numpy(x), ids.numpy(), tw.numpy()))


def test_zero_tokens(setup):
    _, _, _, moe = setup
    y = moe(torch.empty(0, H, dtype=torch.bfloat16), torch.empty(0, K, dtype=torch.int64), torch.empty(0, K))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and tuple(y.shape) == (0, H)


@pytest.mark.parametrize("transform", ["functionalize", "vmap", "grad"])
def test_tensors_inside_torch_func_transforms_are_refused(setup, transform):
    """A torch.func transform hands its function wrappers that look like plain CPU tensors but whose
    memory is not their values (under functionalize the result came out of other numbers, silently):
    each is refused, naming the argument."""
    _, _, _, moe = setup
    ids, tw = routing()
    x = torch.randn(T, H)
    call = {"functionalize": lambda: torch.func.functionalize(lambda a: moe(a, ids, tw))(x),
            "vmap": lambda: torch.func.vmap(lambda a: moe(a, ids, tw))(x.unsqueeze(0)),
            "grad": lambda: torch.func.grad(lambda a: moe(a, ids, tw).sum())(x)}[transform]
    with pytest.raises(TypeError, match="x is a tensor wrapped by a torch.func transform"):
        call()


def test_tensor_with_its_negative_bit_set_is_refused(setup):
    """torch._neg_view's tensors (and conj's parts) hold the negatives of their values in memory, which
    NumPy cannot view (torch's own RuntimeError before): refused by name, input or out=."""
    _, _, _, moe = setup
    ids, tw = routing()
    x = torch.randn(T, H)
    with pytest.raises(TypeError, match=r"x is a tensor with its negative bit set.*pass x.resolve_neg\(\)"):
        moe(torch._neg_view(-x), ids, tw)
    with pytest.raises(TypeError, match="out is a tensor with its negative bit set"):
        moe(x, ids, tw, out=torch._neg_view(torch.zeros(T, H)))
    with pytest.raises(TypeError, match="x is a tensor with its negative bit set"):
        fp8.encode(torch._neg_view(x))


@pytest.mark.parametrize("which", ["x", "topk_ids", "topk_weights", "out"])
def test_zero_tensor_is_refused(setup, which):
    """A ZeroTensor (forward-mode AD's zero tangent) has no memory: its address is 0.  The call on plain
    tensors read it by address and crashed the process (a helper's hunt); now the checked path names it."""
    _, _, _, moe = setup
    ids, tw = routing()
    args = {"x": torch.randn(T, H), "topk_ids": ids.long(), "topk_weights": tw, "out": torch.zeros(T, H)}
    zero = args[which]
    args[which] = torch._efficientzerotensor(zero.shape, dtype=zero.dtype)
    with pytest.raises(TypeError, match=f"{which} is a ZeroTensor, which has no memory; pass torch.zeros_like"):
        moe(args["x"], args["topk_ids"], args["topk_weights"], out=args["out"])


@pytest.mark.parametrize("which", ["x", "topk_ids", "topk_weights"])
@pytest.mark.parametrize("nbytes, ids_dtype", [(0, torch.int64), (16, torch.int32)])
def test_storage_resized_below_the_tensor_is_refused(setup, which, nbytes, ids_dtype):
    """A tensor whose storage was resized below it (FSDP and offloading free parameters so: to nothing)
    crashed the process when the call on plain tensors (int64 ids) read it by address.  The checked path
    (int32 ids here) also names one resized part way, which it read past its end; the plain path does not
    look for that (its checks are per layer and token, and torch's own ops read such a tensor so too)."""
    _, _, _, moe = setup
    ids, tw = routing()
    args = {"x": torch.randn(T, H), "topk_ids": ids.to(ids_dtype), "topk_weights": tw}
    args[which].untyped_storage().resize_(nbytes)
    with pytest.raises(TypeError, match=f"{which}'s storage holds {nbytes} bytes, less than the tensor spans"):
        moe(args["x"], args["topk_ids"], args["topk_weights"])


def test_tensor_subclass_numpy_cannot_view_is_named(setup):
    """torch refuses .numpy() of wrapper subclasses with a RuntimeError naming no argument."""
    from torch.testing._internal.two_tensor import TwoTensor
    _, _, _, moe = setup
    ids, tw = routing()
    with pytest.raises(TypeError, match="topk_weights is a TwoTensor whose memory NumPy cannot view"):
        moe(torch.randn(T, H), ids, TwoTensor(tw, tw.clone()))


# ------------------------------------------------------------------------------------ other devices

def test_off_cpu_tensor_is_refused_by_default(setup):
    _, _, _, moe = setup
    ids, tw = routing()
    with pytest.raises(ValueError, match=r"x is a tensor on device 'cuda:0'; .* pass x.cpu\(\) or copy_to_cpu=True"):
        moe(cuda_tensor(torch.randn(T, H)), ids, tw)
    with pytest.raises(ValueError, match=r"router_logits is a tensor on device 'cuda:0'"):
        ktfp8.route(cuda_tensor(torch.randn(T, E)), setup[0])
    with pytest.raises(ValueError, match="topk_ids is a meta tensor"):
        moe(torch.randn(T, H), ids.to("meta"), tw)


def test_copy_to_cpu_copies_in_and_results_back(setup, monkeypatch):
    cfg, _, experts, moe = setup
    moved = []
    monkeypatch.setattr(_torch, "to_device", lambda t, device: moved.append(device) or t)
    ids, tw = routing()
    x = torch.randn(T, H).to(torch.bfloat16)
    want = moe(x, ids, tw)
    on_gpu = ktfp8.MoE(cfg, experts, copy_to_cpu=True)
    assert raw(on_gpu(cuda_tensor(x), cuda_tensor(ids), tw)) == raw(want)
    assert raw(ktfp8.moe_forward(cuda_tensor(x), experts, ids, tw, cfg, copy_to_cpu=True)) == raw(want)
    assert [d.type for d in moved] == ["cuda", "cuda"]
    out = cuda_tensor(torch.zeros(T, H, dtype=torch.bfloat16))
    assert on_gpu(cuda_tensor(x), ids, tw, out=out) is out and raw(out) == raw(want)
    with pytest.raises(ValueError, match="x is a meta tensor"):      # no data to copy
        on_gpu(x.to("meta"), ids, tw)


def test_dtype_numpy_cannot_hold_is_named():
    with pytest.raises(TypeError, match="x has dtype torch.float8_e4m3fnuz, which NumPy cannot hold"):
        fp8.encode(torch.zeros(4, dtype=torch.float8_e4m3fnuz))
    with pytest.raises(TypeError, match="w must be a dense tensor, got layout torch.sparse_coo"):
        fp8.quantize(torch.eye(4).to_sparse())
