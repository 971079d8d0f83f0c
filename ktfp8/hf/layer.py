"""One MoE layer seen from torch: CPU tensors in, a tensor out, ktfp8.MoE underneath.

build_layer() is the one place where the callable run for a transformers experts module is made.
Under torch.distributed with more than one rank (e.g. torchrun), each rank holds local_experts() of
every layer, a contiguous range, and the layer is a ktfp8.distributed.ExpertParallelMoE: partial
output, one all-reduce per MoE block.  The non-expert weights stay replicated on every rank."""
import ml_dtypes
import torch

from ..moe import MoE

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def _as_numpy(t):
    """Zero-copy NumPy view of a contiguous CPU tensor (bfloat16 through its int16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def check_activations(hidden_states, topk_ids, topk_weights):
    """The checks whose failure would otherwise surface deep in the kernel call."""
    for name, t in (("hidden_states", hidden_states), ("top_k_index", topk_ids), ("top_k_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ktfp8 experts: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"ktfp8 experts: {name} must be on the CPU, got a tensor on {t.device} "
                             f"(ktfp8 runs the experts on the CPU: keep the model on the CPU)")
    if hidden_states.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"ktfp8 experts: hidden_states must be torch.bfloat16 or torch.float32, got "
                        f"{hidden_states.dtype} (load the model with dtype=torch.bfloat16 or torch.float32)")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ktfp8 experts: top_k_index must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"ktfp8 experts: top_k_weights must be floating point, got {topk_weights.dtype}")


class TorchMoE:
    """Calls a ktfp8.MoE with torch tensors: y = layer(x [T, H], topk_ids [T, k], topk_weights [T, k])."""

    def __init__(self, moe):
        self.moe = moe

    def __call__(self, hidden_states, topk_ids, topk_weights):
        check_activations(hidden_states, topk_ids, topk_weights)
        x = hidden_states.contiguous()
        out = torch.empty_like(x)
        self.moe(_as_numpy(x), _as_numpy(topk_ids.contiguous()),
                 _as_numpy(topk_weights.to(torch.float32).contiguous()), out=_as_numpy(out))
        return out


class TorchExpertParallelMoE:
    """Calls a ktfp8.distributed.ExpertParallelMoE (this rank's experts + the all-reduce)."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, hidden_states, topk_ids, topk_weights):
        check_activations(hidden_states, topk_ids, topk_weights)
        return self.layer(hidden_states, topk_ids, topk_weights.to(torch.float32))


def _expert_parallel():
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local_experts(expert_num):
    """The experts of a layer this process holds: all, or under torch.distributed this rank's range."""
    if _expert_parallel():
        from ..distributed import rank_experts
        return rank_experts(expert_num)
    return range(expert_num)


def build_layer(config, experts, *, threads=None, layer_index=None):
    """The callable run for one experts module: `experts` (ktfp8.ExpertWeights of the layer's
    local_experts(), or of all of them) packed once by ktfp8.MoE under `config` (ktfp8.MoeConfig)."""
    if _expert_parallel():
        from ..distributed import ExpertParallelMoE
        return TorchExpertParallelMoE(ExpertParallelMoE(config, experts, threads=threads))
    return TorchMoE(MoE(config, experts, threads=threads))
