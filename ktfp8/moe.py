"""MoE: routed experts packed once for one kernel backend, then run many times.

Also the classes with the names KTransformers users know (AMXFP8PerChannel_MOE, AMXFP8_MOE,
AMXBF16_MOE): they run the native AVX-512-BF16 path or AMX; on a CPU without either, constructing one
raises RuntimeError saying what the CPU lacks (ktfp8.MoE runs everywhere).  _HAS_FP8_PERCHANNEL_SUPPORT
is True exactly when they can be constructed."""
import copy
import sys

import ml_dtypes
import numpy as np

from . import backends
from ._native import _ext
from ._torch import accepts_tensors, plain_layer_memory
from .config import ODD_BLOCK_EDGE, MoeConfig
from .experts import ExpertMatrices, ExpertWeights

_W = _ext.ktfp8_wformat
_FORMAT_CODES = {"fp8_per_channel": _W.KTFP8_FMT_FP8_CHANNEL, "fp8_block": _W.KTFP8_FMT_FP8_BLOCK,
                 "bf16": _W.KTFP8_FMT_BF16}
_BF16 = np.dtype(ml_dtypes.bfloat16)
_X_DTYPES = (np.dtype(np.float32), _BF16)
_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_WEIGHT_DTYPES = (np.dtype(np.float32),)


def _expected_format(quant_config):
    if quant_config.method == "BF16":
        return "bf16"
    return "fp8_per_channel" if quant_config.per_channel else "fp8_block"


def _packable(weights, bits):
    """`weights` [E, out, in] as PackedMoE reads them, viewed as `bits`: each expert's matrix where it
    lies when it is C-contiguous (a strided view over a checkpoint's experts, an ExpertMatrices's matrices),
    which saves copying the layer once more beside its packed copy; else a contiguous copy."""
    if isinstance(weights, ExpertMatrices):
        return [np.ascontiguousarray(m).view(bits) for m in weights.matrices]
    _, out, inp = weights.shape
    row_step, step = weights.strides[1:]
    if (inp == 1 or step == weights.itemsize) and (out == 1 or row_step == inp * weights.itemsize):
        return weights.view(bits)
    return np.ascontiguousarray(weights).view(bits)


def check_layer_types(config, experts):
    """TypeError unless config is a MoeConfig and experts ExpertWeights: what every layer class takes."""
    if not isinstance(config, MoeConfig):
        raise TypeError(f"config must be a ktfp8.MoeConfig, got {type(config).__name__}")
    if not isinstance(experts, ExpertWeights):
        raise TypeError(f"experts must be ktfp8.ExpertWeights, got {type(experts).__name__}")


def native_shape(expert_num, hidden, intermediate, fmt, block=None):
    """The shape tuple the native seam takes (PackedMoE, _ext.packed_size) for experts in format `fmt`
    ("fp8_per_channel", "fp8_block" with its (n, k) block, "bf16")."""
    block = block or (0, 0)
    return expert_num, hidden, intermediate, _FORMAT_CODES[fmt], int(block[0]), int(block[1])


def _check_matches(config, experts):
    check_layer_types(config, experts)
    got = (experts.total_experts, experts.hidden_size, experts.intermediate_size)
    want = (config.expert_num, config.hidden_size, config.intermediate_size)
    if got != want:
        raise ValueError(f"experts hold (expert_num, hidden_size, intermediate_size) = {got}, "
                         f"config says {want}")
    fmt = _expected_format(config.quant_config)
    if experts.format != fmt:
        raise ValueError(f"experts are {experts.format!r} but config.quant_config asks for {fmt!r}")
    if fmt == "fp8_block":
        if experts.block[1] % 2:
            raise ValueError(f"block-wise FP8 needs an even K block edge, got block={experts.block}: "
                             f"{ODD_BLOCK_EDGE}")
        if tuple(experts.block) != (config.quant_config.group_size,) * 2:
            raise ValueError(f"experts use block {tuple(experts.block)}, config.quant_config.group_size "
                             f"is {config.quant_config.group_size}")


def _as_c_array(name, a, dtypes, ndim):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(a).__name__}")
    if isinstance(a, np.ma.MaskedArray):    # the kernels would read the masked values as they are
        raise TypeError(f"{name} is a numpy.ma.MaskedArray, whose mask ktfp8 cannot honour: pass "
                        f"{name}.filled(...) or np.asarray({name})")
    if a.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray, or .contiguous() on a tensor)")
    return a


