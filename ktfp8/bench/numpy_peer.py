"""The NumPy peer: what a user without kernels does — dequantize the FP8 experts to float32 once,
then run each routed expert as BLAS matrix products."""
import numpy as np

from .. import backends, fp8
from .layers import BYTES_PER_WEIGHT
from .sides import PeerUnavailable, check_fits


def _threadpool_limits(threads):
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        raise PeerUnavailable("threadpoolctl is not installed, so NumPy's BLAS thread count can't be set "
                              "(`pip install threadpoolctl`)") from None
    return threadpool_limits(threads)


class NumpyFP32MoE:
    kind = "peer"

    def __init__(self, layer, experts, threads):
        if experts.format != "fp8_per_channel":
            raise PeerUnavailable(f"the NumPy peer dequantizes fp8_per_channel experts, not {experts.format}")
        check_fits("NumPy FP32", layer.experts * layer.weights_per_expert * BYTES_PER_WEIGHT["fp32"])
        with _threadpool_limits(threads):  # fail now if the thread count can't be controlled; restored after
            pass
        self.name, self.format, self.version = "numpy fp32 (dequantized)", "fp32", np.__version__
        # FP32 BLAS: held to the FP32 FMA peak, not to a BF16 unit (AMX, vdpbf16ps) it cannot use
        self.compute_unit = "fma512" if backends.isa_levels()["avx512"][1] else "fma"
        self.threads = threads
        self.gate, self.up, self.down = (fp8.dequantize(c, s) for c, s in (
            (experts.gate, experts.gate_scale), (experts.up, experts.up_scale), (experts.down, experts.down_scale)))

    def __call__(self, x, topk_ids, topk_weights):
        x = x.astype(np.float32)
        out = np.zeros_like(x)
        with _threadpool_limits(self.threads):
            for e in np.unique(topk_ids):
                tok, slot = np.nonzero(topk_ids == e)
                xe = x[tok]
                g = xe @ self.gate[e].T
                h = g / (1.0 + np.exp(-g)) * (xe @ self.up[e].T)
                # a token routes to an expert at most once, so tok holds no repeats
                out[tok] += (h @ self.down[e].T) * topk_weights[tok, slot, None]
        return out

    def close(self):
        self.gate = self.up = self.down = None
