"""pages.stream_buffer: alignment, size, huge-page advice on Linux, errors; and that the packed experts
and the read-bandwidth probe live in such buffers."""
import errno
import mmap
import sys

import numpy as np
import pytest

from ktfp8 import pages, roofline
from ktfp8.moe import MoE
from kernel_tester import moe_config
from moe_oracle import make_experts

HUGE = 2 << 20
linux_thp = pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")),
                               reason="transparent huge pages are a Linux feature")


def vm_flags(address):
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("nbytes", [1, 100, HUGE - 1])
def test_small_buffers_are_cache_line_aligned(nbytes):
    buf = pages.stream_buffer(nbytes)
    assert buf.dtype == np.uint8 and buf.shape == (nbytes,) and buf.flags.writeable and buf.flags.c_contiguous
    assert buf.ctypes.data % 64 == 0


def test_an_empty_buffer():
    assert pages.stream_buffer(0).shape == (0,)


@linux_thp
@pytest.mark.parametrize("nbytes", [HUGE, 5 * HUGE + 12345])
def test_large_buffers_are_huge_page_aligned_and_advised(nbytes):
    buf = pages.stream_buffer(nbytes)
    assert buf.shape == (nbytes,) and buf.ctypes.data % HUGE == 0
    assert "hg" in vm_flags(buf.ctypes.data)  # MADV_HUGEPAGE is set on the mapping
    buf[:] = 7  # the whole length is writable memory of ours
    buf[-1] = 9
    assert int(buf[0]) == 7 and int(buf[-1]) == 9


@linux_thp
def test_a_view_keeps_the_mapping_alive():
    tail = pages.stream_buffer(3 * HUGE)[-16:]  # the full array is gone, its mapping must not be
    tail[:] = 5
    assert tail.sum() == 80


def test_negative_size_is_refused():
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        pages.stream_buffer(-1)


@linux_thp
def test_a_failed_mapping_is_a_memory_error(monkeypatch):
    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    monkeypatch.setattr(pages.mmap, "mmap", no_memory)
    with pytest.raises(MemoryError, match="cannot map"):
        pages.stream_buffer(4 * HUGE)


@linux_thp
def test_packed_experts_live_in_huge_page_advised_memory():
    E, H, I = 8, 512, 256  # 3 MiB of FP8 codes
    experts, _ = make_experts("fp8_per_channel", E, H, I, seed=3)
    moe = MoE(moe_config("fp8_per_channel", E, H, I, 2, block=64), experts)
    packed = moe._kernel.packed
    assert packed.nbytes >= HUGE and packed.ctypes.data % HUGE == 0
    assert "hg" in vm_flags(packed.ctypes.data)


def test_probe_buffer_is_written_memory():
    """A never-written anonymous page reads as the kernel's shared zero page, from cache: the probe's
    buffer must hold written bytes, or it would not measure the memory."""
    buf = roofline.probe_buffer(3 * HUGE + 100, threads=1)
    assert buf.nbytes == (3 * HUGE + 100) // 128 * 128
    assert buf.min() == 1 and buf.max() == 1