class MoE:
    """Routed experts of one layer, packed for `backend` (default: the best this CPU runs).

    y = moe(x, topk_ids, topk_weights): x float32 or bfloat16 [T, hidden_size]; topk_ids int32/int64
    [T, num_experts_per_tok] (ids < 0 are skipped); topk_weights float32 [T, num_experts_per_tok].
    Each may be a torch tensor on the CPU (read in place; y is then a tensor). copy_to_cpu=True lets
    tensors on another device (CUDA, ...) through: copied to the CPU for each call, y copied back.

    `experts` may be a shard of the layer (ExpertWeights.expert_range inside range(config.expert_num)):
    ids are global, those outside the shard are skipped like ids < 0, so the outputs of MoEs over
    disjoint shards that cover the layer sum to the whole layer's output.

    The layer keeps a copy of `config` taken when it is built: changing that config afterwards (or
    reusing it for another layer) does not change this one."""

    def __init__(self, config, experts, backend=None, threads=None, copy_to_cpu=False):
        _check_matches(config, experts)
        self._config = copy.deepcopy(config)
        self.copy_to_cpu = bool(copy_to_cpu)
        variant = backends.variant(backend)
        self.backend = variant.name
        self._threads = backends.default_threads(threads if threads is not None else config.threads)
        self.expert_range = experts.expert_range
        self._whole_layer = len(self.expert_range) == config.expert_num
        self._act_dtype = variant.act_dtype
        fmt = experts.format
        self._shape = native_shape(experts.expert_num, experts.hidden_size, experts.intermediate_size, fmt,
                                   experts.block)
        bits = np.uint16 if fmt == "bf16" else np.uint8
        proj = [_packable(p, bits) for p in (experts.gate, experts.up, experts.down)]
        scales = [None if s is None else np.ascontiguousarray(s, dtype=np.float32)
                  for s in (experts.gate_scale, experts.up_scale, experts.down_scale)]
        self._kernel = _ext.PackedMoE(variant, self._shape, *proj, *scales, self._threads, config.swiglu_limit,
                                       config.hidden_act)

    @property
    def config(self):
        """A copy of the MoeConfig this layer was built with (its sizes and routing are fixed)."""
        return copy.deepcopy(self._config)

    @property
    def threads(self):
        """OpenMP threads of each call.  Assignable: the next call runs with the new count (validated
        like threads=; None: the count construction without threads= gives, the config's threads, else
        the environment's, read again)."""
        return self._threads

    @threads.setter
    def threads(self, threads):
        self._threads = backends.default_threads(threads if threads is not None else self._config.threads)

    @property
    def nbytes(self):
        """Resident bytes of the packed weights (FP8: about one byte per weight)."""
        return self._kernel.packed.nbytes

    def __copy__(self):
        """A layer sharing this one's packed weights (never written after packing), with its own
        thread count and copy_to_cpu."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        """copy.copy with a config of its own: the packed weights are immutable, so sharing them
        loses nothing and saves a copy of the layer's weights."""
        new = self.__copy__()
        new._config = copy.deepcopy(self._config, memo)
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError(f"{type(self).__name__} cannot be pickled: its weights are packed for this "
                        f"CPU's {self.backend!r} kernel; pickle its ExpertWeights (or pass a checkpoint "
                        "path) and build the layer in the other process")

    def __call__(self, x, topk_ids, topk_weights, out=None, accumulate=False):
        y = None
        if out is None and accumulate is False:
            y = self._plain_call(x, topk_ids, topk_weights)
            if y is None:
                y = self._plain_tensor_call(x, topk_ids, topk_weights)
        return y if y is not None else self._checked_call(x, topk_ids, topk_weights, out, accumulate)

    def _plain_call(self, x, topk_ids, topk_weights):
        """y for the usual call on NumPy arrays (x float32 or bfloat16, int64 ids, float32 weights, all
        C-contiguous) over the whole layer, through the native checks alone (PackedMoE.forward_plain
        says why); None, nothing computed, for any other arguments."""
        if not self._whole_layer:
            return None
        backends.warn_if_one_thread(self._threads)
        return self._kernel.forward_plain(x, topk_ids, topk_weights, _BF16, self._config.num_experts_per_tok,
                                          self._act_dtype, self._threads)

    def _plain_tensor_call(self, x, topk_ids, topk_weights, bf16_weights=False):
        """y, a new tensor like x, for the usual call on plain CPU tensors (_torch.plain_layer_memory
        says which, and why by address) over the whole layer; None, nothing computed, for any other
        arguments.  bf16_weights: bfloat16 weights too, widened exactly by the driver, for a caller
        that would widen them anyway (ktfp8.hf's TorchMoE: a transformers router's weights)."""
        if not self._whole_layer:
            return None
        cfg = self._config
        memory = plain_layer_memory(x, topk_ids, topk_weights, cfg.hidden_size, cfg.num_experts_per_tok, bf16_weights)
        if memory is None:
            return None
        y = sys.modules["torch"].empty_like(x)
        backends.warn_if_one_thread(self._threads)
        # topk_ids itself is read only for the error an id >= E raises
        self._kernel.forward_memory(*memory, y.data_ptr(), cfg.num_experts_per_tok, self._act_dtype, self._threads,
                                    topk_ids)
        return y

    @accepts_tensors("x", copy_to_cpu=lambda args: args["self"].copy_to_cpu)
    def _checked_call(self, x, topk_ids, topk_weights, out=None, accumulate=False):
        """The call on any arguments: torch tensors, int32 ids, out=, a shard of the layer; each checked
        here, with the error naming what is wrong."""
        return self._compute(*self._arguments(x, topk_ids, topk_weights, out, accumulate), accumulate)

    def _compute(self, x, ids, topk_weights, out, accumulate=False):
        """The call on _arguments' result (ExpertParallelMoE's ranks check their arguments, and agree
        that all of them passed, before any of them computes)."""
        backends.warn_if_one_thread(self._threads)
        # expert ids >= expert_num are refused there, before anything is written
        self._kernel.forward(x, ids, topk_weights, out, bool(accumulate), self._act_dtype, self._threads,
                             self._config.expert_num)
        return out

    def _arguments(self, x, topk_ids, topk_weights, out, accumulate):
        """(x, local ids, topk_weights, out) of NumPy arrays as the kernel takes them, or the TypeError /
        ValueError naming the first argument it cannot take; nothing is computed."""
        cfg = self._config
        x = _as_c_array("x", x, _X_DTYPES, 2)
        if x.shape[1] != cfg.hidden_size:
            raise ValueError(f"x must have shape [T, {cfg.hidden_size}], got {x.shape}")
        T, k = x.shape[0], cfg.num_experts_per_tok
        topk_ids = _as_c_array("topk_ids", topk_ids, _ID_DTYPES, 2)
        topk_weights = _as_c_array("topk_weights", topk_weights, _WEIGHT_DTYPES, 2)
        for name, a in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if a.shape != (T, k):
                raise ValueError(f"{name} must have shape [T, num_experts_per_tok] = {(T, k)}, got {a.shape}")
        if not isinstance(accumulate, (bool, np.bool_)):   # "False" would add into out
            raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__} {accumulate!r}")
        if out is None:
            if accumulate:
                raise ValueError("accumulate=True needs out= (the array to add into)")
            out = np.empty_like(x)
        else:
            out = _as_c_array("out", out, (x.dtype,), 2)
            if out.shape != x.shape:
                raise ValueError(f"out must have the shape of x {x.shape}, got {out.shape}")
            if not out.flags.writeable:
                raise ValueError("out must be writeable")
        return x, self._local_ids(topk_ids), topk_weights, out

    def _local_ids(self, topk_ids):
        """int64 ids into the packed experts: global id - first expert, -1 (skip) outside the shard."""
        ids = topk_ids.astype(np.int64, copy=False)
        own = self.expert_range
        expert_num = self._config.expert_num
        if self._whole_layer:
            return ids
        if ids.size and ids.max() >= expert_num:   # the kernel only sees local ids
            raise ValueError(f"topk_ids holds expert id {int(ids.max())} >= expert_num {expert_num}")
        held = (ids >= own.start) & (ids < own.stop)
        return np.where(held, ids - own.start, -1)

    @accepts_tensors("x", copy_to_cpu=lambda args: args["self"].copy_to_cpu)
    def forward(self, x, topk_ids=None, topk_weights=None, *, router_logits=None, correction_bias=None,
                out=None, accumulate=False):
        """Like __call__; with router_logits= the experts are chosen by ktfp8.route first."""
        if router_logits is not None:
            if topk_ids is not None or topk_weights is not None:
                raise ValueError("pass either router_logits= or topk_ids/topk_weights, not both")
            from .routing import route
            x = _as_c_array("x", x, _X_DTYPES, 2)
            topk_ids, topk_weights = route(router_logits, self._config, correction_bias=correction_bias)
            if len(topk_ids) != len(x):
                raise ValueError(f"router_logits must have one row per token of x: got {len(topk_ids)} rows "
                                 f"for {len(x)} tokens")
        elif correction_bias is not None:    # it would be dropped: the experts are already chosen
            raise ValueError("correction_bias= applies to router_logits=: pass it with router_logits, or "
                             "add it yourself before choosing topk_ids")
        elif topk_ids is None or topk_weights is None:
            raise ValueError("forward needs topk_ids and topk_weights, or router_logits=")
        return self(x, topk_ids, topk_weights, out=out, accumulate=accumulate)

    def __repr__(self):
        own = self.expert_range
        expert_num = self._config.expert_num
        held = "" if self._whole_layer else f" ({own!r} of {expert_num})"
        return (f"MoE(backend={self.backend!r}, experts={self._shape[0]}{held}, hidden={self._shape[1]}, "
                f"intermediate={self._shape[2]}, nbytes={self.nbytes})")


