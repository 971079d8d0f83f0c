"""A tensor on a device this machine lacks: CPU memory behind a tensor that says it lives on cuda:0.

What ktfp8 sees of it is what it would see of a real CUDA tensor (`.device`, `.is_cuda`, `.is_cpu`);
`.cpu()` and `.numpy()` still work, so a copy to the CPU can be followed through (`.cpu()` keeps the
subclass)."""
import torch


class _OnCuda(torch.Tensor):
    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False


def cuda_tensor(t):
    """A tensor with the data of CPU tensor `t` that reports device cuda:0."""
    return torch.Tensor._make_subclass(_OnCuda, t)
