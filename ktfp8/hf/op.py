"""The torch custom op `ktfp8::moe` and the table of the layers it runs.

transformers calls an experts module as experts(hidden_states, top_k_index, top_k_weights).  Going
through a registered custom op (with a fake implementation giving the output's shape) lets
torch.compile trace a model around our kernels, which it cannot look into.  An op's arguments are
tensors and plain values, so each layer is registered here once and named by an int handle."""
import itertools
import threading

import torch

_layers = {}                    # handle -> callable(x, topk_ids, topk_weights) -> y (torch tensors)
_lock = threading.Lock()
_handles = itertools.count(1)


def register(layer):
    """A new handle for `layer` (a callable taking and returning CPU tensors)."""
    with _lock:
        handle = next(_handles)
        _layers[handle] = layer
    return handle


def unregister(handle):
    with _lock:
        _layers.pop(handle, None)


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
