"""Expert parallelism over torch.distributed (gloo, CPU): each rank holds a contiguous range of a
layer's experts, computes the partial output of the ids it holds, and one all-reduce (SUM) per call
gives every rank the layer's output.

Activations are replicated: every rank calls with the same x, topk_ids and topk_weights (as every rank
runs the same non-expert layers).  Experts are split as evenly as possible (split_experts: sizes
differ by at most one, the first ranks hold one more); a world size above the expert count is refused.
Every collective is bounded: a rank that dies, or does not reach the collective within `timeout_s`
(argument, else $KTFP8_DIST_TIMEOUT_S, else 300 s), makes the others raise ExpertParallelError.
torch is imported when this module's functions are called, never by `import ktfp8`."""
import datetime
import os
import time
import zlib

import ml_dtypes
import numpy as np

from .config import HIDDEN_ACTS
from .experts import FORMATS, split_experts
from ._torch import to_device, to_numpy
from .moe import MoE, check_layer_types

ENV_TIMEOUT = "KTFP8_DIST_TIMEOUT_S"
ENV_EXPERT_PARALLEL = "KTFP8_EXPERT_PARALLEL"   # "0": ktfp8.hf keeps every expert on every rank
DEFAULT_TIMEOUT_S = 300.0
# about 3 years: torch's stores and gloo count a timeout in 64-bit milli- or nanoseconds, and 1e10 s
# failed the rendezvous at once, 1e11 s hung it, 1e15 s overflowed datetime.timedelta (torch 2.13)
MAX_TIMEOUT_S = 1e8
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_group_timeout_s = None     # the bound init_process_group started torch.distributed with, once it has


class ExpertParallelError(RuntimeError):
    """A collective between the ranks failed: a rank died, stalled past the timeout, or disagrees."""


def timeout_seconds(timeout_s=None):
    """The bound on every collective: `timeout_s`, else the one init_process_group() started the group
    with, else $KTFP8_DIST_TIMEOUT_S, else 300 s."""
    source = "timeout_s"
    if timeout_s is None and _group_timeout_s is not None:
        return _group_timeout_s
    if timeout_s is None:
        timeout_s, source = os.environ.get(ENV_TIMEOUT, "").strip() or DEFAULT_TIMEOUT_S, ENV_TIMEOUT
    if isinstance(timeout_s, bool):   # float(True) would read as one second
        raise ValueError(f"{source} must be a positive number of seconds, got {timeout_s!r}")
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a positive number of seconds, got {timeout_s!r}") from None
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{source} must be a positive number of seconds, at most {MAX_TIMEOUT_S:.0e} (about 3 "
                         f"years), got {timeout_s!r}")
    return value


def _dist():
    import torch.distributed as dist
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    return dist


def init_process_group(timeout_s=None, numa=True):
    """Initialises torch.distributed (gloo) from torchrun's environment, unless it already is, with
    every collective (and the rendezvous itself) bounded by timeout_seconds(timeout_s).
    numa=True: on a machine with several NUMA nodes, first pins this rank to its node(s)
    (ktfp8.numa.pin_local_rank), so the experts it packs later live in its node's memory.
    Returns (rank, world_size)."""
    global _group_timeout_s
    dist = _dist()
    if numa:
        from .numa import pin_local_rank
        pin_local_rank()
    if not dist.is_initialized():
        missing = [v for v in TORCHRUN_VARS if not os.environ.get(v)]
        if missing:
            raise RuntimeError(f"torch.distributed is not initialised and {', '.join(missing)} is not set: "
                               f"launch with `torchrun --nproc-per-node N ...` or call "
                               f"torch.distributed.init_process_group first")
        seconds = timeout_seconds(timeout_s)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
        _group_timeout_s = seconds      # the default of every collective that follows (ExpertParallelMoE's)
    return dist.get_rank(), dist.get_world_size()


# How long destroy_process_group leaves the GIL to gloo's worker threads.  A worker drops its last
# collective's tensors after the collective has completed, and dropping a tensor that Python knows
# takes the GIL; a process that starts finalizing while a worker waits for it aborts ("terminate
# called without an active exception", torch 2.13).  python -m ktfp8.generate under torchrun, whose
# last all-reduce comes milliseconds before exit, did so in 2 of 100 runs on the Zen 4 VM.
GLOO_RELEASE_S = 0.2


def destroy_process_group():
    """Ends torch.distributed (if initialised), then sleeps GLOO_RELEASE_S so that gloo's worker threads
    can release the last collective's tensors before the interpreter finalizes.  For the end of a rank's
    script, in place of torch.distributed.destroy_process_group."""
    global _group_timeout_s
    dist = _dist()
    if dist.is_initialized():
        dist.destroy_process_group()
    _group_timeout_s = None
    time.sleep(GLOO_RELEASE_S)   # releases the GIL


