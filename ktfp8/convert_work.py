"""The data path of `python -m ktfp8.convert`: each tensor is cut into row chunks; a chunk is read from
its input shard, copied or quantized, and written at its offset in the output shard.  Chunks are
independent, so a thread pool runs them on every core while memory stays at a few chunks."""
import math
import threading
from dataclasses import dataclass

import numpy as np

from . import fp8
from .convert_items import input_nbytes
from .loader import SCALE_RULE, first_bad_scale
from .safetensors_io import SafetensorsError, ShardWriter

CHUNK_BYTES = 32 << 20      # input bytes per chunk: big enough to stream, small enough to bound RSS
# ... and with --verify, whose float64 reference, float32 restored copy and float64 error take about
# 21 bytes a weight (a 32 MiB chunk of FP8 input: 672 MB a thread)
VERIFY_CHUNK_BYTES = CHUNK_BYTES // 4
CODEC_THREADS = 1           # the pool runs one chunk per core; the codec itself stays on its thread


@dataclass(frozen=True)
class Chunk:
    """Rows [start, stop) of one plan Item."""
    item: object
    start: int
    stop: int
    in_bytes: int


def _rows(shape):
    return shape[0] if shape else 1


def chunks(item, checkpoint, spec, chunk_bytes=CHUNK_BYTES):
    """The row chunks of `item`; for block-wise scales a chunk starts on a block boundary of the input
    and of the output, so every chunk owns whole scale rows.  A weight stored transposed in a fused
    stack is one chunk: each chunk reads its expert's whole matrix."""
    rows = _rows(item.shape)
    if input_nbytes(item, checkpoint) == 0:     # e.g. [2**50, 0]: rows of 0 bytes would make 2**50 chunks
        return [Chunk(item, 0, rows, 0)]
    align = rows if item.fused and item.fused.transposed else 1
    if item.src_block:
        align = math.lcm(align, item.src_block[0])
    if item.action != "copy" and not spec.per_channel:
        align = math.lcm(align, spec.block[0])
    row_bytes = input_nbytes(item, checkpoint) // rows
    # a chunk's size counts an FP8 input's codes as the float32 they are dequantized to (4 bytes, not 1)
    work_row_bytes = max(row_bytes, 4 * math.prod(item.shape[1:])) if item.src_block else row_bytes
    step = max(align, (chunk_bytes // work_row_bytes) // align * align)
    return [Chunk(item, a, min(a + step, rows), min(step, rows - a) * row_bytes) for a in range(0, rows, step)]


def shard_file_names(count):
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class ShardSet:
    """The output shards.  Each is created (header written) by its first write and closed (fsynced) as
    soon as all its bytes are written, so only the shards being filled hold a file descriptor."""

    def __init__(self, folder, shards, specs, metadata=None):
        self.folder, self.metadata = folder, metadata
        self.files = shard_file_names(len(shards))
        self.file_of = {name: f for f, names in zip(self.files, shards) for name in names}
        self._specs = {f: [(name, *specs[name]) for name in names] for f, names in zip(self.files, shards)}
        self._open, self._closed = {}, set()
        self._lock = threading.Lock()

    def write(self, name, array, row_offset=0):
        file_name = self.file_of[name]
        with self._lock:
            writer = self._open.get(file_name)
            if writer is None:
                if file_name in self._closed:
                    raise ValueError(f"{file_name} is already complete; cannot write {name!r} again")
                writer = self._open[file_name] = ShardWriter(self.folder / file_name, self._specs[file_name],
                                                             self.metadata)
        writer.write(name, array, row_offset)
        if writer.complete:
            with self._lock:      # several threads may see it complete: one closes it
                mine = self._open.get(file_name) is writer
                if mine:
                    del self._open[file_name]
                    self._closed.add(file_name)
            if mine:
                writer.close()

    def finish(self):
        """Raises unless every shard was written completely and closed."""
        missing = [f for f in self.files if f not in self._closed]
        if missing:
            self.abort()
            raise ValueError(f"output shards not completely written: {missing[:3]}")

    def abort(self):
        with self._lock:
            for writer in self._open.values():
                writer.abort()
            self._open.clear()


def _source_index(chunk, row, col):
    """The index in the input tensor of the chunk's value [row, col] (a fused stack: [expert, ., .])."""
    part, row = chunk.item.fused, chunk.start + row
    if part is None:
        return [row, col]
    return [part.expert, col, part.first + row] if part.transposed else [part.expert, part.first + row, col]


def _check_weights(chunk, weights):
    """Refuses a NaN or Inf among the values to quantize: E4M3 has no infinity (Inf would be saturated to
    448 x the row's scale, a finite wrong weight) and a NaN weight turns every output of its row NaN."""
    at = fp8.first_non_finite(weights)
    if at is None:
        return
    row, col = at
    item = chunk.item
    where = f"tensor {item.src!r}" + (f" dequantized with {item.src_scale!r}" if item.src_scale else "")
    whose = f" ({item.out})" if item.fused else ""
    raise SafetensorsError(f"{where} holds {float(weights[row, col])} at {_source_index(chunk, row, col)}{whose}; "
                           f"{fp8.NON_FINITE_WEIGHTS}")


def _check_codes(name, codes, first_row):
    """Refuses the E4M3 NaN code (S.1111.111) in a copied FP8 weight, as a NaN is refused in a weight to
    quantize or requantize."""
    nan = (codes & 0x7F) == 0x7F
    if nan.any():
        index = [int(i) for i in np.argwhere(nan)[0]]
        code = int(codes[tuple(index)])
        index[0] += first_row
        raise SafetensorsError(f"tensor {name!r} holds the FP8 NaN code 0x{code:02X} at {index}; a NaN weight "
                               f"makes every output of its row NaN")


def _check_scales(name, scale, first_row=0):
    """Refuses what ktfp8's loader refuses in an input weight_scale_inv (rows first_row.. of tensor
    `name`): loader.first_bad_scale."""
    found = first_bad_scale(np.asarray(scale, np.float32))
    if found is not None:
        index, value = found
        index[0] += first_row
        raise SafetensorsError(f"tensor {name!r} holds {value!s} at {index}; {SCALE_RULE}")


def _block_rows(start, stop, block_n):
    return start // block_n, -(-stop // block_n)


def _fused_rows(chunk, checkpoint):
    """Rows of one expert's weight out of its fused stack (see convert_items.FusedPart)."""
    part, file = chunk.item.fused, checkpoint.file_of(chunk.item.src)
    if part.transposed:          # [in, out]: the expert's whole matrix, then the columns of this weight
        matrix = file.read_rows(chunk.item.src, part.expert, part.expert + 1)[0]
        return np.ascontiguousarray(matrix[:, part.first + chunk.start:part.first + chunk.stop].T)
    first = part.expert * checkpoint.info(chunk.item.src).shape[1] + part.first
    return file.read_rows(chunk.item.src, first + chunk.start, first + chunk.stop, matrix=True)


def _source_rows(chunk, checkpoint):
    """The input rows of a quantize/requantize chunk as float (dequantized for a block FP8 input)."""
    item = chunk.item
    if item.fused:
        return _fused_rows(chunk, checkpoint)
    rows = checkpoint.file_of(item.src).read_rows(item.src, chunk.start, chunk.stop)
    if item.action == "quantize":
        return rows
    a, b = _block_rows(chunk.start, chunk.stop, item.src_block[0])
    scale = checkpoint.file_of(item.src_scale).read_rows(item.src_scale, a, b).astype(np.float32)
    _check_scales(item.src_scale, scale, a)
    return fp8.dequantize(rows, scale, out_dtype=np.float32, block=item.src_block, threads=CODEC_THREADS)


def _no_rows(item, checkpoint):
    """An array of none of the rows of a zero-byte tensor (e.g. [2**62, 0]: all its rows would be more than
    NumPy can shape, though they hold nothing)."""
    try:
        return np.empty((0,) + tuple(item.shape[1:]), checkpoint.info(item.src).np_dtype)
    except ValueError:
        raise SafetensorsError(f"tensor {item.src!r} has shape {list(item.shape)}: no bytes, but a row shape "
                               f"{list(item.shape[1:])} larger than NumPy can hold") from None


def run_chunk(chunk, checkpoint, shards, spec):
    """Reads, converts and writes one chunk into `shards` (a ShardSet)."""
    item = chunk.item
    if item.action == "copy":
        if not chunk.in_bytes:          # a zero-byte tensor: nothing to read, but its shard must be opened
            shards.write(item.out, _no_rows(item, checkpoint))
            return
        data = checkpoint.file_of(item.src).read_rows(item.src, chunk.start, chunk.stop)
        if item.check_scale:
            _check_scales(item.src, data, chunk.start)
        if item.check_codes:
            _check_codes(item.src, data, chunk.start)
        shards.write(item.out, data, chunk.start)
        return
    weights = _source_rows(chunk, checkpoint)
    _check_weights(chunk, weights)
    block = spec.block or (128, 128)
    codes, scale = fp8.quantize(weights, per_channel=spec.per_channel, block=block, threads=CODEC_THREADS)
    shards.write(item.out, codes, chunk.start)
    scale_row = chunk.start if spec.per_channel else chunk.start // block[0]
    shards.write(item.out_scale, np.asarray(scale, np.float32), scale_row)


def verify_chunk(chunk, checkpoint, outputs, spec):
    """(signal energy, error energy) of the chunk's written values against the input, in float64;
    for a copied tensor (0, 0) when the bytes match and (0, inf) when they do not.
    `outputs`: output tensor name -> SafetensorsFile of the written shard."""
    item = chunk.item
    if item.action == "copy" and not chunk.in_bytes:       # a zero-byte tensor: no bytes to differ
        return 0.0, 0.0
    if item.action == "copy":
        src = checkpoint.file_of(item.src).read_rows(item.src, chunk.start, chunk.stop)
        dst = outputs[item.out].read_rows(item.out, chunk.start, chunk.stop)
        same = src.reshape(-1).view(np.uint8).tobytes() == dst.reshape(-1).view(np.uint8).tobytes()
        return 0.0, 0.0 if same else math.inf
    reference = np.asarray(_source_rows(chunk, checkpoint), dtype=np.float64)
    codes = outputs[item.out].read_rows(item.out, chunk.start, chunk.stop)
    if spec.per_channel:
        scale = outputs[item.out_scale].read_rows(item.out_scale, chunk.start, chunk.stop)
    else:
        scale = outputs[item.out_scale].read_rows(item.out_scale,
                                                  *_block_rows(chunk.start, chunk.stop, spec.block[0]))
    restored = fp8.dequantize(codes, scale, out_dtype=np.float32, block=spec.block or (128, 128),
                              threads=CODEC_THREADS)
    error = reference - restored
    return float(np.vdot(reference, reference)), float(np.vdot(error, error))


def sqnr_db(signal, error):
    """10 log10(signal / error); inf for an exact result, nan for an all-zero or non-finite input."""
    if error == 0:
        return math.inf
    if not (signal > 0 and math.isfinite(signal) and math.isfinite(error)):
        return math.nan
    return 10.0 * math.log10(signal / error)
