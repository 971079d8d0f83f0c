"""Minimal safetensors reader/writer over raw header offsets.

Why not `safetensors.numpy`: it cannot return F8_E4M3 tensors (it looks for `np.float8_e4m3fn`, which
NumPy lacks), and it loads whole files.  Here a tensor is either a read-only view of a memory map
(`SafetensorsFile.memmap`, no copy) or read into fresh memory with `readinto` (`read_rows`, so page
cache is not charged to the process), and shards are written header first, then each tensor's bytes
at its planned offset, in any order (`ShardWriter`), so no file is ever held in memory.

File layout (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes
of UTF-8 JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the data buffer; offsets are relative to the buffer, tensors are contiguous and cover it."""
import json
import math
import mmap
import os
import stat
import struct
import threading
from dataclasses import dataclass
from typing import Dict, Tuple

import ml_dtypes
import numpy as np

# dtype string -> NumPy dtype of the arrays we hand out.  FP8 E4M3 comes back as uint8 codes
# (the convention of ktfp8.fp8); every other dtype keeps its meaning.
DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(np.uint8), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
# Arrays accepted when writing a given dtype string (uint8 codes or ml_dtypes for FP8; raw bits for BF16).
_WRITABLE = {name: {dt} for name, dt in DTYPES.items()}
_WRITABLE["F8_E4M3"] = {np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn)}
_WRITABLE["F8_E5M2"] = {np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e5m2)}
_WRITABLE["BF16"] = {np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)}

MAX_HEADER_BYTES = 100 * 1024 * 1024   # the limit the reference implementation enforces
MAX_DIMS = 32                          # NumPy's limit was 32 before 2.0 (64 since)
_INT64 = 2 ** 63                       # dims and offsets must fit NumPy's index type


class SafetensorsError(ValueError):
    """A safetensors file that is missing, truncated or malformed, or a tensor that is not in it."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: `start`/`end` are absolute byte offsets in the file."""
    name: str
    dtype: str
    shape: Tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self):
        return self.end - self.start

    @property
    def np_dtype(self):
        return DTYPES[self.dtype]


def dtype_itemsize(dtype):
    if dtype not in DTYPES:
        raise SafetensorsError(f"unsupported safetensors dtype {dtype!r}; known: {', '.join(DTYPES)}")
    return DTYPES[dtype].itemsize


def tensor_nbytes(dtype, shape):
    return math.prod(shape) * dtype_itemsize(dtype)


def _reject_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(path):
    """(tensors: {name: TensorInfo} in file order, metadata: dict) of the file at `path`, validated:
    offsets in range, contiguous, non-overlapping, sizes matching dtype x shape."""
    path = os.fspath(path)
    fd = _open_file(path)
    try:
        return _read_header(fd, path)
    finally:
        os.close(fd)


