"""The default thread count stays within the process's cgroup CPU quota (ktfp8/cpu_quota.py).

Fake /proc and /sys trees give every layout of cgroup v1 and v2 a container or a systemd service
meets; one test puts a real process into a real cgroup with a quota of one CPU where this machine
lets the tests make one (root, a writable cpu controller), and asks the process's own MoE."""
import json
import os
import subprocess
import sys
import uuid

import pytest

from ktfp8 import cpu_quota

V2_ROOT_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_CPU_MOUNT = "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
OTHER_MOUNTS = ("22 1 8:1 / / rw,relatime - ext4 /dev/vda1 rw\n"
                "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")


def fake_tree(tmp_path, cgroup, mountinfo, files):
    """/proc/self/{cgroup,mountinfo} and the cgroup files (path -> content) under tmp_path."""
    for path, content in {"proc/self/cgroup": cgroup, "proc/self/mountinfo": mountinfo, **files}.items():
        f = tmp_path / path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(content)
    return str(tmp_path)


def test_v2_container_sees_its_own_cgroup_as_the_root(tmp_path):
    root = fake_tree(tmp_path, "0::/\n", OTHER_MOUNTS + V2_ROOT_MOUNT, {"sys/fs/cgroup/cpu.max": "150000 100000\n"})
    assert cpu_quota.cpu_quota(root) == 1.5
    assert cpu_quota.quota_cpus(root) == 2  # rounded up


def test_v2_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    leaf = "sys/fs/cgroup/work.slice/serve.service"
    files = {"sys/fs/cgroup/work.slice/cpu.max": "400000 100000\n", f"{leaf}/cpu.max": "max 100000\n"}
    root = fake_tree(tmp_path, "0::/work.slice/serve.service\n", V2_ROOT_MOUNT, files)
    assert cpu_quota.quota_cpus(root) == 4  # the parent's limit binds its child
    (tmp_path / leaf / "cpu.max").write_text("50000 100000\n")
    assert cpu_quota.cpu_quota(root) == 0.5 and cpu_quota.quota_cpus(root) == 1


def test_v1_cpu_controller_and_a_container_mounted_at_its_cgroup(tmp_path):
    """Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names /docker/<id>, and that
    cgroup is what is mounted (mountinfo's root field)."""
    cgroup = "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    files = {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
             "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    root = fake_tree(tmp_path, cgroup, OTHER_MOUNTS + V1_CPU_MOUNT.format(root="/docker/abc"), files)
    assert cpu_quota.quota_cpus(root) == 3


def test_v1_host_process_in_a_child_cgroup(tmp_path):
    files = {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
             "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
             "sys/fs/cgroup/cpu,cpuacct/batch/cpu.cfs_quota_us": "250000\n",
             "sys/fs/cgroup/cpu,cpuacct/batch/cpu.cfs_period_us": "50000\n"}
    root = fake_tree(tmp_path, "4:cpu,cpuacct:/batch\n", V1_CPU_MOUNT.format(root="/"), files)
    assert cpu_quota.cpu_quota(root) == 5.0


@pytest.mark.parametrize("cgroup, files", [
    ("0::/\n", {"sys/fs/cgroup/cpu.max": "max 100000\n"}),              # v2, no limit
    ("0::/\n", {}),                                                       # v2, cpu controller not enabled
    ("4:cpu,cpuacct:/\n", {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                           "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"}),  # v1, no limit
    ("0::/\n", {"sys/fs/cgroup/cpu.max": "lots\n"}),                     # unreadable: no quota
    ("5:memory:/x\n", {}),                                                # no cpu controller at all
])
def test_no_quota(tmp_path, cgroup, files):
    root = fake_tree(tmp_path, cgroup, OTHER_MOUNTS + V2_ROOT_MOUNT + V1_CPU_MOUNT.format(root="/"), files)
    assert cpu_quota.cpu_quota(root) is None and cpu_quota.quota_cpus(root) is None


def test_no_proc_files_means_no_quota(tmp_path):
    assert cpu_quota.cpu_quota(str(tmp_path)) is None


def test_escaped_mount_point(tmp_path):
    mount = "40 31 0:40 / /mnt/cg\\040two rw - cgroup2 cgroup2 rw\n"
    root = fake_tree(tmp_path, "0::/\n", mount, {"mnt/cg two/cpu.max": "200000 100000\n"})
    assert cpu_quota.quota_cpus(root) == 2


