"""kt-kernel (KTransformers' own CPU MoE kernels, PyPI `kt-kernel`) as a benchmark side, run on the
same ExpertWeights ktfp8 uses.

kt-kernel reads HF-layout weights through one pointer per expert and copies them into its own buffers
during load, so the scales need no conversion: per-channel scales [E, out, 1] are the [out] vector
per expert it expects, block scales [E, ceil(out/b), ceil(in/b)] are DeepSeek's weight_scale_inv
layout it reads row-major. Which class runs depends on the build kt-kernel loaded for this CPU."""
import contextlib
import ctypes
import os
import sys

import ml_dtypes
import numpy as np

from .._native import _ext
from ..experts import ExpertWeights
from .sides import PeerUnavailable, check_fits

_BF16 = np.dtype(ml_dtypes.bfloat16)
_KT_MXCSR = None  # the MXCSR kt_kernel's import set (FTZ/DAZ), or None before/if it changed nothing

# Preferred first. AVX2FP8_MOE has no per-channel mode: it reads square group_size blocks and ignores
# quant_config.per_channel (wrong results), and group_size=0 kills the process with SIGFPE.
_CLASSES = {
    "fp8_per_channel": ("AMXFP8PerChannel_MOE",),
    "fp8_block": ("AMXFP8_MOE", "AVX2FP8_MOE"),
    "bf16": ("AMXBF16_MOE", "AVX2BF16_MOE"),
}


def _import_kt_kernel():
    """kt_kernel, imported without letting it change this thread's floating-point mode: its extension
    is built with -ffast-math, whose loader sets FTZ/DAZ in MXCSR, so the rest of the process (NumPy,
    PyTorch, the oracle) would flush subnormals to zero.  Its mode is kept for its own worker threads."""
    global _KT_MXCSR
    mine = _ext.mxcsr()
    try:
        import kt_kernel
    except Exception as exc:  # ImportError, or OSError from the native library, or torch missing
        raise PeerUnavailable(f"kt_kernel cannot be imported: {type(exc).__name__}: {exc}") from exc
    finally:
        if _KT_MXCSR is None and _ext.mxcsr() != mine:
            _KT_MXCSR = _ext.mxcsr()
        _ext.set_mxcsr(mine)
    return kt_kernel


@contextlib.contextmanager
def _kt_kernel_fp_mode():
    """Threads created in here (kt-kernel's workers) inherit the mode its import asked for."""
    mine = _ext.mxcsr()
    _ext.set_mxcsr(_KT_MXCSR if _KT_MXCSR is not None else mine)
    try:
        yield
    finally:
        _ext.set_mxcsr(mine)


def kt_kernel_version():
    """kt-kernel's version and the CPU build it loaded, e.g. '0.7.2 (avx2)'."""
    kt = _import_kt_kernel()
    return f"{kt.__version__} ({kt.__cpu_variant__})"


