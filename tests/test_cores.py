"""One thread per core, not per CPU: numa.cores_of on faked SMT machines (sysfs cpuN/topology trees
written under tmp_path), the default thread count, torchrun's ranks and NumaMoE's teams on them, and
cores_of on this machine against its core ids read independently."""
import io
import os
from pathlib import Path

import pytest

import ktfp8
from ktfp8 import backends, cpu, numa
from moe_oracle import make_experts

SMT_CORES = [(c, c + 8) for c in range(8)]   # 8 cores whose second threads are CPUs 8-15, as Linux numbers them


def fake_cpu_sysfs(root, cores, file="core_cpus_list"):
    """A /sys/devices/system/cpu lookalike: cpuN/topology/<file> listing the CPUs of N's core."""
    for core in cores:
        for n in core:
            topology = root / f"cpu{n}" / "topology"
            topology.mkdir(parents=True)
            (topology / file).write_text(",".join(map(str, core)) + "\n")
    return root


@pytest.fixture
def smt_machine(tmp_path, monkeypatch):
    """This process sees 16 CPUs on 8 two-thread cores, with no thread variables and no CPU quota."""
    monkeypatch.setattr(numa, "CPU_ROOT", str(fake_cpu_sysfs(tmp_path / "cpu", SMT_CORES)))
    monkeypatch.setattr(numa, "affinity_cpus", lambda: set(range(16)))
    monkeypatch.setattr(numa.cpu_quota, "quota_cpus", lambda: None)
    monkeypatch.setattr(numa.cpu_quota, "cpu_quota", lambda: None)
    for var in (backends.ENV_THREADS, backends.ENV_OMP_THREADS):
        monkeypatch.delenv(var, raising=False)


def test_cores_of_an_smt_machine(tmp_path):
    root = fake_cpu_sysfs(tmp_path / "cpu", SMT_CORES)
    assert numa.cores_of(range(16), root) == tuple(SMT_CORES)
    assert numa.cores_of({0, 8}, root) == ((0, 8),)                   # a cpuset of one core's two threads
    assert numa.cores_of([9, 1, 2], root) == ((1, 9), (2,))           # in CPU order, allowed CPUs only
    assert numa.cores_of([], root) == ()


def test_older_kernels_and_unreadable_topology(tmp_path):
    legacy = fake_cpu_sysfs(tmp_path / "legacy", SMT_CORES, file="thread_siblings_list")   # before Linux 5.7
    assert numa.cores_of(range(16), legacy) == tuple(SMT_CORES)
    garbled = fake_cpu_sysfs(tmp_path / "garbled", [(0, 1), (2, 3)])
    (garbled / "cpu2" / "topology" / "core_cpus_list").write_text("two,three\n")
    (garbled / "cpu3" / "topology" / "core_cpus_list").write_text("0\n")   # a list without cpu3 itself
    # each of these CPUs counts as a core of its own: as many threads as CPUs, as before cores were counted
    assert numa.cores_of(range(4), garbled) == ((0, 1), (2,), (3,))
    assert numa.cores_of(range(4), tmp_path / "none") == ((0,), (1,), (2,), (3,))
    with pytest.raises(TypeError, match="cpus must hold CPU numbers"):
        numa.cores_of(["0"], garbled)


def test_this_machines_cores_match_its_core_ids():
    """The oracle: each CPU's (physical_package_id, core_id), which lscpu counts cores by."""
    topologies = [Path(numa.CPU_ROOT) / f"cpu{c}" / "topology" for c in sorted(os.sched_getaffinity(0))]
    if not all((t / "core_id").is_file() and (t / "physical_package_id").is_file() for t in topologies):
        pytest.skip("this kernel does not show core_id / physical_package_id")
    ids = {((t / "physical_package_id").read_text(), (t / "core_id").read_text()) for t in topologies}
    assert len(numa.cores_of(os.sched_getaffinity(0))) == len(ids) == backends.affinity_cores()


def test_the_default_is_one_thread_per_core(smt_machine):
    assert backends.affinity_cores() == backends.usable_cores() == backends.default_threads() == 8
    cfg = ktfp8.MoeConfig(expert_num=2, num_experts_per_tok=1, hidden_size=64, intermediate_size=32)
    experts, _ = make_experts("fp8_per_channel", 2, 64, 32, seed=1)
    assert ktfp8.MoE(cfg, experts).threads == 8
    assert ktfp8.MoE(cfg, experts, threads=16).threads == 16       # any count still, when asked for
    out = io.StringIO()
    cpu.print_report(cpu.report(), out=out)
    assert ("$OMP_NUM_THREADS: 8 (one per core: 8 cores hold the 16 CPUs in this process's affinity mask; "
            "no cgroup CPU quota)") in out.getvalue()


def test_ranks_on_one_node_get_whole_cores(smt_machine):
    """Two torchrun ranks on a one-node SMT machine: split by CPU number, each rank took one thread of
    every core (CPUs 0-7 and 8-15), and the two ranks' teams ran on the same 8 cores."""
    nodes = [numa.NumaNode(0, tuple(range(16)))]
    assert [numa.rank_cpus(r, 2, nodes) for r in range(2)] == [
        ((0,), (0, 1, 2, 3, 8, 9, 10, 11)), ((0,), (4, 5, 6, 7, 12, 13, 14, 15))]
    # more ranks than cores: then CPUs, as before (each rank still gets one)
    assert [numa.rank_cpus(r, 16, nodes)[1] for r in range(16)] == [(c,) for c in range(16)]


def test_numa_teams_take_one_thread_per_core(smt_machine):
    nodes = [numa.NumaNode(0, (0, 1, 2, 3, 8, 9, 10, 11)), numa.NumaNode(1, (4, 5, 6, 7, 12, 13, 14, 15))]
    assert numa.team_threads(numa.plan(8, nodes)) == [4, 4]
    assert numa.team_threads(numa.plan(8, nodes), quota=4) == [2, 2]
    assert numa.team_threads(numa.plan(8, nodes, allowed_cpus={0, 8, 4})) == [1, 1]


def test_the_bench_times_the_default_beside_one_thread_per_cpu(smt_machine, monkeypatch):
    from ktfp8.bench.__main__ import default_thread_counts
    assert default_thread_counts(quick=False) == [1, 8, 16]
    assert default_thread_counts(quick=True) == [1, 8]                  # --quick keeps to its ~5 minutes
    monkeypatch.setattr(numa.cpu_quota, "quota_cpus", lambda: 4)      # a quota below the cores: one count
    assert default_thread_counts(quick=False) == [1, 4]
    monkeypatch.setattr(numa, "affinity_cpus", lambda: {0, 1})          # no SMT in the mask
    monkeypatch.setattr(numa.cpu_quota, "quota_cpus", lambda: None)
    assert default_thread_counts(quick=False) == [1, 2]
