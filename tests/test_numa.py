"""NUMA topology, placement and pinning on faked machines (this one has a single node): sysfs trees
written under tmp_path, and a fake 2-node split of this machine's own CPUs to run real pinned teams."""
import gc
import io
import json
import os
import threading
import weakref

import numpy as np
import pytest

import ktfp8
from ktfp8 import cpu, numa
from ktfp8.moe import MoE
from moe_oracle import make_experts, random_routing

GiB = 2 ** 30


def fake_sysfs(root, cpulists, mem_kb=None):
    """A /sys/devices/system/node lookalike: node{i}/cpulist and meminfo, plus the files around them."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "online").write_text(f"0-{len(cpulists) - 1}\n")
    (root / "has_cpu").write_text("0\n")
    for i, cpus in enumerate(cpulists):
        node = root / f"node{i}"
        node.mkdir()
        (node / "cpulist").write_text(cpus + "\n")
        kb = (mem_kb or [64 * 2 ** 20] * len(cpulists))[i]
        (node / "meminfo").write_text(f"Node {i} MemTotal:       {kb} kB\nNode {i} MemFree:        1 kB\n")
    return root


def test_two_socket_topology_and_plan(tmp_path):
    root = fake_sysfs(tmp_path / "node", ["0-15,32-47", "16-31,48-63"])
    nodes = numa.topology(root)
    assert [n.id for n in nodes] == [0, 1]
    assert nodes[0].cpus == tuple(range(16)) + tuple(range(32, 48))
    assert nodes[1].memory_bytes == 64 * GiB
    placements = numa.plan(64, nodes, allowed_cpus=range(64))
    assert [(p.node, p.experts) for p in placements] == [(0, range(0, 32)), (1, range(32, 64))]
    assert placements[1].cpus == nodes[1].cpus
    # a process confined to node 1's CPUs (taskset / cgroup) plans one team there, all experts
    assert [(p.node, p.experts) for p in numa.plan(64, nodes, allowed_cpus=range(16, 32))] == [(1, range(64))]


def test_four_nodes_uneven_experts_and_a_memory_only_node(tmp_path):
    root = fake_sysfs(tmp_path / "node", ["0-3", "4-7", "", "8-11", "12-15"],
                      mem_kb=[2 ** 20, 2 ** 20, 4 * 2 ** 20, 2 ** 20, 2 ** 20])
    nodes = numa.topology(root)
    assert nodes[2].cpus == () and nodes[2].memory_bytes == 4 * GiB      # e.g. CXL memory: no team
    placements = numa.plan(10, nodes, allowed_cpus=range(16))
    assert [p.node for p in placements] == [0, 1, 3, 4]
    assert [len(p.experts) for p in placements] == [3, 3, 2, 2]
    assert [e for p in placements for e in p.experts] == list(range(10))
    with pytest.raises(ValueError, match="without experts"):
        numa.plan(3, nodes, allowed_cpus=range(16))
    with pytest.raises(ValueError, match="no NUMA node has a CPU this process may use"):
        numa.plan(8, nodes, allowed_cpus=[99])


def test_rank_cpus(tmp_path):
    nodes = numa.topology(fake_sysfs(tmp_path / "node", ["0-7", "8-15"]))
    every = range(16)
    assert numa.rank_cpus(0, 2, nodes, every) == ((0,), tuple(range(8)))
    assert numa.rank_cpus(1, 2, nodes, every) == ((1,), tuple(range(8, 16)))
    assert numa.rank_cpus(0, 1, nodes, every) == ((0, 1), tuple(range(16)))     # one rank: the machine
    assert [numa.rank_cpus(r, 4, nodes, every) for r in range(4)] == [
        ((0,), (0, 1, 2, 3)), ((0,), (4, 5, 6, 7)), ((1,), (8, 9, 10, 11)), ((1,), (12, 13, 14, 15))]
    with pytest.raises(ValueError, match=r"local_rank=2 must be in range\(local_world_size=2\)"):
        numa.rank_cpus(2, 2, nodes, every)
    with pytest.raises(ValueError, match="18 ranks on NUMA node 0 but it has only 8"):
        numa.rank_cpus(0, 36, nodes, every)


def test_missing_sysfs_is_one_node_of_the_allowed_cpus(tmp_path):
    nodes = numa.topology(tmp_path / "absent")
    assert len(nodes) == 1 and set(nodes[0].cpus) == os.sched_getaffinity(0) and nodes[0].memory_bytes is None


@pytest.mark.parametrize("text, cpus", [("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)), ("5", (5,)), ("", ()),
                                        ("2,0-1\n", (0, 1, 2))])
def test_cpulist_round_trip(text, cpus):
    assert numa.parse_cpulist(text) == cpus
    assert numa.parse_cpulist(numa.format_cpulist(cpus)) == cpus


@pytest.mark.parametrize("bad", ["0-", "a", "3-1", "1,,x"])
def test_bad_cpulist(bad):
    with pytest.raises(ValueError, match="cannot read CPU list"):
        numa.parse_cpulist(bad, "node0/cpulist")


def test_cpulist_numbers_are_bounded_before_a_range_is_expanded():
    """'0-4294967295' (a corrupt or hostile cpulist) was expanded into 2**32 ints: memory ran out first."""
    assert numa.parse_cpulist(f"0,{numa.MAX_CPU}") == (0, numa.MAX_CPU)
    with pytest.raises(ValueError, match=r"node0/cpulist: CPU list '0,1048576' names CPU 1048576, above "
                                         r"ktfp8.numa.MAX_CPU = 1048575"):
        numa.parse_cpulist("0,1048576", "node0/cpulist")     # first: the old code returns at once here
    with pytest.raises(ValueError, match="names CPU 4294967295"):
        numa.parse_cpulist("0-4294967295", "node0/cpulist")
    with pytest.raises(TypeError, match="a CPU list is a str such as '0-3,8', got NoneType"):
        numa.parse_cpulist(None)


@pytest.mark.parametrize("nodes, error, message", [
    ([(0, (0,))], TypeError, r"nodes\[0\] must be a ktfp8.numa.NumaNode\(id, cpus\), got tuple \(0, \(0,\)\)"),
    ("0-1", TypeError, "nodes must be a list of ktfp8.numa.NumaNode .*, got str '0-1'"),
    (7, TypeError, "nodes must be a list of ktfp8.numa.NumaNode .*, got int 7"),
    ([numa.NumaNode(True, (0,))], TypeError, r"nodes\[0\].id must be an int, got bool True"),
    ([numa.NumaNode(-1, (0,))], ValueError, r"nodes\[0\].id must be >= 0, got -1"),
    ([numa.NumaNode(0, None)], TypeError, r"nodes\[0\].cpus must be a collection of CPU numbers"),
    ([numa.NumaNode(0, (0, 1.5))], TypeError, r"nodes\[0\].cpus must hold CPU numbers \(ints\), got float 1.5"),
    ([numa.NumaNode(0, (0,)), numa.NumaNode(0, (1,))], ValueError, "nodes: node id 0 appears twice"),
    ([numa.NumaNode(0, (0, 1)), numa.NumaNode(1, (1, 2))], ValueError,
     "nodes: CPU 1 is in node 0 and in node 1; a CPU belongs to one node"),
])
def test_plan_refuses_nodes_that_are_not_numa_nodes_or_overlap(nodes, error, message):
    """The first three were AttributeErrors ('tuple' object has no attribute 'id'); a node id twice or a
    CPU in two nodes planned two teams on one CPU."""
    with pytest.raises(error, match=message):
        numa.plan(4, nodes, allowed_cpus=range(4))
    with pytest.raises(error, match=message):
        numa.rank_cpus(0, 1, nodes, allowed_cpus=range(4))


def _in_thread(fn):
    """Runs fn in a fresh thread: pinning there leaves this test process's affinity alone."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except Exception as err:     # handed back to the test thread
            result["error"] = err
    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_pin(monkeypatch, tmp_path):
    cpu = min(os.sched_getaffinity(0))
    assert _in_thread(lambda: (numa.pin([cpu]), os.sched_getaffinity(0))[1]) == {cpu}
    with pytest.raises(ValueError, match="at least one CPU"):
        numa.pin([])
    with pytest.raises(ValueError, match=r"cannot pin to CPUs \[100000\]"):
        numa.pin([100000])
    # each in a thread of its own: the old code pinned the thread to CPU 1 for [True]
    for cpus, error, message in [([True], TypeError, r"cpus must hold CPU numbers \(ints\), got bool True"),
                                 ([1.5], TypeError, "got float 1.5"), (None, TypeError, "got NoneType None"),
                                 ("0", TypeError, r"cpus must be a collection of CPU numbers \(ints\), got str '0'"),
                                 ([2 ** 70], ValueError, rf"CPU {2 ** 70} is not a CPU number \(0 .. {numa.MAX_CPU}\)"),
                                 ([-1], ValueError, "CPU -1 is not a CPU number")]:
        with pytest.raises(error, match=message):
            _in_thread(lambda: numa.pin(cpus))
    with pytest.raises(TypeError, match=r"allowed_cpus must be a collection of CPU numbers \(ints\), got int 5"):
        numa.plan(4, [numa.NumaNode(0, (0,))], allowed_cpus=5)
    # torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE on a faked 2-node machine made of this one's CPUs
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to fake two nodes")
    nodes = [numa.NumaNode(0, tuple(allowed[:1])), numa.NumaNode(1, tuple(allowed[1:]))]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    got = _in_thread(lambda: (numa.pin_local_rank(nodes), os.sched_getaffinity(0)))
    assert got == (((1,), tuple(allowed[1:])), set(allowed[1:]))
    assert _in_thread(lambda: numa.pin_local_rank(nodes[:1])) is None         # one node: nothing to do
    monkeypatch.delenv("LOCAL_RANK")
    assert _in_thread(lambda: numa.pin_local_rank(nodes)) is None             # not under torchrun


