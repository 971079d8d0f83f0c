"""A *side* is one implementation timed in the benchmark: a ktfp8 backend or a peer.

Every side is built for one layer's weights, a thread count and a largest token count, and is then
called as side(x, topk_ids, topk_weights) -> y with x bfloat16 [T, hidden] (the activation dtype
every side accepts), ids int64 and weights float32 [T, top_k]; y is any float array [T, hidden].
A side has `name`, `kind` ("ktfp8" or "peer"), `format` (the weights it streams: a ktfp8 format or
"fp32"), `version`, `threads`, and `close()`; building one raises PeerUnavailable when it cannot run.
`threads` may be set between calls unless the side has `threads_fixed = True` (then build another);
`compute_unit` ("amx", "dpbf16", "fma512", "fma"; see ktfp8.roofline) names the unit its roofline is drawn for,
absent on the peers that may use any unit, which are held to the fastest unit of the machine (NumPy's FP32
peer is held to the FP32 FMA peak).  The benchmark times a side as a
Walk over copies of it, each on weights of its own, as a model's forward walks its layers."""
import numpy as np

from .. import backends, roofline
from ..moe import MoE


class PeerUnavailable(Exception):
    """This side cannot be installed, imported or run here; str(exc) says why (printed, not fatal)."""


def available_memory():
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable not found in /proc/meminfo")


def check_fits(name, nbytes):
    """A side that would copy `nbytes` of weights skips, rather than push the machine into swap."""
    budget = available_memory() // 2
    if nbytes > budget:
        raise PeerUnavailable(f"{name} needs a {nbytes / 1e9:.1f} GB copy of the weights, more than half "
                              f"the memory available now ({2 * budget / 1e9:.1f} GB)")


class Ktfp8Side:
    """ktfp8's MoE on one backend; the thread count can change between calls without repacking."""
    kind = "ktfp8"

    def __init__(self, layer, experts, backend, threads):
        from .. import __version__
        self.name = f"ktfp8 {backend}"
        self.compute_unit = roofline.backend_unit(backend)
        self.format = experts.format
        self.version = __version__
        self.moe = MoE(layer.config(experts.format), experts, backend=backend, threads=threads)

    @property
    def threads(self):
        return self.moe.threads

    @threads.setter
    def threads(self, n):
        self.moe.threads = backends.default_threads(n)

    def __call__(self, x, topk_ids, topk_weights):
        return self.moe(x, topk_ids, topk_weights)

    def close(self):
        self.moe = None


class Walk:
    """Copies of one side, each built on weights in memory of its own, called in turn by the benchmark
    as a model's forward calls its layers: walk(x, topk_ids, topk_weights, copy); copy 0 by default.
    walk_bytes: the weight bytes of all copies together."""

    def __init__(self, copies, walk_bytes):
        self.copies, self.walk_bytes = list(copies), walk_bytes
        first = self.copies[0]
        self.name, self.kind, self.format, self.version = first.name, first.kind, first.format, first.version
        self.compute_unit = getattr(first, "compute_unit", None)
        self.threads_fixed = getattr(first, "threads_fixed", False)

    @property
    def threads(self):
        return self.copies[0].threads

    @threads.setter
    def threads(self, n):
        if self.threads_fixed:
            raise ValueError(f"{self.name} runs the thread count it was built for; build another")
        for side in self.copies:
            side.threads = n

    def __call__(self, x, topk_ids, topk_weights, copy=0):
        return self.copies[copy](x, topk_ids, topk_weights)

    def close(self):
        for side in reversed(self.copies):  # kt-kernel: the copy that owns the shared pool goes last
            side.close()
        self.copies = []


def relative_error(y, reference):
    y = np.asarray(y, np.float64)
    reference = np.asarray(reference, np.float64)
    return float(np.linalg.norm(y - reference) / max(np.linalg.norm(reference), 1e-30))