@contextlib.contextmanager
def _quiet_stdout():
    """kt-kernel's C++ printf()s a line per CPUInfer, pool, layer and teardown; send them to /dev/null.
    C stdio is flushed before fd 1 comes back, so buffered lines cannot leak out later."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _pick_class(moe_module, experts):
    names = _CLASSES[experts.format]
    for name in names:
        cls = getattr(moe_module, name, None)
        if cls is not None:
            return name, cls
    if experts.format == "fp8_per_channel":
        raise PeerUnavailable("kt-kernel has no per-channel FP8 MoE in this build: AMXFP8PerChannel_MOE "
                              "needs its AVX-512/AMX build, and AVX2FP8_MOE only reads square 128x128-style "
                              "block scales")
    raise PeerUnavailable(f"kt-kernel build lacks {' and '.join(names)} for {experts.format}")


def _check_shapes(name, experts):
    """kt-kernel does not validate sizes; these would corrupt its heap or read the wrong scales."""
    E, I, H = experts.gate.shape
    if H % 16:
        # the weighted sum writes 16 floats at a time per row (seen: heap corruption at H=200, 248)
        raise PeerUnavailable(f"kt-kernel needs hidden_size % 16 == 0, got {H}")
    if name.startswith("AMX") and (H % 32 or I % 32):
        raise PeerUnavailable(f"kt-kernel {name} needs hidden and intermediate sizes that are multiples "
                              f"of its 32-wide AMX tiles, got {H} and {I}")
    if experts.format == "fp8_block":
        bn, bk = experts.block
        if bn != bk:
            raise PeerUnavailable(f"kt-kernel reads square FP8 blocks (group_size), got block={experts.block}")
        if name == "AMXFP8_MOE" and (bn != 128 or H % bn or I % bn):
            # its load offsets use hidden/group_size (floor) and KTransformers only ships 128x128
            raise PeerUnavailable(f"kt-kernel AMXFP8_MOE needs 128x128 blocks dividing hidden and "
                                  f"intermediate, got block={experts.block}, sizes {H} and {I}")


def _expert_pointers(arr):
    """[[address of expert e]] for e in experts: kt-kernel's per-expert source layout, one NUMA slot."""
    return [[arr[e].ctypes.data for e in range(arr.shape[0])]]


def _contiguous(a, dtype):
    return np.ascontiguousarray(a).view(dtype)


