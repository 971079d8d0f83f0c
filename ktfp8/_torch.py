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
    if obj.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {obj.layout}")
    if _is_wrapper(obj, torch):
        raise TypeError(f"{name} is a tensor wrapped by a torch.func transform (vmap, grad, jvp, functionalize), "
                        f"whose memory does not hold its values; ktfp8 reads a tensor's memory: call it outside "
                        f"the transform")
    if obj.is_neg():            # torch._neg_view and the like: the memory holds the values' negatives
        raise TypeError(f"{name} is a tensor with its negative bit set, whose memory holds the negatives of its "
                        f"values; pass {name}.resolve_neg()")
    t = obj.detach() if obj.requires_grad else obj
    view = _bit_view(t.dtype, torch)
    if view is None:
        try:
            return t.numpy()
        except TypeError:       # a dtype NumPy has no equivalent for (float8_e4m3fnuz, qint8, ...)
            raise TypeError(f"{name} has dtype {t.dtype}, which NumPy cannot hold") from None
    bits, ml_dtype = view
    return t.view(bits).numpy().view(ml_dtype)


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


def plain_view(t, torch):
    """The NumPy array over the memory of `t` where it is a plain CPU tensor (type torch.Tensor, dense,
    needing no autograd, not a torch.func wrapper) of a dtype NumPy or ml_dtypes holds; None for any
    other tensor or object, whose to_numpy then says what is wrong.  What a model's layers call per
    token use (ktfp8.hf, TorchMoE): an experts call whose caches the previous layer's weights have
    flushed runs its Python from DRAM, and through accepts_tensors (and a torch op widening bfloat16
    router weights) bench_call_overhead.py's tiny experts call after a flush took 341-367 us against
    230-276 this way, 29.0-29.4 against 20.0-20.6 back to back (Zen 4 VM, four runs of each)."""
    if type(t) is not torch.Tensor or not t.is_cpu or t.requires_grad or t.layout is not torch.strided \
            or _is_wrapper(t, torch):
        return None
    view = _bit_view(t.dtype, torch)
    try:
        return t.numpy() if view is None else t.view(view[0]).numpy().view(view[1])
    except (TypeError, RuntimeError):   # a dtype NumPy lacks, a tensor with its negative bit set, ...
        return None


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
            allow_copy = None if copy_to_cpu is None else bool(copy_to_cpu(given))
            arrays = {name: to_numpy(value, name, allow_copy) for name, value in given.items()}
            result = fn(*[arrays[name] for name in names[:len(args)]], *args[len(names):],
                        **{name: arrays[name] for name in kwargs})
            out = given.get("out")
            if out is not None and isinstance(out, torch.Tensor) and result is arrays["out"]:
                if not out.is_cpu:                          # written into a CPU copy: copy it back
                    out.copy_(to_tensor(result))
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