def rank_and_size(group=None):
    """(rank, world size) in `group` (default: the whole world); an error when not initialised."""
    dist = _dist()
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call ktfp8.distributed.init_process_group() "
                           "(or torch.distributed.init_process_group) first")
    return dist.get_rank(group), dist.get_world_size(group)


def rank_experts(expert_num, group=None):
    """The contiguous range of a layer's `expert_num` experts this rank holds."""
    rank, size = rank_and_size(group)
    return split_experts(expert_num, size, name="world size")[rank]


def _bounded(op, what, group, timeout_s):
    """Runs collective `op(async_op=True)` and waits at most the timeout; failures -> ExpertParallelError."""
    _wait(op(), what, group, timeout_s)


def _wait(work, what, group, timeout_s):
    """Waits at most the timeout for a started collective; failures -> ExpertParallelError."""
    seconds = timeout_seconds(timeout_s)
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as err:
        rank, size = rank_and_size(group)
        raise ExpertParallelError(f"{what} failed on rank {rank} of {size}: a rank died, or did not reach this "
                                  f"collective within timeout_s={seconds:g} ({err})") from err


def all_reduce_sum(tensor, group=None, timeout_s=None):
    """Sums a CPU tensor over the ranks in place (one gloo all-reduce), bounded by the timeout."""
    dist = _dist()
    _bounded(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True),
             "all-reduce of the partial expert outputs", group, timeout_s)
    return tensor


def check_same_on_all_ranks(values, what, group=None, timeout_s=None):
    """All-gathers a short list of ints and raises ValueError naming the ranks when they differ
    (mismatched shapes would otherwise make the all-reduce fail obscurely or sum garbage)."""
    import torch
    dist = _dist()
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(rank_and_size(group)[1])]
    _bounded(lambda: dist.all_gather(gathered, mine, group=group, async_op=True), f"checking {what}",
             group, timeout_s)
    rows = [g.tolist() for g in gathered]
    if any(r != rows[0] for r in rows):
        raise ValueError(f"the ranks disagree on {what}: " + "; ".join(f"rank {i}: {r}" for i, r in enumerate(rows)))


class ExpertParallelMoE:
    """One MoE layer split over the ranks of `group`: this rank packs only rank_experts(expert_num).

    `experts` holds at least this rank's range (the whole layer, e.g. memory-mapped, or exactly the
    shard); from_loader() reads only the shard from a checkpoint.  y = ep(x, topk_ids, topk_weights)
    takes and returns what MoE does (NumPy arrays or CPU torch tensors); the partial outputs are
    computed and summed in float32, then given x's dtype.  `timings` accumulates compute and
    all-reduce seconds separately."""

    def __init__(self, config, experts, *, group=None, backend=None, threads=None, timeout_s=None):
        check_layer_types(config, experts)
        self.rank, self.world_size = rank_and_size(group)
        self.group = group
        self.timeout_s = timeout_seconds(timeout_s)
        self.expert_range = split_experts(config.expert_num, self.world_size, name="world size")[self.rank]
        shard = experts if experts.expert_range == self.expert_range else experts.shard(self.expert_range)
        self.moe = MoE(config, shard, backend=backend, threads=threads)
        self.config = self.moe.config   # a copy, as MoE keeps
        # the epilogue's fields too: ranks computing another activation or clamp would sum a mix silently
        limit_bits = -1 if config.swiglu_limit is None else int(np.float32(config.swiglu_limit).view(np.int32))
        check_same_on_all_ranks((config.expert_num, config.hidden_size, config.intermediate_size,
                                 config.num_experts_per_tok, FORMATS.index(experts.format),
                                 HIDDEN_ACTS.index(config.hidden_act), limit_bits),
                                f"(expert_num, hidden_size, intermediate_size, num_experts_per_tok, format, "
                                f"hidden_act: index in {HIDDEN_ACTS}, swiglu_limit: float32 bits, -1 for none)",
                                group, self.timeout_s)
        self.timings = {"calls": 0, "compute_s": 0.0, "allreduce_s": 0.0}

    @classmethod
    def from_loader(cls, loader, layer, config=None, **kwargs):
        """Reads only this rank's experts of `layer` from an FP8SafeTensorLoader (memory-mapped)."""
        config = loader.config if config is None else config
        experts = loader.load_experts(layer, experts=rank_experts(config.expert_num, kwargs.get("group")))
        return cls(config, experts, **kwargs)

    @property
    def nbytes(self):
        """Resident bytes of this rank's packed experts (about 1/world_size of the layer's)."""
        return self.moe.nbytes

    def __call__(self, x, topk_ids, topk_weights):
        import torch
        start = time.perf_counter()
        # Each rank checks its arguments before the input check's gather, which carries whether they
        # passed: a rank that refused them in the compute left the others waiting at the all-reduce for
        # the whole timeout, then blaming a dead rank, and the ranks' later calls paired off by one.
        try:
            given = [to_numpy(a, name, bool(self.moe.copy_to_cpu)) for a, name in
                     ((_float32(x), "x"), (topk_ids, "topk_ids"), (topk_weights, "topk_weights"))]
            arguments = self.moe._arguments(*given, None, False)   # shapes, layouts, dtypes
            refused = None
        except (TypeError, ValueError) as err:
            given, refused = None, err
        # Started before the compute, checked before the all-reduce: ranks fed different tokens (data
        # parallel, each rank its own batch) would otherwise sum shares of different tokens, or abort
        # in gloo on a size mismatch.
        inputs = _InputCheck(given, refused, self.group, self.timeout_s)
        partial = None if refused else self.moe._compute(*arguments)
        inputs.raise_if_ranks_differ()
        reduced = time.perf_counter()
        summed = torch.from_numpy(partial)
        all_reduce_sum(summed, self.group, self.timeout_s)  # in place: float32, so BF16 rounds once
        self.timings["calls"] += 1
        self.timings["compute_s"] += reduced - start
        self.timings["allreduce_s"] += time.perf_counter() - reduced
        if isinstance(x, torch.Tensor):      # on x's device, as MoE gives it back
            return summed.to(x.dtype) if x.is_cpu else to_device(summed.to(x.dtype), x.device)
        return partial if x.dtype == np.float32 else partial.astype(x.dtype)

    def __repr__(self):
        return f"ExpertParallelMoE(rank={self.rank} of {self.world_size}, {self.moe!r})"