def _two_node_layer():
    """This machine's CPUs as two fake NUMA nodes (the first CPU, the rest), a 9-expert layer's config
    and experts, and the CPUs allowed."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to fake two nodes")
    nodes = [numa.NumaNode(0, tuple(allowed[:1])), numa.NumaNode(1, tuple(allowed[1:]))]
    E, H, I, K = 9, 128, 48, 3
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=2)
    return nodes, cfg, experts, allowed


def _assert_sums_to(layer, one_team):
    """layer's output of 11 tokens equals one_team's (a MoE over the same experts), up to the order of
    the float32 sums of the partial outputs; returns the inputs (x, ids, w)."""
    cfg = layer.config
    x = np.random.default_rng(0).standard_normal((11, cfg.hidden_size)).astype(np.float32)
    ids, w = random_routing(11, cfg.expert_num, cfg.num_experts_per_tok, seed=1, skip_fraction=0.1)
    want = one_team(x, ids, w)
    np.testing.assert_allclose(layer(x, ids, w), want, rtol=0,
                               atol=8 * np.finfo(np.float32).eps * np.abs(want).max())
    return x, ids, w


def test_numa_moe_teams_are_pinned_and_sum_to_the_layer():
    nodes, cfg, experts, allowed = _two_node_layer()
    layer = numa.NumaMoE(cfg, experts, nodes=nodes)
    try:
        assert [p.experts for p in layer.placements] == [range(0, 5), range(5, 9)]
        for team, p in zip(layer._teams, layer.placements):
            assert team.submit(os.sched_getaffinity, 0).result() == set(p.cpus)
        assert [m.threads for m in layer.moes] == [1, len(allowed) - 1]
        whole = MoE(cfg, experts, threads=1)
        assert layer.nbytes == pytest.approx(whole.nbytes, rel=0.01)
        x, ids, w = _assert_sums_to(layer, whole)
        with pytest.raises(TypeError, match="float32 or bfloat16 numpy array"):
            layer(x.astype(np.float64), ids, w)
    finally:
        layer.close()


@pytest.mark.parametrize("cpus, quota, want", [
    ((32, 32), None, [32, 32]),          # no quota (none set on this process either): every CPU
    ((32, 32), 64, [32, 32]),
    ((32, 32), 8, [4, 4]),               # a Kubernetes limit of 8 on a two-socket machine
    ((32, 32), 5, [3, 2]),               # the quota's last CPU to the first largest remainder
    ((48, 16), 8, [6, 2]),               # in proportion to the teams' CPUs
    ((4, 4, 4), 2, [1, 1, 1]),           # at least one thread a team, even past the quota
    ((1, 18), 2, [1, 1]),                # the small team's first thread comes out of the large one's share
    ((2, 30, 32), 8, [1, 3, 4]),         # (it was [1, 4, 4]: one past a quota that fits every team)
])
def test_team_threads_stay_within_the_cpu_quota(monkeypatch, cpus, quota, want):
    monkeypatch.setattr(numa.cpu_quota, "quota_cpus", lambda: None)
    placements = [numa.Placement(i, tuple(range(n)), range(0)) for i, n in enumerate(cpus)]
    assert numa.team_threads(placements, quota) == want


def test_numa_moe_teams_take_the_cpu_quota(monkeypatch):
    nodes, cfg, experts, allowed = _two_node_layer()
    monkeypatch.setattr(numa.cpu_quota, "quota_cpus", lambda: 1)
    layer = numa.NumaMoE(cfg, experts, nodes=[numa.NumaNode(0, tuple(allowed))])
    try:
        assert [m.threads for m in layer.moes] == [1]
    finally:
        layer.close()


def test_numa_moe_over_a_shard_splits_the_shard():
    """An expert-parallel rank's shard over its nodes: the shard's experts split between them (it was
    refused: the plan split the whole layer, whose ranges lay outside the shard)."""
    nodes, cfg, experts, _ = _two_node_layer()
    shard = experts.shard(range(4, 9))
    layer = numa.NumaMoE(cfg, shard, nodes=nodes)
    try:
        assert [p.experts for p in layer.placements] == [range(4, 7), range(7, 9)]
        _assert_sums_to(layer, MoE(cfg, shard, threads=1))     # the shard's share: ids outside it skipped
    finally:
        layer.close()


def test_numa_moe_refuses_bad_arguments_by_name():
    E, H, I, K = 4, 64, 32, 2
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=2)
    with pytest.raises(TypeError, match="experts must be ktfp8.ExpertWeights, got tuple"):
        numa.NumaMoE(cfg, (1, 2, 3))
    with pytest.raises(TypeError, match="config must be a ktfp8.MoeConfig, got dict"):
        numa.NumaMoE({"expert_num": E}, experts)
    # as MoE says it (the old message: "experts=range(3, 5) is outside the layer's experts range(0, 4)")
    more = ktfp8.MoeConfig(expert_num=E + 1, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    with pytest.raises(ValueError, match=r"experts hold \(expert_num, hidden_size, intermediate_size\) = "
                                         r"\(4, 64, 32\), config says \(5, 64, 32\)"):
        numa.NumaMoE(more, experts, nodes=[numa.NumaNode(0, (0,)), numa.NumaNode(1, (1,))], allowed_cpus={0, 1})
    allowed = sorted(os.sched_getaffinity(0))
    absent = max(allowed) + 4000   # no such CPU: pinning to it fails
    nodes = [numa.NumaNode(0, tuple(allowed[:1])), numa.NumaNode(1, (absent,))]
    with pytest.raises(ValueError, match=f"cannot pin to CPUs \\[{absent}\\]"):
        numa.NumaMoE(cfg, experts, nodes=nodes, allowed_cpus=set(allowed[:1]) | {absent})


def test_a_closed_numa_moe_says_so():
    """It said concurrent.futures' "cannot schedule new futures after shutdown"."""
    E, H, I, K = 4, 64, 32, 2
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=2)
    layer = numa.NumaMoE(cfg, experts, nodes=[numa.NumaNode(0, (min(os.sched_getaffinity(0)),))])
    x = np.ones((1, H), np.float32)
    ids, w = np.zeros((1, K), np.int64), np.full((1, K), 0.5, np.float32)
    assert layer(x, ids, w).shape == (1, H)
    packed = weakref.ref(layer.moes[0])
    layer.close()
    layer.close()                                   # twice: nothing more to do
    gc.collect()
    assert packed() is None and layer.nbytes == 0  # the packed experts are let go (they stayed till del)
    with pytest.raises(RuntimeError, match=r"this NumaMoE is closed \(close\(\) shut down its node teams\)"):
        layer(x, ids, w)


