"""The torch custom op `ktfp8::moe` and the table of the layers it runs.

transformers calls an experts module as experts(hidden_states, top_k_index, top_k_weights).  Going
through a registered custom op (with a fake implementation giving the output's shape) lets
torch.compile trace a model around our kernels, which it cannot look into.  An op's arguments are
tensors and plain values, so each layer is registered here once and named by an int handle.  Eager
inference calls the registered layer itself (experts._needs_the_op says when).

A module holds its layer through a Claim; the layer stays in the table while any claim on its handle
lives.  copy.deepcopy of a module (or of a whole model) copies the int handle as it is, so the copy's
Claim is another claim on the same handle: the copy runs the same packed layer (never written after
packing) and keeps it registered after the original is freed."""
import itertools
import threading
import weakref

import torch

_layers = {}                    # handle -> callable(x, topk_ids, topk_weights) -> y (torch tensors)
_claims = {}                    # handle -> number of live Claims on it
_lock = threading.RLock()         # reentrant: a Claim's finalizer may run at a collection inside it
_handles = itertools.count(1)


class Claim:
    """A hold on the layer registered under `handle`: unregistered once the last claim on it is freed."""

    def __init__(self, handle):
        with _lock:
            if handle not in _layers:
                raise RuntimeError(f"ktfp8::moe: no layer registered under handle {handle}")
            _claims[handle] += 1
        self.handle = handle
        weakref.finalize(self, _release, handle)

    def __copy__(self):
        return Claim(self.handle)

    def __deepcopy__(self, memo):
        return Claim(self.handle)

    def __reduce_ex__(self, protocol):
        # another process has no such layer, and this one could lose it: what deepcopy gets right, pickle cannot
        raise TypeError("a module whose experts ktfp8 holds cannot be pickled (torch.save(model), "
                        "multiprocessing): its packed layer lives in this process only; load the model in the "
                        "other process (ktfp8.hf.from_pretrained of an FP8 folder written by python -m ktfp8.convert)")

    def __repr__(self):
        return f"Claim(handle={self.handle})"


def register(layer):
    """The first Claim on a new handle for `layer` (a callable taking and returning CPU tensors)."""
    with _lock:
        handle = next(_handles)
        _layers[handle] = layer
        _claims[handle] = 0
    return Claim(handle)


def _release(handle):
    with _lock:
        _claims[handle] -= 1
        if _claims[handle] == 0:
            del _claims[handle]
            del _layers[handle]


def layer_of(handle):
    layer = _layers.get(handle)
    if layer is None:
        raise RuntimeError(f"ktfp8::moe: no layer registered under handle {handle} (its module was freed?)")
    return layer


@torch.library.custom_op("ktfp8::moe", mutates_args=())
def moe(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        handle: int) -> torch.Tensor:
    """y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t]) for one layer."""
    return layer_of(handle)(hidden_states, topk_ids, topk_weights)


@moe.register_fake
def _moe_fake(hidden_states, topk_ids, topk_weights, handle):
    return torch.empty_like(hidden_states)
