"""One MoE layer seen from torch: CPU tensors in, a tensor out, ktfp8.MoE underneath.

build_layer() is the one place where the callable run for a transformers experts module is made
(expert parallelism replaces it with a MoE over a shard of the experts plus an all-reduce)."""
import torch

from ..moe import MoE


class TorchMoE:
    """y = layer(x [T, H], topk_ids [T, k], topk_weights [T, k]): CPU tensors, y a new tensor like x.
    The core validates them (device, dtype, shape) with messages naming the argument."""

    def __init__(self, moe):
        self.moe = moe

    def __call__(self, hidden_states, topk_ids, topk_weights):
        # transformers routers hand back weights in the model's dtype; the kernels take float32 weights
        if isinstance(topk_weights, torch.Tensor) and topk_weights.dtype in (torch.bfloat16, torch.float16):
            topk_weights = topk_weights.float()
        return self.moe(hidden_states.contiguous(), topk_ids.contiguous(), topk_weights.contiguous())


def build_layer(config, experts, *, threads=None):
    """The callable run for one experts module: `experts` (ktfp8.ExpertWeights of all the layer's
    experts) packed once by ktfp8.MoE under `config` (ktfp8.MoeConfig)."""
    return TorchMoE(MoE(config, experts, threads=threads))