def test_close_racing_calls_says_closed_and_with_closes():
    """Calls from other threads while close() runs: each either ran or said the layer is closed (some
    got concurrent.futures' "cannot schedule new futures after shutdown" between the check and the
    submits).  `with` closes the layer on leaving."""
    nodes, cfg, experts, _ = _two_node_layer()
    x = np.ones((2, cfg.hidden_size), np.float32)
    ids, w = random_routing(2, cfg.expert_num, cfg.num_experts_per_tok, seed=3)
    errors = []

    def call_until_closed(layer):
        while True:
            try:
                layer(x, ids, w)
            except RuntimeError as e:
                errors.append(str(e))
                return

    for _ in range(20):
        with numa.NumaMoE(cfg, experts, nodes=nodes) as layer:
            callers = [threading.Thread(target=call_until_closed, args=(layer,)) for _ in range(3)]
            for t in callers:
                t.start()
        for t in callers:
            t.join(timeout=60)
        assert layer._closed and not any(t.is_alive() for t in callers)
    assert len(errors) == 60 and all(e.startswith("this NumaMoE is closed") for e in errors), set(errors)


def test_copy_and_pickle_are_refused_by_name():
    """A copy shared the pinned teams (closing it broke the original) or failed on a SimpleQueue."""
    import copy
    import pickle
    nodes, cfg, experts, _ = _two_node_layer()
    with numa.NumaMoE(cfg, experts, nodes=nodes) as layer:
        for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="a NumaMoE holds threads pinned to its nodes and cannot be copied"):
                attempt(layer)