class KtKernelMoE:
    """One MoE layer loaded into kt-kernel with its own worker pool of `threads` compute threads.

    kt-kernel pins compute thread i to core i and adds a dispatcher thread that busy-waits through
    every call (so `threads` = 1 keeps two cores busy). Workers spin 50 ms after a call, then poll
    every 1 ms; close() joins them all. kt-kernel keeps a private copy of the weights after load,
    so `experts` may be freed afterwards. Not safe to call from two Python threads at once.

    `pool`: another KtKernelMoE whose worker pool this layer shares, as KTransformers runs every layer
    of a model on one CPUInfer (separate pools would spin beside each other); `layer_idx` tells the
    layers apart."""
    kind = "peer"
    threads_fixed = True  # the pool's thread count is set when it is built

    def __init__(self, experts, top_k, threads, max_tokens, pool=None, layer_idx=0):
        if not isinstance(experts, ExpertWeights):
            raise TypeError(f"experts must be ktfp8.experts.ExpertWeights, got {type(experts).__name__}")
        for label, value in (("top_k", top_k), ("threads", threads), ("max_tokens", max_tokens)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        if top_k > experts.expert_num:
            raise ValueError(f"top_k={top_k} exceeds expert_num={experts.expert_num}")
        if not isinstance(layer_idx, (int, np.integer)) or isinstance(layer_idx, bool) or layer_idx < 0:
            raise ValueError(f"layer_idx must be an int >= 0, got {layer_idx!r}")
        if pool is not None and (not isinstance(pool, KtKernelMoE) or pool._cpu_infer is None
                                 or pool.threads != threads):
            raise ValueError("pool must be an open KtKernelMoE built for the same thread count")
        ext = _import_kt_kernel().kt_kernel_ext
        self.version = kt_kernel_version()
        self.threads = int(threads)
        name, cls = _pick_class(ext.moe, experts)
        _check_shapes(name, experts)
        # measured here: its load peaks at 2.7x the weights' bytes (1.7x stays until close())
        check_fits(f"kt-kernel {name}", int(2.7 * experts.nbytes))

        E, I, H = experts.gate.shape
        self.name = f"kt-kernel {name}"
        self.format = experts.format
        # the weight stream only; scales add 4/(128*128) or 4/in bytes per weight
        self.bytes_per_weight = 2.0 if experts.format == "bf16" else 1.0
        self._top_k, self._max_tokens, self._shape = int(top_k), int(max_tokens), (E, H)
        self._moe = self._cpu_infer = None

        with _quiet_stdout(), _kt_kernel_fp_mode():
            if pool is None:
                pool_config = ext.WorkerPoolConfig()
                pool_config.subpool_count = 1
                pool_config.subpool_numa_map = [0]
                pool_config.subpool_thread_count = [int(threads)]
                self._cpu_infer = ext.CPUInfer(pool_config)
            else:
                self._cpu_infer = pool._cpu_infer
            # kt-kernel reads the mask (experts living on a GPU: none) at every forward: keep it alive
            self._gpu_mask = np.zeros(E, np.bool_)
            config = ext.moe.MOEConfig(E, self._top_k, H, I, self._gpu_mask.ctypes.data)
            config.layer_idx = int(layer_idx)
            config.pool = self._cpu_infer.backend_
            config.max_len = self._max_tokens  # sizes its scratch; a longer batch overruns it
            code = _BF16 if experts.format == "bf16" else np.uint8
            weights = [_contiguous(a, code) for a in (experts.gate, experts.up, experts.down)]
            config.gate_projs, config.up_projs, config.down_projs = (_expert_pointers(w) for w in weights)
            if experts.format == "bf16":
                scales = []
                config.gate_scales = config.up_scales = config.down_scales = [[0] * E]
            else:
                scales = [_contiguous(s, np.float32) for s in
                          (experts.gate_scale, experts.up_scale, experts.down_scale)]
                config.gate_scales, config.up_scales, config.down_scales = (_expert_pointers(s) for s in scales)
                config.quant_config.bits = 8
                config.quant_config.zero_point = False
                if experts.format == "fp8_per_channel":
                    config.quant_config.per_channel = True
                else:
                    config.quant_config.group_size = int(experts.block[0])
            identity_map = np.arange(E, dtype=np.int64)
            try:
                self._moe = cls(config)
                self._cpu_infer.submit(self._moe.load_weights_task(identity_map.ctypes.data))
                self._cpu_infer.sync()
            except RuntimeError as exc:
                self._moe = self._cpu_infer = None
                raise PeerUnavailable(f"{self.name} refused this layer: {exc}") from exc
            del weights, scales, identity_map  # copied by kt-kernel during the load above

        self._bsz = np.zeros(1, np.int32)
        self._out = np.zeros((self._max_tokens, H), _BF16)

    def __call__(self, x, topk_ids, topk_weights):
        if self._moe is None:
            raise RuntimeError("KtKernelMoE is closed")
        E, H = self._shape
        x = np.asarray(x)
        if x.dtype != _BF16 or x.ndim != 2 or x.shape[1] != H:
            raise ValueError(f"x must be bfloat16 [T, {H}], got {x.dtype} {x.shape}")
        T = x.shape[0]
        if not 1 <= T <= self._max_tokens:
            raise ValueError(f"x has {T} tokens; this layer was built for 1..{self._max_tokens}")
        ids = np.ascontiguousarray(topk_ids, np.int64)
        weights = np.ascontiguousarray(topk_weights, np.float32)
        if ids.shape != (T, self._top_k) or weights.shape != (T, self._top_k):
            raise ValueError(f"topk_ids and topk_weights must be [{T}, {self._top_k}], "
                             f"got {ids.shape} and {weights.shape}")
        if ids.size and ids.max() >= E:  # kt-kernel indexes with them unchecked; ids < 0 are skipped
            raise ValueError(f"topk_ids must be < expert_num={E}, got {ids.max()}")
        x = np.ascontiguousarray(x)
        self._bsz[0] = T
        task = self._moe.forward_task(self._bsz.ctypes.data, self._top_k, ids.ctypes.data,
                                      weights.ctypes.data, x.ctypes.data, self._out.ctypes.data, False)
        self._cpu_infer.submit(task)
        self._cpu_infer.sync()
        return self._out[:T].copy()

    def close(self):
        """Frees kt-kernel's weight copy, then its worker pool unless another layer still shares it
        (the layer goes before its pool; the last layer to close joins the workers)."""
        if self._cpu_infer is None:
            return
        with _quiet_stdout():
            self._moe = None
            self._cpu_infer = None

    def __del__(self):
        if getattr(self, "_cpu_infer", None) is not None:
            self.close()