class _InputCheck:
    """One all-gather, started at construction, of this rank's token count and CRC-32s of its inputs;
    raise_if_ranks_differ() waits for it and raises ExpertParallelError on every rank alike when any
    rank's differs.  Expert parallel needs the same inputs on every rank (the ranks run the same
    non-expert layers).  Other tokens route differently, so the routing's bytes tell them apart; of x
    only every X_STRIDE-th column is hashed (all of it took 3.5-6 ms at T = 512, H = 7168: 2-4 GB/s)."""

    X_STRIDE = 64
    FIELDS = ("tokens", f"crc32(x[:, ::{X_STRIDE}])", "crc32(topk_ids)", "crc32(topk_weights)")

    def __init__(self, given, refused, group, timeout_s):
        """given: this rank's x (float32), topk_ids and topk_weights as NumPy arrays; refused: the error
        they got instead (ExpertParallelMoE checks them first), or None."""
        import torch
        dist = _dist()
        self.group, self.timeout_s, self.refused = group, timeout_s, refused
        if refused is None:
            x32, topk_ids, topk_weights = given
            hashed = (x32[:, ::self.X_STRIDE], topk_ids, topk_weights)
            mine = [0, x32.shape[0]] + [_crc32(a) for a in hashed]
        else:
            mine = [1] + [0] * len(self.FIELDS)
        self.mine = torch.tensor(mine, dtype=torch.int64)
        self.gathered = [torch.empty_like(self.mine) for _ in range(rank_and_size(group)[1])]
        self.work = dist.all_gather(self.gathered, self.mine, group=group, async_op=True)

    def raise_if_ranks_differ(self):
        _wait(self.work, "checking the inputs", self.group, self.timeout_s)
        if self.refused is not None:
            raise self.refused
        refusing = [i for i, g in enumerate(self.gathered) if g[0]]
        if refusing:
            raise ExpertParallelError(f"rank(s) {', '.join(map(str, refusing))} refused their arguments (their "
                                      f"error says why), so no rank computed this call")
        rows = [g.tolist()[1:] for g in self.gathered]
        if any(r != rows[0] for r in rows):
            fields = ", ".join(self.FIELDS)
            raise ExpertParallelError(
                "expert parallel needs the same x, topk_ids and topk_weights on every rank, and the ranks' "
                f"differ ({fields}: " + "; ".join(f"rank {i}: {r}" for i, r in enumerate(rows)) + "). Under "
                "torch.distributed, ktfp8.hf splits each layer's experts over the ranks; for data parallel "
                f"(each rank its own tokens) set {ENV_EXPERT_PARALLEL}=0 so that every rank holds every expert")


def _crc32(a):
    """CRC-32 of the bytes of a NumPy array (any dtype, made contiguous)."""
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) if a.size else 0


_BF16 = np.dtype(ml_dtypes.bfloat16)


def _float32(x):
    """x (float32 or bfloat16, NumPy array or torch tensor) as float32 of the same kind; the dtype is
    checked here because widening would hide a wrong one."""
    import torch
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
        return x.detach().to(torch.float32)
    if isinstance(x, np.ndarray):
        if x.dtype not in (np.dtype(np.float32), _BF16):
            raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
        return x.astype(np.float32, copy=False)
    raise TypeError(f"x must be a numpy array or a torch tensor, got {type(x).__name__}")