def _call_in_forked_child(layer, x, ids, w):
    """layer(x, ids, w) in a child forked after the layer was built and called, and its result (None if
    the child failed or is still running after 120 s)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=lambda: results.put(layer(x, ids, w)))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        return None
    return results.get(timeout=10) if child.exitcode == 0 else None


def test_a_forked_child_runs_the_layer():
    """The child has the teams' executors but not their threads: a submit waited for ever.  The nodes'
    layers now run in the calling thread there (on one OpenMP thread each, as a forked MoE does)."""
    nodes, cfg, experts, _ = _two_node_layer()
    with numa.NumaMoE(cfg, experts, nodes=nodes) as layer:
        x = np.random.default_rng(5).standard_normal((7, cfg.hidden_size)).astype(np.float32)
        ids, w = random_routing(7, cfg.expert_num, cfg.num_experts_per_tok, seed=6)
        want = layer(x, ids, w)
        got = _call_in_forked_child(layer, x, ids, w)
    assert got is not None, "the forked child did not return the layer's output"
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * np.finfo(np.float32).eps * np.abs(want).max())


def test_cpu_report_shows_the_numa_layout():
    report = cpu.report()
    out = io.StringIO()
    cpu.print_report(report, out=out)
    text = out.getvalue()
    nodes = numa.topology()
    assert f"NUMA nodes: {len(nodes)}" in text
    assert f"node 0: CPUs {numa.format_cpulist(nodes[0].cpus)}" in text
    text = numa.format_report([{"node": 0, "cpus": "0-7", "usable_cpus": "0-7", "memory_bytes": 8 * GiB},
                               {"node": 1, "cpus": "8-15", "usable_cpus": "", "memory_bytes": None}])
    assert text.splitlines()[1:] == ["  node 0: CPUs 0-7", "  node 1: CPUs 8-15 (usable here: none)"]
    assert "one rank pinned per node" not in text            # one node usable: nothing to split
    reported = json.loads(json.dumps(report))["numa_nodes"]          # what --json prints
    assert [(n["node"], n["cpus"]) for n in reported] == [(n.id, numa.format_cpulist(n.cpus)) for n in nodes]
    assert all(n["memory_bytes"] is None or n["memory_bytes"] > 0 for n in reported)