def _open_file(path):
    """A read-only descriptor of the regular file at `path`, else SafetensorsError saying why."""
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer before fstat could refuse it (it
        # changes nothing for a regular file's reads or mappings)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: file not found") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "is a directory" if stat.S_ISDIR(mode) else "is not a regular file"
        raise SafetensorsError(f"{path}: {what}, expected a .safetensors file")
    return fd


def _read_header(fd, path):
    """read_header of the file open as `fd` (read with pread: the descriptor's offset is left alone)."""
    file_size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise SafetensorsError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise SafetensorsError(f"{path}: header length {n} exceeds the file size {file_size} "
                               f"(truncated or not a safetensors file)")
    raw = os.pread(fd, n, 8)
    if len(raw) < n:
        raise SafetensorsError(f"{path}: file shrank while its header was read")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    except RecursionError:      # thousands of nested [ or {: no header nests more than two levels
        raise SafetensorsError(f"{path}: header is not valid JSON (nested too deeply)") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header must be a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    base = 8 + n
    tensors = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(path, name, entry, base)
    _check_layout(path, tensors, base, file_size - base)
    ordered = dict(sorted(tensors.items(), key=lambda kv: kv[1].start))
    return ordered, metadata


def _tensor_info(path, name, entry, base):
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise SafetensorsError(f"{path}: tensor {name!r}: entry must have dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}; "
                               f"known: {', '.join(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(_is_int(d) and 0 <= d < _INT64 for d in shape)):
        raise SafetensorsError(f"{path}: tensor {name!r}: shape must be a list of at most {MAX_DIMS} "
                               f"non-negative ints below 2**63, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise SafetensorsError(f"{path}: tensor {name!r}: data_offsets must be [begin, end] with "
                               f"0 <= begin <= end, got {offsets!r}")
    expected = tensor_nbytes(dtype, shape)
    if offsets[1] - offsets[0] != expected:
        raise SafetensorsError(f"{path}: tensor {name!r}: data_offsets {offsets} span "
                               f"{offsets[1] - offsets[0]} bytes but {dtype} {shape} needs {expected}")
    return TensorInfo(name, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def _check_layout(path, tensors, base, buffer_size):
    """Tensors must tile the data buffer exactly: no overlap, no gap, nothing past the end."""
    position = 0
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        begin = info.start - base
        if begin < position:
            raise SafetensorsError(f"{path}: tensor {info.name!r} overlaps the tensor before it")
        if begin > position:
            raise SafetensorsError(f"{path}: gap of {begin - position} bytes before tensor "
                                   f"{info.name!r} (offsets do not tile the data buffer)")
        position = begin + info.nbytes
        if position > buffer_size:
            raise SafetensorsError(f"{path}: truncated: tensor {info.name!r} ends at byte {position} of "
                                   f"a data buffer of {buffer_size} bytes")
    if position != buffer_size:
        raise SafetensorsError(f"{path}: {buffer_size - position} bytes after the last tensor "
                               f"(offsets do not cover the data buffer)")


class SafetensorsFile:
    """An open safetensors file: validated header, tensors as memory-map views or fresh copies."""

    def __init__(self, path):
        self.path = os.fspath(path)
        # One descriptor for the header, the reads and the map: a file replaced under the same name
        # (a conversion run again) would otherwise be read at the old header's offsets.
        self._fd = _open_file(self.path)
        try:
            self.tensors, self.metadata = _read_header(self._fd, self.path)
        except BaseException:
            os.close(self._fd)
            raise
        self._end = max((t.end for t in self.tensors.values()), default=0)
        self._map = self._mmap = None

    def __contains__(self, name):
        return name in self.tensors

    def keys(self):
        return list(self.tensors)

    def info(self, name) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise SafetensorsError(f"{self.path}: tensor {name!r} is not in this file") from None

    def memmap(self, name):
        """Read-only view of tensor `name` on a memory map of the file (no copy)."""
        info = self.info(name)
        # checked at every view, not only the first: a page past a truncated end is a SIGBUS when read
        if os.fstat(self._open_fd()).st_size < self._end:
            raise SafetensorsError(f"{self.path}: file shrank since its header was read")
        if self._map is None:
            self._mmap = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)    # kept for release's madvise
            self._map = np.frombuffer(self._mmap, np.uint8)
        return self._map[info.start:info.end].view(info.np_dtype).reshape(info.shape)

    def release(self, name):
        """Drops the mapped pages of tensor `name` from this process (MADV_DONTNEED on the shared,
        read-only map): views of it stay valid and read them back from the page cache, if ever.  For
        tensors copied elsewhere (packed), whose pages would otherwise stay charged to this process
        while the file is open.  The pages at its two ends are shared with its neighbours."""
        dontneed = getattr(mmap, "MADV_DONTNEED", None)
        if self._map is None or dontneed is None:
            return
        info = self.info(name)
        start = info.start // mmap.PAGESIZE * mmap.PAGESIZE    # madvise takes a page-aligned start
        if info.end > start:
            self._mmap.madvise(dontneed, start, info.end - start)

    def stacked_memmap(self, names):
        """One read-only view [len(names), *shape] over tensors of one dtype and shape that lie at
        equal distances in the file (as HF and ktfp8 write expert stacks), else None."""
        infos = [self.info(n) for n in names]
        first = infos[0]
        if any(i.dtype != first.dtype or i.shape != first.shape for i in infos):
            return None
        step = infos[1].start - first.start if len(infos) > 1 else first.nbytes
        if step < first.nbytes or any(i.start != first.start + k * step for k, i in enumerate(infos)):
            return None
        base = self.memmap(first.name)
        itemsize = first.np_dtype.itemsize
        if first.nbytes == 0 or step % itemsize:
            return None
        view = np.lib.stride_tricks.as_strided(base, shape=(len(infos),) + first.shape,
                                               strides=(step,) + base.strides, writeable=False)
        return view

    def read_rows(self, name, start=0, stop=None, *, matrix=False):
        """Rows [start, stop) of tensor `name` (along its first axis) read into a new array; matrix=True:
        rows of the tensor seen as a matrix [all but its last axis, last axis] (a 3-D stack of experts:
        rows of consecutive experts' matrices).
        Reads with pread, so the bytes do not stay charged to this process as mapped pages."""
        info = self.info(name)
        shape = (math.prod(info.shape[:-1]), info.shape[-1]) if matrix and info.shape else info.shape
        rows = shape[0] if shape else 1
        stop = rows if stop is None else stop
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"rows [{start}, {stop}) out of range for tensor {name!r} with {rows} rows")
        row_bytes = info.nbytes // rows if rows else 0
        fd = self._open_fd()
        out = np.empty((stop - start,) + shape[1:], dtype=info.np_dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        offset, done = info.start + start * row_bytes, 0
        while done < len(buf):
            got = os.preadv(fd, [buf[done:]], offset + done)
            if got == 0:
                raise SafetensorsError(f"{self.path}: truncated while reading tensor {name!r}")
            done += got
        return out.reshape(info.shape) if not info.shape else out

    def _open_fd(self):
        if self._fd is None:
            raise ValueError(f"{self.path}: file is closed")
        return self._fd

    def close(self):
        """Gives back the descriptor and this file's map; views handed out keep their own reference to
        the map, and stay valid."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._map = self._mmap = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class ShardWriter:
    """Writes one safetensors file whose tensors are declared up front: the header goes to disk at once,
    then each tensor's bytes (whole or by rows, any order, from any thread) at its planned offset."""

    def __init__(self, path, specs, metadata=None):
        self.path = os.fspath(path)
        self.tensors: Dict[str, TensorInfo] = {}
        header, offset = {}, 0
        for name, dtype, shape in specs:
            shape = tuple(int(d) for d in shape)
            if name in header or name == "__metadata__":
                raise ValueError(f"tensor name {name!r} given twice (or reserved)")
            size = tensor_nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.tensors[name] = TensorInfo(name, dtype, shape, offset, offset + size)
            offset += size
        if metadata:
            header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}, **header}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(8 + len(raw)) % 8)     # keeps the data buffer 8-byte aligned, as the reference does
        base = 8 + len(raw)
        self.tensors = {n: TensorInfo(n, t.dtype, t.shape, t.start + base, t.end + base)
                        for n, t in self.tensors.items()}
        self.nbytes = base + offset
        self._written = {name: 0 for name in self.tensors}
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pwrite(struct.pack("<Q", len(raw)) + raw, 0)

    def _pwrite(self, data, offset):
        view = memoryview(data)
        while len(view):
            try:
                n = os.pwrite(self._fd, view, offset)
            except OSError as e:        # (pwrite names no file: "[Errno 28] No space left on device")
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            view, offset = view[n:], offset + n

    def write(self, name, array, row_offset=0):
        """Writes `array` as tensor `name`, or as its rows [row_offset, row_offset + len(array))."""
        info = self.tensors.get(name)
        if info is None:
            raise ValueError(f"{self.path}: tensor {name!r} was not declared for this shard")
        array = np.asarray(array)
        if array.dtype not in _WRITABLE[info.dtype]:
            raise TypeError(f"tensor {name!r} is {info.dtype}; cannot write a {array.dtype} array")
        whole = row_offset == 0 and array.shape == info.shape
        rows_ok = (len(info.shape) >= 1 and array.shape[1:] == info.shape[1:]
                   and 0 <= row_offset and row_offset + array.shape[0] <= info.shape[0])
        if not (whole or rows_ok):
            raise ValueError(f"tensor {name!r} has shape {info.shape}; cannot write an array of shape "
                             f"{array.shape} at row {row_offset}")
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
        self._pwrite(data, info.start + row_offset * row_bytes)
        with self._lock:
            self._written[name] += data.nbytes

    @property
    def complete(self):
        """True once every declared byte has been written."""
        with self._lock:
            return all(self._written[n] == info.nbytes for n, info in self.tensors.items())

    def close(self):
        """Checks that every declared byte was written, flushes to disk, closes."""
        if self._fd is None:
            return
        try:
            missing = [n for n, info in self.tensors.items() if self._written[n] != info.nbytes]
            if missing:
                raise ValueError(f"{self.path}: tensors not (or partly) written: {missing[:5]}")
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = None

    def abort(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_file(path, tensors, metadata=None):
    """Writes {name: (dtype string, array)} to `path` in one go (tests and small files)."""
    writer = ShardWriter(path, [(n, d, np.shape(a)) for n, (d, a) in tensors.items()], metadata)
    try:
        for name, (_, array) in tensors.items():
            writer.write(name, array)
    except BaseException:
        writer.abort()
        raise
    writer.close()
