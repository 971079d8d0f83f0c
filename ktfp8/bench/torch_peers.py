"""PyTorch CPU peers: the MoE loop a PyTorch user writes (HF Mixtral/Qwen3-MoE style, per expert
F.linear + SiLU) on BF16 weights, and the same loop on FP8 weights through torch._scaled_mm with
per-channel weight scales and dynamic per-token FP8 activations.  Both share ktfp8's arrays
(torch.from_numpy views, no copies)."""
import numpy as np

from .sides import PeerUnavailable


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise PeerUnavailable(f"PyTorch is not installed ({exc}); `pip install torch==2.13.0`") from None
    return torch


def _view(torch, a, dtype):
    """A zero-copy torch view of a numpy array of bf16 or fp8 bit patterns."""
    bits = np.uint16 if dtype == torch.bfloat16 else np.uint8
    return torch.from_numpy(np.ascontiguousarray(a).view(bits)).view(dtype)


class _TorchMoE:
    kind = "peer"

    def __init__(self, threads):
        self.torch = _torch()
        self.version = self.torch.__version__
        self.threads = threads

    def __call__(self, x, topk_ids, topk_weights):
        torch = self.torch
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # the process's setting, restored after the call
        try:
            return self._forward(x, topk_ids, topk_weights)
        finally:
            torch.set_num_threads(threads)

    def _forward(self, x, topk_ids, topk_weights):
        torch = self.torch
        with torch.inference_mode():
            xt = _view(torch, x, torch.bfloat16)
            ids = torch.from_numpy(topk_ids)
            w = torch.from_numpy(topk_weights)
            out = torch.zeros(xt.shape, dtype=torch.float32)
            for e in torch.unique(ids).tolist():
                tok, slot = (ids == e).nonzero(as_tuple=True)
                y = self.expert(e, xt[tok])
                out.index_add_(0, tok, y.float() * w[tok, slot, None])
        return out.numpy()

    def close(self):
        self.gate = self.up = self.down = None


class TorchBF16MoE(_TorchMoE):
    def __init__(self, layer, experts, threads):
        super().__init__(threads)
        if experts.format != "bf16":
            raise PeerUnavailable(f"the PyTorch BF16 loop runs bf16 weights, not {experts.format}")
        self.name, self.format = "torch bf16 F.linear", "bf16"
        torch = self.torch
        projections = (experts.gate, experts.up, experts.down)
        self.gate, self.up, self.down = (_view(torch, p, torch.bfloat16) for p in projections)

    def expert(self, e, xe):
        F = self.torch.nn.functional
        return F.linear(F.silu(F.linear(xe, self.gate[e])) * F.linear(xe, self.up[e]), self.down[e])


class TorchScaledMMMoE(_TorchMoE):
    def __init__(self, layer, experts, threads):
        super().__init__(threads)
        torch = self.torch
        if experts.format != "fp8_per_channel":
            raise PeerUnavailable(f"torch._scaled_mm on CPU scales per row/column only, not {experts.format}")
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            raise PeerUnavailable(f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn")
        self.name, self.format = "torch._scaled_mm fp8", "fp8_per_channel"
        projections = (experts.gate, experts.up, experts.down)
        self.gate, self.up, self.down = (_view(torch, p, torch.float8_e4m3fn) for p in projections)
        self.scales = [torch.from_numpy(np.ascontiguousarray(s, np.float32).reshape(s.shape[0], 1, -1))
                       for s in (experts.gate_scale, experts.up_scale, experts.down_scale)]
        try:  # a CPU build may lack the FP8 GEMM: find out now, not in the timed loop
            self._mm(torch.zeros(1, layer.hidden, dtype=torch.bfloat16), self.gate, self.scales[0], 0)
        except RuntimeError as exc:
            raise PeerUnavailable(f"torch._scaled_mm does not run on this CPU build: {exc}") from None

    def _mm(self, a, weights, scales, e):
        """a @ W[e].T with a quantized per token to FP8 (scale = row amax / 448), as FP8 serving does."""
        torch = self.torch
        a_scale = (a.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1e-12)
        aq = (a.float() / a_scale).to(torch.float8_e4m3fn)
        # W[e] is [out, in] row-major, so W[e].t() is the column-major operand _scaled_mm wants
        return torch._scaled_mm(aq, weights[e].t(), scale_a=a_scale, scale_b=scales[e],
                                out_dtype=torch.bfloat16)

    def expert(self, e, xe):
        F = self.torch.nn.functional
        g, u, d = self.scales
        h = F.silu(self._mm(xe, self.gate, g, e)) * self._mm(xe, self.up, u, e)
        return self._mm(h, self.down, d, e)
