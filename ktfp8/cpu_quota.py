"""The CPU time a Linux cgroup lets this process use, in CPUs: a container's `--cpus`, a Kubernetes
CPU limit, systemd's CPUQuota=.

Why the default thread count needs it: a quota does not shrink the affinity mask, so a process limited
to 8 CPUs' time on a 64-core machine still sees 64 cores.  A team of 64 threads then spends the
period's quota in an eighth of the period and is throttled, every thread stopped, for the rest: a
call that meets the throttle waits for the next period (100 ms by default).  Measured on the Zen 4 VM
(2 cores; cgroup v1 quota of one CPU, cpu.cfs_quota_us = cfs_period_us = 100000; benchmark layer,
T = 1, calls back to back in 1.5 s bursts, 1 and 2 threads alternated, three bursts each counted):
2 threads a median call of 0.69 ms but a mean of 1.42 and a 99th percentile of 49 ms, 706 calls/s;
1 thread 1.17, 1.18 and 1.38 ms, 844 calls/s.

The quota is the smallest of the cgroup's and its ancestors' (a parent's limit binds its children),
read from cgroup v2's cpu.max ("max 100000" or "quota period") or v1's cpu.cfs_quota_us (-1: none)
and cpu.cfs_period_us, in the hierarchy that /proc/self/mountinfo says is mounted for the cpu
controller.  quota_cpus rounds it up to whole CPUs, as the Go runtime, the JVM and loky (joblib)
do.  Anything unreadable counts as no quota: the answer only lowers a default."""
import math
import os
import time

# quota_cpus' last answer for this process and until when it holds: one tuple, replaced whole, so
# that a thread reading it while another renews it never pairs one answer's time with the other's count
_remembered = (float("-inf"), None)


def cpu_quota(root="/"):
    """CPUs of time per period the tightest cgroup quota over this process allows (a float, > 0), or
    None where none is set or none can be read.  `root`: where / is (tests give a fake tree)."""
    try:
        with open(os.path.join(root, "proc", "self", "cgroup")) as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open(os.path.join(root, "proc", "self", "mountinfo")) as f:
            mounts = [_cgroup_mount(line) for line in f]
    except OSError:
        return None
    quotas = []
    for _, controllers, path in memberships:
        v2 = controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        for mount_root, mount_point, is_v2, mount_controllers in filter(None, mounts):
            below = _below(path, mount_root)
            if is_v2 == v2 and (v2 or "cpu" in mount_controllers) and below is not None:
                quotas += _quotas_up_from(os.path.join(root, mount_point.lstrip("/")), below, v2)
    return min(quotas) if quotas else None


def quota_cpus(root="/"):
    """cpu_quota() rounded up to whole CPUs (at least 1), or None.  This process's answer is read
    again once it is a second old: reading the files takes about 0.1 ms, which a default thread count
    asked for at every codec call should not pay, and a quota may change while a server runs."""
    global _remembered
    now = time.monotonic()
    until, cpus = _remembered
    if root == "/" and now < until:
        return cpus
    quota = cpu_quota(root)
    cpus = None if quota is None else max(1, math.ceil(quota - 1e-9))
    if root == "/":
        _remembered = (now + 1.0, cpus)
    return cpus


def within_quota(count):
    """`count` (CPUs, cores, or threads one to each), or this process's CPU quota (quota_cpus) where
    that is smaller."""
    quota = quota_cpus()
    return min(count, quota) if quota else count


def _cgroup_mount(line):
    """(root, mount point, is v2, super options) of a cgroup mount line of mountinfo, else None."""
    fields = line.split()
    if "-" not in fields:
        return None
    sep = fields.index("-")
    if len(fields) < sep + 4 or sep < 5 or fields[sep + 1] not in ("cgroup", "cgroup2"):
        return None
    return _unescape(fields[3]), _unescape(fields[4]), fields[sep + 1] == "cgroup2", fields[sep + 3].split(",")


def _unescape(path):
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def _below(path, mount_root):
    """The part of the cgroup path under the mounted root ("/" where the mount is the process's own
    cgroup, as a container may see it), or None where the path lies outside what is mounted there:
    that mount shows other cgroups (a sibling's, another subtree's), whose quotas are not this
    process's."""
    if mount_root == "/":
        return path
    mount_root = mount_root.rstrip("/")
    if path.rstrip("/") == mount_root:
        return "/"
    return path[len(mount_root):] if path.startswith(mount_root + "/") else None


def _quotas_up_from(mount_dir, path, v2):
    """The quota of every cgroup from `path` up to the mount's root that sets one, in CPUs."""
    found = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        quota = _read_quota(os.path.join(mount_dir, *parts[:depth]), v2)
        if quota is not None:
            found.append(quota)
    return found


def _read_quota(directory, v2):
    try:
        if v2:
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, period = (f.read().split() + ["100000"])[:2]
            if quota == "max":
                return None
        else:
            with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        quota, period = int(quota), int(period)
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
