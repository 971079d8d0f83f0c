"""One MoE layer seen from torch: CPU tensors in, a tensor out, ktfp8.MoE underneath.

build_layer() is the one place where the callable run for a transformers experts module is made.
Under torch.distributed with more than one rank (e.g. torchrun), each rank holds local_experts() of
every layer, a contiguous range, and the layer is a ktfp8.distributed.ExpertParallelMoE: partial
output, one all-reduce per MoE block.  The non-expert weights stay replicated on every rank."""
import os

import torch

from ..moe import MoE


ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)      # what the kernels take as x and give back


def check_activation_dtype(dtype):
    """Raises TypeError when a model running in `dtype` hands the experts activations ktfp8 cannot take."""
    if dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"ktfp8 experts implementation: the model runs in {dtype}; ktfp8 takes float32 or "
                        f"bfloat16 activations: load it with dtype=torch.bfloat16 (or torch.float32)")


class TorchMoE:
    """y = layer(x [T, H], topk_ids [T, k], topk_weights [T, k]): CPU tensors, y a new tensor like x.
    The core validates them (device, dtype, shape) with messages naming the argument.
    `moe`: a ktfp8.MoE, or a ktfp8.distributed.ExpertParallelMoE (same call)."""

    def __init__(self, moe):
        self.moe = moe

    @property
    def threads(self):
        """The kernel threads of each call (the MoE's, or this rank's shard's)."""
        return self._kernel_moe().threads

    @threads.setter
    def threads(self, threads):
        self._kernel_moe().threads = threads

    def _kernel_moe(self):
        return self.moe if isinstance(self.moe, MoE) else self.moe.moe   # ExpertParallelMoE: its shard

    def __call__(self, hidden_states, topk_ids, topk_weights):
        if isinstance(self.moe, MoE):   # plain CPU tensors, the router's bfloat16 weights too: by address
            y = self.moe._plain_tensor_call(hidden_states, topk_ids, topk_weights, bf16_weights=True)
            if y is not None:
                return y
        if isinstance(hidden_states, torch.Tensor):    # (a model cast with .half() after its first forward)
            check_activation_dtype(hidden_states.dtype)
        # transformers routers hand back weights in the model's dtype; the kernels take float32 weights
        if isinstance(topk_weights, torch.Tensor) and topk_weights.dtype in (torch.bfloat16, torch.float16):
            topk_weights = topk_weights.float()
        return self.moe(*(_contiguous(t) for t in (hidden_states, topk_ids, topk_weights)))


def _contiguous(t):
    """A dense tensor made contiguous; anything else as it is, for the layer's checks to name (a sparse
    tensor's .contiguous() raises a message that names neither the argument nor the layout)."""
    return t.contiguous() if isinstance(t, torch.Tensor) and t.layout is torch.strided else t


def _expert_parallel():
    """Whether to split the experts over the ranks: under torch.distributed with more than one rank,
    unless $KTFP8_EXPERT_PARALLEL is 0 (data parallel: each rank runs its own tokens through every
    expert; the split needs the same tokens on every rank, and ExpertParallelMoE checks that)."""
    from ..distributed import ENV_EXPERT_PARALLEL
    setting = os.environ.get(ENV_EXPERT_PARALLEL, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{ENV_EXPERT_PARALLEL}={os.environ[ENV_EXPERT_PARALLEL]!r} must be 0 (every rank holds "
                         f"every expert) or 1 (the default: split the experts over the ranks)")
    dist = torch.distributed
    return setting != "0" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local_experts(expert_num):
    """The experts of a layer this process holds: all, or under torch.distributed this rank's range."""
    if _expert_parallel():
        from ..distributed import rank_experts
        return rank_experts(expert_num)
    return range(expert_num)


def build_layer(config, experts, *, threads=None):
    """The callable run for one experts module: `experts` (ktfp8.ExpertWeights of the layer's
    local_experts(), or of all of them) packed once by ktfp8.MoE under `config` (ktfp8.MoeConfig)."""
    if _expert_parallel():
        from ..distributed import ExpertParallelMoE
        return TorchMoE(ExpertParallelMoE(config, experts, threads=threads))
    return TorchMoE(MoE(config, experts, threads=threads))
