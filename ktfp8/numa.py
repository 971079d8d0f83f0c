"""NUMA placement: which CPUs and memory each node has, which experts each node's thread team (or
rank) holds, and pinning so that a team's packed experts are first-touched on its own node; and
which cores hold a set of CPUs, since a thread team takes one thread per core (cores_of).

On a two-socket server a thread reading the other socket's memory gets a fraction of the bandwidth,
and decode is bandwidth-bound.  Linux places an anonymous page on the node of the CPU that first
writes it, so a thread team pinned to a node *before* it packs (MoE.__init__ writes the packed copy)
keeps its experts local, without libnuma.  The topology comes from /sys/devices/system/node (the root
is a parameter, so tests can fake a machine); without it, the machine is one node."""
import functools
import numbers
import os
import re
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from . import cpu_quota
from .experts import split_experts

NODE_ROOT = "/sys/devices/system/node"
CPU_ROOT = "/sys/devices/system/cpu"        # cpuN/topology: the core of each CPU (cores_of)
_NODE_DIR = re.compile(r"^node(\d+)$")
_MEM_TOTAL = re.compile(r"MemTotal:\s*(\d+)\s*kB")
# The highest CPU number taken (in a cpulist, a node, pin).  Linux is built for at most 8192 CPUs (NR_CPUS;
# x86-64's CONFIG_MAXSMP), so 2**20 leaves ample room to grow, while a corrupt or hostile cpulist such as
# '0-4294967295' (billions of ints: memory runs out first) is refused at once; '0-1048575' takes 0.1 s.
MAX_CPU = 2**20 - 1


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: Tuple[int, ...]                 # every CPU of the node (nodeN/cpulist)
    memory_bytes: Optional[int] = None    # nodeN/meminfo MemTotal; None where unknown


@dataclass(frozen=True)
class Placement:
    """One thread team (or rank): its node, the CPUs it runs on and the experts it holds."""
    node: int
    cpus: Tuple[int, ...]
    experts: range


