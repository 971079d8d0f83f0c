"""Which files this process holds open: for tests that a loader gives its shards back."""
import os


def open_files_under(folder):
    """Paths under `folder` that this process holds a descriptor of (memory maps hold their own)."""
    fds = [os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd")]
    paths = [os.path.realpath(fd) for fd in fds if os.path.exists(fd)]
    return sorted(p for p in paths if p.startswith(os.path.realpath(folder) + os.sep))