@accepts_tensors("x", copy_to_cpu=lambda args: args.get("copy_to_cpu", False))
def moe_forward(x, experts, topk_ids, topk_weights, config, backend=None, out=None, accumulate=False,
                copy_to_cpu=False, threads=None):
    """Functional form: packs `experts` for this call, then runs it (prefer MoE for repeated calls).
    copy_to_cpu: as for MoE (tensors on another device are copied to the CPU and y back); threads: this
    call's, else as MoE has it (config.threads, $KTFP8_NUM_THREADS, ...)."""
    return MoE(config, experts, backend=backend, threads=threads)(x, topk_ids, topk_weights, out=out,
                                                                  accumulate=accumulate)


# the native classes' backends, best first, and the CPU flags the slower of them needs (dispatch.c)
_NATIVE_NAMES = ("amx", "avx512_bf16")
_NATIVE_BACKENDS = [b for b in _NATIVE_NAMES if b in backends.available_backends()]
_AVX512_BF16_FLAGS = ("os_avx512", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vbmi")


def _unsupported(name):
    """Why `name` cannot run here, and what to use instead."""
    features = backends.cpu_features()
    lacking = [flag for flag in _AVX512_BF16_FLAGS if not flag.startswith("os_") and not features.get(flag)]
    os_off = [flag[3:].upper() for flag in _AVX512_BF16_FLAGS if flag.startswith("os_") and not features.get(flag)]
    why = (f"this CPU lacks {', '.join(lacking)}" if lacking else
           f"the OS has not enabled {', '.join(os_off)} register state (XCR0)" if os_off else
           backends.NATIVE_LEFT_OUT)
    return (f"{name} needs the native AVX-512-BF16 path (AVX-512 F/DQ/BW/VL + BF16 + VBMI) or AMX, and {why}; "
            f"use ktfp8.MoE(config, experts), which runs the same weights here with backend "
            f"{backends.available_backends()[0]!r}")


def _native_backend(name):
    """The backend class `name` runs: $KTFP8_BACKEND where it names one of the native paths (amx,
    avx512_bf16, or their emulated twins), the best native one where it is unset; any other backend
    would not be what the class's name promises, and ignoring the variable would not be what it says."""
    forced = backends._getenv(backends.ENV_BACKEND)
    if not forced:
        return _NATIVE_BACKENDS[0]
    if forced.removesuffix("_emulated") not in _NATIVE_NAMES:
        raise ValueError(f"{backends.ENV_BACKEND}={forced!r}: {name} runs the amx or avx512_bf16 backend; "
                         f"unset it, or use ktfp8.MoE(config, experts) for {forced!r}")
    return forced       # MoE says why when this CPU or build cannot run it


def _native_class(name, fmt, doc):
    """A KTransformers-named class bound to one weight format, using AMX where the CPU has it and
    the AVX-512-BF16 path otherwise; constructing it where neither runs raises RuntimeError."""

    def __init__(self, config, experts, threads=None, copy_to_cpu=False):
        if not _NATIVE_BACKENDS:
            raise RuntimeError(_unsupported(name))
        check_layer_types(config, experts)
        if experts.format != fmt:
            raise ValueError(f"{name} takes {fmt!r} experts, got {experts.format!r}")
        MoE.__init__(self, config, experts, backend=_native_backend(name), threads=threads, copy_to_cpu=copy_to_cpu)

    return type(name, (MoE,), {"__init__": __init__, "__doc__": doc})


AMXFP8PerChannel_MOE = _native_class("AMXFP8PerChannel_MOE", "fp8_per_channel",
                                     "FP8 E4M3 experts with one fp32 scale per output row.")
AMXFP8_MOE = _native_class("AMXFP8_MOE", "fp8_block", "FP8 E4M3 experts with block-wise scales.")
AMXBF16_MOE = _native_class("AMXBF16_MOE", "bf16", "BF16 experts.")
_HAS_FP8_PERCHANNEL_SUPPORT = bool(_NATIVE_BACKENDS)