def test_escaped_mount_root(tmp_path):
    """mountinfo escapes the root field as it does the mount point; /proc/self/cgroup does not."""
    mount = "41 31 0:41 /my\\040group /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    root = fake_tree(tmp_path, "0::/my group/job\n", mount, {"sys/fs/cgroup/job/cpu.max": "200000 100000\n"})
    assert cpu_quota.quota_cpus(root) == 2


@pytest.mark.parametrize("mount_root, path", [
    ("/other.slice/job", "/user.slice/me.service"),    # a second mount of another subtree
    ("/docker/abc", "/docker/abcdef"),                 # a sibling whose name starts alike
])
def test_a_mount_of_cgroups_the_process_is_not_in_is_not_read(tmp_path, mount_root, path):
    mounts = V2_ROOT_MOUNT + f"42 31 0:26 {mount_root} /mnt/other rw - cgroup2 cgroup2 rw\n"
    files = {"mnt/other/cpu.max": "100000 100000\n", f"sys/fs/cgroup{path}/cpu.max": "max 100000\n"}
    root = fake_tree(tmp_path, f"0::{path}\n", mounts, files)
    assert cpu_quota.cpu_quota(root) is None


def _quota_cgroup_dir():
    """A new cgroup with a quota of one CPU, for a real process, or None where this machine does not
    let the tests make one."""
    name = f"ktfp8-test-{uuid.uuid4().hex[:8]}"
    for parent, files in (("/sys/fs/cgroup/cpu", {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}),
                          ("/sys/fs/cgroup", {"cpu.max": "100000 100000"})):
        path = os.path.join(parent, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            for f, value in files.items():
                with open(os.path.join(path, f), "w") as out:
                    out.write(value)
            return path
        except OSError:
            os.rmdir(path)
    return None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to see a quota of 1")
def test_a_process_in_a_one_cpu_quota_defaults_to_one_thread():
    cgroup = _quota_cgroup_dir()
    if cgroup is None:
        pytest.skip("cannot make a cgroup with a CPU quota here (not root, or no writable cpu controller)")
    probe = f"""
import json, os, sys
try:
    with open({os.path.join(cgroup, 'cgroup.procs')!r}, "w") as f:
        f.write(str(os.getpid()))
except OSError as e:
    print(json.dumps({{"skip": str(e)}}))
    sys.exit(0)
import numpy as np, ktfp8
from ktfp8 import backends
cfg = ktfp8.MoeConfig(expert_num=2, num_experts_per_tok=1, hidden_size=64, intermediate_size=32)
rng = np.random.default_rng(0)
experts = ktfp8.quantize_experts(*(rng.standard_normal(s, dtype=np.float32) for s in ((2, 32, 64), (2, 32, 64), (2, 64, 32))),
                                 cfg.quant_config)
print(json.dumps({{"cores": backends.usable_cores(), "moe": ktfp8.MoE(cfg, experts).threads,
                  "affinity": len(os.sched_getaffinity(0))}}))
"""
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("KTFP8_NUM_THREADS", "OMP_NUM_THREADS")}
        proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    finally:
        os.rmdir(cgroup)  # empty again: the process has ended
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    if "skip" in got:
        pytest.skip(f"cannot move a process into the new cgroup: {got['skip']}")
    assert got == {"cores": 1, "moe": 1, "affinity": len(os.sched_getaffinity(0))}


def test_this_process_reads_its_quota_at_most_once_a_second(monkeypatch):
    reads, clock = [], [1000.0]
    monkeypatch.setattr(cpu_quota, "cpu_quota", lambda root="/": reads.append(root) or 2.5)
    monkeypatch.setattr(cpu_quota, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(cpu_quota, "_remembered", (float("-inf"), None))
    assert cpu_quota.quota_cpus() == 3 and cpu_quota.quota_cpus() == 3 and len(reads) == 1
    clock[0] += 1.5
    assert cpu_quota.quota_cpus() == 3 and len(reads) == 2
    assert cpu_quota.quota_cpus("/elsewhere") == 3 and len(reads) == 3  # another tree: never remembered


def test_within_quota_caps_a_count_at_the_quota_and_leaves_it_without_one(monkeypatch):
    monkeypatch.setattr(cpu_quota, "quota_cpus", lambda: 3)
    assert [cpu_quota.within_quota(n) for n in (1, 3, 8)] == [1, 3, 3]
    monkeypatch.setattr(cpu_quota, "quota_cpus", lambda: None)
    assert cpu_quota.within_quota(8) == 8
