"""PyTorch tensors at the public entry points: NumPy views of their memory in, tensors back out.

Every entry point that takes arrays is wrapped by `accepts_tensors`, so the code under it only ever
sees NumPy arrays and the validation (and its messages) is the arrays' own.  A CPU tensor becomes an
array over the same memory, strides included: no copy, and a non-contiguous tensor is treated exactly
like a non-contiguous array.  Tensors are read as `tensor.detach()` would be (no autograd graph).

`import ktfp8` must not import torch, and need not: a tensor can only exist once its caller imported
torch, so a tensor is recognised through `sys.modules`, never by importing torch here.
"""
import functools
import inspect
import sys

import ml_dtypes
import numpy as np

# Dtypes NumPy only knows through ml_dtypes: read and written through an integer view of the same
# width.  The key is the dtype's name in torch and in ml_dtypes alike.
_BIT_VIEWS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
_ML_DTYPES = {name: np.dtype(getattr(ml_dtypes, name)) for name in _BIT_VIEWS}
_ML_DTYPE_NAMES = {dt: name for name, dt in _ML_DTYPES.items()}     # np.dtype.name is slow to compute


def to_numpy(obj, name, copy_to_cpu=None):
    """`obj` unchanged unless it is a torch tensor or dtype; a tensor -> a NumPy array over its memory,
    a torch dtype -> the NumPy dtype of the same name.  An off-CPU tensor is copied to the CPU when
    `copy_to_cpu` is True; otherwise it is a ValueError naming `name` and the device (False: the caller
    has a copy_to_cpu option, and the message says so)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return _numpy_dtype(obj) if torch is not None and isinstance(obj, torch.dtype) else obj
    if not obj.is_cpu:          # (.is_cpu is a fraction of the cost of .device)
        device = obj.device
        if device.type == "meta":
            raise ValueError(f"{name} is a meta tensor (a shape without data); ktfp8 needs a CPU tensor")
        if not copy_to_cpu:     # False: the entry point has the option, None: it has not
            raise ValueError(f"{name} is a tensor on device {str(device)!r}; ktfp8 computes on the CPU: "
                             f"pass {name}.cpu()" + ("" if copy_to_cpu is None else " or copy_to_cpu=True"))
        obj = obj.cpu()
    if obj.layout != torch.strided or obj.is_nested:
        raise TypeError(f"{name} must be a dense tensor, got " +
                        ("a nested tensor" if obj.is_nested else f"layout {obj.layout}"))
    if _is_wrapper(obj, torch):
        raise TypeError(f"{name} is a tensor wrapped by a torch.func transform (vmap, grad, jvp, functionalize), "
                        f"whose memory does not hold its values; ktfp8 reads a tensor's memory: call it outside "
                        f"the transform")
    if obj.is_neg():            # torch._neg_view and the like: the memory holds the values' negatives
        raise TypeError(f"{name} is a tensor with its negative bit set, whose memory holds the negatives of its "
                        f"values; pass {name}.resolve_neg()")
    t = obj.detach() if obj.requires_grad else obj
    _check_memory(t, name, torch)
    view = _bit_view(t.dtype, torch)
    try:
        if view is None:
            return t.numpy()
        bits, ml_dtype = view
        return t.view(bits).numpy().view(ml_dtype)
    except TypeError:           # a dtype NumPy has no equivalent for (float8_e4m3fnuz, qint8, ...)
        raise TypeError(f"{name} has dtype {t.dtype}, which NumPy cannot hold") from None
    except RuntimeError as err:     # tensor subclasses torch keeps from NumPy (TwoTensor, MaskedTensor, ...)
        raise TypeError(f"{name} is a {type(obj).__name__} whose memory NumPy cannot view ({err}); ktfp8 reads "
                        f"a tensor's memory: pass a plain torch.Tensor") from None


def _check_memory(t, name, torch):
    """Raises TypeError unless the memory of tensor `t` holds its values: a ZeroTensor (what forward-mode
    AD hands out for a zero tangent) has none (address 0), and a storage resized below the tensor (what
    FSDP and offloading do to freed parameters) has less than the tensor spans; reading either crashed
    the process or read past the allocation."""
    if t._is_zerotensor():
        raise TypeError(f"{name} is a ZeroTensor, which has no memory; pass torch.zeros_like({name})")
    if t.numel() == 0:
        return
    span = 1 + sum((n - 1) * abs(stride) for n, stride in zip(t.shape, t.stride()))
    held, needed = t.untyped_storage().nbytes(), (t.storage_offset() + span) * t.element_size()
    if held < needed:
        raise TypeError(f"{name}'s storage holds {held} bytes, less than the tensor spans ({needed}): it was "
                        f"resized or freed (as FSDP or offloading do to parameters)")


_bit_views = {}     # torch dtype -> (torch integer dtype, ml_dtypes dtype) or None: str(dtype) costs ~0.5 us


def _bit_view(torch_dtype, torch):
    """(the torch integer dtype to view a tensor of `torch_dtype` as, the ml_dtypes dtype of its NumPy
    view) for the dtypes in _BIT_VIEWS; None for the others (tensor.numpy() holds them)."""
    try:
        return _bit_views[torch_dtype]
    except KeyError:
        name = _name(torch_dtype)
        bits = _BIT_VIEWS.get(name)
        view = None if bits is None else (getattr(torch, bits), _ML_DTYPES[name])
        _bit_views[torch_dtype] = view
        return view


_wrapper_checks = None   # torch's (private) tests for the wrappers, looked up at the first tensor


def _is_wrapper(t, torch):
    """Whether t is a functorch or functionalization wrapper: type torch.Tensor and on the CPU like a
    plain tensor, but its storage (if any) is not its values, so its NumPy view would read garbage."""
    global _wrapper_checks
    if _wrapper_checks is None:
        _wrapper_checks = tuple(f for f in (getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                                                    None), getattr(torch, "_is_functional_tensor", None)) if f)
    for check in _wrapper_checks:
        if check(t):
            return True
    return False


_plain_dtypes = None    # torch dtype -> is bfloat16, of x and the weights: float32 and bfloat16


def plain_layer_memory(x, topk_ids, topk_weights, hidden, top_k, bf16_weights):
    """(T, x's address, x is bfloat16, the ids' address, the weights' address, the weights are
    bfloat16) where x [T, hidden] float32 or bfloat16, topk_ids int64 and topk_weights float32 (or
    bfloat16 with bf16_weights) [T, top_k] are plain CPU tensors (type torch.Tensor, dense, needing no
    autograd, not a torch.func wrapper, no negative bit), each C-contiguous and aligned; None for
    anything else (torch not even imported: no tensors).
    What a MoE call on tensors takes per layer and token (MoE._plain_tensor_call, ktfp8.hf's TorchMoE),
    so that the kernel reads the tensors by address and writes into torch.empty_like(x): NumPy views of
    the three tensors and a tensor over the NumPy result cost more, most of all when the previous
    layer's weights have flushed the caches and torch's NumPy interop runs from DRAM.  Zen 3 VM, a tiny
    layer (E = 8, H = 64, top-2, one thread), the two paths alternated in one process, time against the
    views: TorchMoE 0.74x-0.75x after a flush (221-236 us against 294-318), 0.76x-0.77x back to back
    (27-33 us against 34-44); MoE's call on tensors against its full checks 0.54x-0.55x after a flush
    (134-165 us against 253-296), 0.45x-0.46x back to back (20-21 us against 37-40)."""
    global _plain_dtypes
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if _plain_dtypes is None:
        _plain_dtypes = {torch.float32: False, torch.bfloat16: True}
    for t in (x, topk_ids, topk_weights):
        if type(t) is not torch.Tensor or not t.is_cpu or t.requires_grad or t.layout is not torch.strided \
                or t.is_nested or not t.is_contiguous() or t.is_neg() or _is_wrapper(t, torch):
            return None
    x_bf16, w_bf16 = _plain_dtypes.get(x.dtype), _plain_dtypes.get(topk_weights.dtype)
    if x_bf16 is None or w_bf16 is None or (w_bf16 and not bf16_weights) or topk_ids.dtype is not torch.int64:
        return None
    shape = x.shape
    if len(shape) != 2 or shape[1] != hidden or topk_ids.shape != (shape[0], top_k) \
            or topk_weights.shape != topk_ids.shape:
        return None
    addresses = x.data_ptr(), topk_ids.data_ptr(), topk_weights.data_ptr()
    # address 0: a ZeroTensor or a storage resized to nothing, which the checked path names
    if any(a % size or not a for a, size in zip(addresses, (2 if x_bf16 else 4, 8, 2 if w_bf16 else 4))):
        return None
    return shape[0], addresses[0], x_bf16, addresses[1], addresses[2], w_bf16


def to_tensor(a):
    """A CPU tensor over the memory of NumPy array `a` (bfloat16 / float8 through an integer view)."""
    torch = sys.modules.get("torch")
    dtype_name = _ML_DTYPE_NAMES.get(a.dtype)
    if dtype_name is None:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(_BIT_VIEWS[dtype_name])).view(getattr(torch, dtype_name))


def to_device(t, device):
    """`t` moved to `device` (a separate function so that tests without a GPU can stand in for it)."""
    return t.to(device)


def _name(torch_dtype):
    return str(torch_dtype).replace("torch.", "")


def _numpy_dtype(torch_dtype):
    name = _name(torch_dtype)
    if name in _ML_DTYPES:
        return _ML_DTYPES[name]
    try:
        return np.dtype(name)
    except TypeError:
        return torch_dtype          # let the entry point's own dtype check name it


def _check_out_outside_autograd(out, torch):
    """ktfp8 writes out= in place with no autograd node (no gradient flows through its kernels): a
    tensor that requires grad, written while grad mode is on, would hold values its graph does not
    account for.  torch refuses such writes into leaves; ktfp8 refuses them into any such tensor."""
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError("out requires grad: ktfp8 writes it in place outside autograd (no gradient flows "
                         "through ktfp8); pass a tensor that does not require grad, or call under torch.no_grad()")


def accepts_tensors(main, copy_to_cpu=None):
    """Decorator: every torch tensor argument reaches the function as a NumPy view (`to_numpy`, the
    argument's parameter name in messages); when the `main` argument was a tensor, the arrays returned
    (alone or in a tuple) come back as tensors on its device.  An `out=` tensor is returned as itself.

    copy_to_cpu: None when off-CPU tensors are always refused; else a function of the arguments (a dict
    by parameter name) saying whether they are copied to the CPU for the call (and the results back to
    main's device)."""
    def wrap(fn):
        names = tuple(inspect.signature(fn).parameters)

        # A model calls these once per layer and token, so the torch side builds each dict once (a
        # transformers experts call on a tiny layer: 29.0-29.5 us against 30.2-30.3; Zen 4 VM)
        @functools.wraps(fn)
        def entry(*args, **kwargs):
            torch = sys.modules.get("torch")
            if torch is None:
                return fn(*args, **kwargs)
            kinds = (torch.Tensor, torch.dtype)
            if not (any(isinstance(a, kinds) for a in args) or any(isinstance(v, kinds) for v in kwargs.values())):
                return fn(*args, **kwargs)                  # NumPy callers pay nothing more
            given = dict(zip(names, args))
            given.update(kwargs)
            out = given.get("out")
            if isinstance(out, torch.Tensor):
                _check_out_outside_autograd(out, torch)
            allow_copy = None if copy_to_cpu is None else bool(copy_to_cpu(given))
            arrays = {name: to_numpy(value, name, allow_copy) for name, value in given.items()}
            result = fn(*[arrays[name] for name in names[:len(args)]], *args[len(names):],
                        **{name: arrays[name] for name in kwargs})
            if isinstance(out, torch.Tensor) and result is arrays["out"]:
                if not out.is_cpu:                          # written into a CPU copy: copy it back
                    out.copy_(to_tensor(result))
                elif not out.is_inference():                # (an inference tensor keeps no version)
                    # written through a NumPy view, which autograd does not see: a tensor saved for a
                    # backward pass is then refused there, as after any in-place write
                    torch.autograd.graph.increment_version(out)
                return out
            tensor = given.get(main)
            if not isinstance(tensor, torch.Tensor):
                return result
            device = None if tensor.is_cpu else tensor.device

            def back(r):
                if not isinstance(r, np.ndarray):
                    return r
                t = to_tensor(r)
                return t if device is None else to_device(t, device)
            return tuple(back(r) for r in result) if isinstance(result, tuple) else back(result)
        return entry
    return wrap