def parse_cpulist(text, source="cpulist"):
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); '' -> () (a node without CPUs).  CPU numbers above
    MAX_CPU are refused."""
    if not isinstance(text, str):
        raise TypeError(f"{source}: a CPU list is a str such as '0-3,8', got {type(text).__name__}")
    cpus = []
    for part in text.strip().split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ValueError(f"{source}: cannot read CPU list {text.strip()!r} (expected e.g. '0-3,8')")
        if int(m[2] or m[1]) > MAX_CPU:        # checked before the range is expanded
            raise ValueError(f"{source}: CPU list {text.strip()!r} names CPU {int(m[2] or m[1])}, above "
                             f"ktfp8.numa.MAX_CPU = {MAX_CPU} (Linux runs at most 8192 CPUs)")
        cpus.extend(range(int(m[1]), int(m[2] or m[1]) + 1))
    return tuple(sorted(set(cpus)))


def topology(root=NODE_ROOT):
    """The NUMA nodes under `root`, by id.  No such folder (not Linux, or no NUMA support in the
    kernel): one node 0 with the CPUs this process may use and unknown memory."""
    root = Path(root)
    dirs = sorted((int(m[1]), p) for p in root.glob("node*") if (m := _NODE_DIR.match(p.name)))
    if not root.is_dir() or not dirs:
        return [NumaNode(0, tuple(sorted(affinity_cpus())))]
    nodes = []
    for node_id, path in dirs:
        cpulist = path / "cpulist"
        cpus = parse_cpulist(cpulist.read_text(), str(cpulist)) if cpulist.is_file() else ()
        meminfo = path / "meminfo"
        m = _MEM_TOTAL.search(meminfo.read_text()) if meminfo.is_file() else None
        nodes.append(NumaNode(node_id, cpus, int(m[1]) * 1024 if m else None))
    return nodes


def affinity_cpus():
    """The CPUs this process may run on: its affinity mask (taskset, cgroups' cpusets)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def cores_of(cpus, root=None):
    """`cpus` grouped by the core that holds them: a tuple of cores, each the tuple of its CPUs among
    `cpus`, in CPU order.  Linux numbers an SMT core's hardware threads (Intel's Hyper-Threading, AMD's
    SMT) as CPUs of their own, sharing the core's execution units, its L1 and L2 and its AMX unit, and
    usually far apart (CPUs 0-55 the first threads of a 56-core socket, 56-111 their siblings).  A
    core's CPUs come from <root>/cpuN/topology/core_cpus_list (thread_siblings_list before Linux 5.7),
    root defaulting to CPU_ROOT; a CPU whose topology cannot be read is a core of its own."""
    return _cores_of(frozenset(_cpu_set("cpus", cpus)), root or CPU_ROOT)


def cores_of_affinity():
    """cores_of(affinity_cpus()), the CPU numbers from the kernel taken as they are: the default thread
    count asks on every codec call."""
    return _cores_of(frozenset(affinity_cpus()), CPU_ROOT)


@functools.lru_cache(maxsize=32)
def _cores_of(cpus, root):
    """cores_of, remembered per CPU set and root: sysfs costs tens of microseconds per CPU."""
    cores = {}
    for cpu in sorted(cpus):
        cores.setdefault(_core_cpus(root, cpu), []).append(cpu)
    return tuple(tuple(core) for core in cores.values())


def _core_cpus(root, cpu):
    """Every CPU of the core holding `cpu` (online or not, allowed or not), as sysfs lists them."""
    topology = Path(root) / f"cpu{cpu}" / "topology"
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            siblings = parse_cpulist((topology / name).read_text(), str(topology / name))
        except FileNotFoundError:
            continue
        except (OSError, ValueError):       # unreadable or garbled: the CPU counts as a core
            break
        if cpu in siblings:
            return frozenset(siblings)
        break
    return frozenset((cpu,))


def plan(expert_num, nodes=None, allowed_cpus=None):
    """One Placement per node that has CPUs this process may use (`allowed_cpus`, default its
    affinity), in node order, the layer's experts split contiguously and evenly between them."""
    teams = _usable(nodes, allowed_cpus)
    parts = split_experts(expert_num, len(teams), name="NUMA nodes with usable CPUs")
    return [Placement(node, cpus, part) for (node, cpus), part in zip(teams, parts)]


def rank_cpus(local_rank, local_world_size, nodes=None, allowed_cpus=None):
    """(node ids, CPUs) of rank `local_rank` of the `local_world_size` ranks on this machine.
    As many ranks as nodes (the intended layout): one node each.  Fewer ranks: each takes a contiguous
    group of nodes.  More: the ranks on a node split its cores (cores_of; its CPUs where it has fewer
    cores than ranks) into contiguous, even parts."""
    for name, v in (("local_rank", local_rank), ("local_world_size", local_world_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    if not local_rank < local_world_size:
        raise ValueError(f"local_rank={local_rank} must be in range(local_world_size={local_world_size})")
    teams = _usable(nodes, allowed_cpus)
    if local_world_size <= len(teams):
        group = split_experts(len(teams), local_world_size, name="ranks")[local_rank]
        mine = teams[group.start:group.stop]
        return tuple(n for n, _ in mine), tuple(c for _, cpus in mine for c in cpus)
    index = local_rank * len(teams) // local_world_size
    node, cpus = teams[index]
    sharing = [r for r in range(local_world_size) if r * len(teams) // local_world_size == index]
    if len(sharing) > len(cpus):
        raise ValueError(f"{len(sharing)} ranks on NUMA node {node} but it has only {len(cpus)} usable CPUs")
    cores = cores_of(cpus)     # whole cores to each rank where there are enough: no two ranks on one core
    units = cores if len(cores) >= len(sharing) else tuple((cpu,) for cpu in cpus)
    share = split_experts(len(units), len(sharing), name="ranks on the node")[sharing.index(local_rank)]
    return (node,), tuple(sorted(cpu for unit in units[share.start:share.stop] for cpu in unit))


def pin_local_rank(nodes=None):
    """Pins this process to its NUMA node(s) as rank_cpus says for torchrun's LOCAL_RANK /
    LOCAL_WORLD_SIZE; returns (node ids, CPUs), or None (nothing pinned) on a one-node machine or
    outside torchrun.  Call it before building any MoE, so packing first-touches local memory."""
    teams = _usable(nodes, None)
    env = [os.environ.get(v, "").strip() for v in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")]
    if len(teams) < 2 or not all(env):
        return None
    try:
        local_rank, local_world_size = (int(v) for v in env)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={env[0]!r} and LOCAL_WORLD_SIZE={env[1]!r} must be integers") from None
    node_ids, cpus = rank_cpus(local_rank, local_world_size, nodes)
    pin(cpus)
    return node_ids, cpus


def _usable(nodes, allowed_cpus):
    """[(node id, its CPUs this process may use)] for the nodes that have any."""
    nodes = topology() if nodes is None else _check_nodes(nodes)
    allowed = affinity_cpus() if allowed_cpus is None else _cpu_set("allowed_cpus", allowed_cpus)
    teams = [(n.id, tuple(c for c in n.cpus if c in allowed)) for n in nodes]
    teams = [(node, cpus) for node, cpus in teams if cpus]
    if not teams:
        raise ValueError(f"no NUMA node has a CPU this process may use (allowed: {sorted(allowed)})")
    return teams


def _check_nodes(nodes):
    """`nodes` as a list of NumaNode, or TypeError / ValueError naming what is wrong: a node id twice or
    a CPU in two nodes would put two teams (or ranks) on one CPU, each believing it has it alone."""
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Iterable):
        raise TypeError(f"nodes must be a list of ktfp8.numa.NumaNode (e.g. numa.topology()), got "
                        f"{type(nodes).__name__} {nodes!r}")
    nodes = list(nodes)
    ids, owner = set(), {}                         # owner: CPU -> the node holding it
    for i, node in enumerate(nodes):
        if not isinstance(node, NumaNode):
            raise TypeError(f"nodes[{i}] must be a ktfp8.numa.NumaNode(id, cpus), got {type(node).__name__} "
                            f"{node!r}")
        if isinstance(node.id, (bool, np.bool_)) or not isinstance(node.id, numbers.Integral):
            raise TypeError(f"nodes[{i}].id must be an int, got {type(node.id).__name__} {node.id!r}")
        if node.id < 0:
            raise ValueError(f"nodes[{i}].id must be >= 0, got {node.id}")
        if node.id in ids:
            raise ValueError(f"nodes: node id {node.id} appears twice")
        ids.add(node.id)
        for cpu in _cpu_set(f"nodes[{i}].cpus", node.cpus):
            if cpu in owner:
                raise ValueError(f"nodes: CPU {cpu} is in node {owner[cpu]} and in node {node.id}; a CPU "
                                 f"belongs to one node")
            owner[cpu] = node.id
    return nodes


def _cpu_set(name, cpus):
    """`cpus` as a set of CPU numbers (ints in 0 .. MAX_CPU), or TypeError / ValueError naming `name`:
    True is an int to os.sched_setaffinity, but as a CPU it is a mistake, not CPU 1."""
    if isinstance(cpus, (str, bytes)) or not isinstance(cpus, Iterable):
        raise TypeError(f"{name} must be a collection of CPU numbers (ints), got {type(cpus).__name__} {cpus!r}")
    cpus = list(cpus)          # checked before a set is made: a list inside would say only "unhashable"
    for cpu in cpus:
        if isinstance(cpu, (bool, np.bool_)) or not isinstance(cpu, numbers.Integral):
            raise TypeError(f"{name} must hold CPU numbers (ints), got {type(cpu).__name__} {cpu!r}")
        if not 0 <= cpu <= MAX_CPU:
            raise ValueError(f"{name}: CPU {cpu} is not a CPU number (0 .. {MAX_CPU})")
    return {int(cpu) for cpu in cpus}


def pin(cpus):
    """Binds the calling thread (and the threads it starts later, OpenMP teams included) to `cpus`."""
    cpus = _cpu_set("cpus", cpus)
    if not cpus:
        raise ValueError("cpus must name at least one CPU")
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as err:
        raise ValueError(f"cannot pin to CPUs {sorted(cpus)}: {err.strerror}") from None


def team_threads(placements, quota=None):
    """Each team's thread count: one per core of its CPUs (cores_of), or, where the cgroup CPU quota
    (`quota`, default this process's: cpu_quota.py) is smaller than all of them together, the quota's
    CPUs shared in proportion to the teams' cores (largest remainders first), at least one each (past
    the quota only where it has fewer CPUs than there are teams)."""
    cores = [len(cores_of(p.cpus)) for p in placements]
    quota = cpu_quota.quota_cpus() if quota is None else quota
    if quota is None or quota >= sum(cores):
        return cores
    shares = [quota * c / sum(cores) for c in cores]
    threads = [max(1, int(share)) for share in shares]
    while sum(threads) < quota:       # the rest to the teams furthest below their share
        threads[max(range(len(threads)), key=lambda i: shares[i] - threads[i])] += 1
    while sum(threads) > quota and max(threads) > 1:   # what a team's first thread took from the others
        threads[max((i for i in range(len(threads)) if threads[i] > 1), key=lambda i: threads[i] - shares[i])] -= 1
    return threads


class NumaMoE:
    """One MoE layer split over NUMA nodes inside one process: per node a thread pinned to that node's
    CPUs packs the node's contiguous share of the experts (first touch: the pages land on the node)
    and runs it with an OpenMP team of a thread per core (fewer within a cgroup CPU quota: team_threads); a
    call sums the teams' float32 partial outputs.
    On a one-node machine this is one MoE with extra steps: use MoE there."""

    def __init__(self, config, experts, *, nodes=None, allowed_cpus=None, backend=None):
        from .moe import MoE, _check_matches
        # as MoE does, before planning: a wrong expert_num would otherwise surface as a shard's range
        _check_matches(config, experts)
        self._closed = False
        self._lock = threading.Lock()       # close() cannot shut the teams down between a call's check and submits
        self._pid = os.getpid()             # a forked child has the teams' queues but not their threads
        # the experts held (the whole layer, or e.g. an expert-parallel rank's shard) split over the nodes
        own = experts.expert_range
        self.placements = [replace(p, experts=range(own.start + p.experts.start, own.start + p.experts.stop))
                           for p in plan(len(own), nodes, allowed_cpus)]
        self._teams = [ThreadPoolExecutor(1, thread_name_prefix=f"ktfp8-numa{p.node}") for p in self.placements]
        try:
            # Each team's one thread pins itself as its first task (and stays pinned): a pool initializer
            # that failed would surface as BrokenThreadPool, hiding which CPUs could not be pinned.
            for f in [team.submit(pin, p.cpus) for team, p in zip(self._teams, self.placements)]:
                f.result()
            futures = [team.submit(MoE, config, experts.shard(p.experts), backend=backend, threads=n)
                       for team, p, n in zip(self._teams, self.placements, team_threads(self.placements))]
            self.moes = [f.result() for f in futures]
        except BaseException:
            self.close()
            raise
        self.config = self.moes[0].config   # a copy, as MoE keeps

    @property
    def nbytes(self):
        return sum(m.nbytes for m in self.moes)

    def __call__(self, x, topk_ids, topk_weights):
        """Like MoE.__call__ (NumPy x, float32 or bfloat16): the partial outputs are summed in float32.
        In a process forked after this one was built the teams' threads are gone: the nodes' layers then
        run in turn in the calling thread, each on the one thread a forked OpenMP gives (MoE warns)."""
        if not isinstance(x, np.ndarray) or x.dtype.name not in ("float32", "bfloat16"):
            raise TypeError(f"x must be a float32 or bfloat16 numpy array, got {getattr(x, 'dtype', type(x).__name__)}")
        x32 = np.ascontiguousarray(x, np.float32)
        forked = os.getpid() != self._pid       # a submit would wait for ever on a thread that is not there
        with self._lock:
            if self._closed:      # else concurrent.futures' "cannot schedule new futures after shutdown"
                raise RuntimeError("this NumaMoE is closed (close() shut down its node teams); build a new one")
            moes = self.moes      # close() may let go of them while a forked child's call runs
            if not forked:
                futures = [team.submit(moe, x32, topk_ids, topk_weights) for team, moe in zip(self._teams, moes)]
        if forked:
            partials = [moe(x32, topk_ids, topk_weights) for moe in moes]
        else:
            partials = [f.result() for f in futures]
        y = partials[0]
        for p in partials[1:]:
            y += p
        return y if x.dtype == np.float32 else y.astype(x.dtype)

    def close(self):
        """Shuts the node teams down (after the calls already running) and lets go of the nodes' packed
        experts (freed unless held elsewhere, e.g. through .moes); calls after it raise RuntimeError."""
        with self._lock:
            self._closed = True
        for team in self._teams:
            team.shutdown()
        self.moes = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce_ex__(self, protocol):
        # copy, deepcopy and pickle: a copy would share (or lose) the pinned node teams and their closing
        raise TypeError("a NumaMoE holds threads pinned to its nodes and cannot be copied or pickled; build "
                        "another from the experts (or copy the per-node layers in .moes)")


def report(root=NODE_ROOT):
    """The NUMA layout for `python -m ktfp8.cpu`: nodes with CPUs and memory, and the CPUs this
    process may use on each."""
    allowed = affinity_cpus()
    return [{"node": n.id, "cpus": format_cpulist(n.cpus), "usable_cpus": format_cpulist(
        [c for c in n.cpus if c in allowed]), "memory_bytes": n.memory_bytes} for n in topology(root)]


def format_report(nodes):
    """Text lines of report(): one per node, and what ktfp8 does with that many.  The node's memory
    is in the JSON report only: a VM with hot-plugged memory changes it from one run to the next."""
    lines = [f"NUMA nodes: {len(nodes)}"]
    for n in nodes:
        usable = "" if n["usable_cpus"] == n["cpus"] else f" (usable here: {n['usable_cpus'] or 'none'})"
        lines.append(f"  node {n['node']}: CPUs {n['cpus'] or 'none'}{usable}")
    if sum(1 for n in nodes if n["usable_cpus"]) > 1:
        lines.append("  experts split per node: torchrun --nproc-per-node <nodes> (one rank pinned per node) "
                     "or ktfp8.numa.NumaMoE (one thread team per node)")
    return "\n".join(lines)


def format_cpulist(cpus):
    """(0, 1, 2, 3, 8) -> '0-3,8' (the kernel's own notation)."""
    cpus, runs = sorted(cpus), []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
