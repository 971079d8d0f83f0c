"""ktfp8.safetensors_io against the safetensors library (the reference reader/writer) and malformed files."""
import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

from ktfp8.safetensors_io import (DTYPES, SafetensorsError, SafetensorsFile, ShardWriter, read_header,
                                  write_file)


def _reference():
    """torch and safetensors' torch API, the reference writer and reader: the tests comparing against
    them skip without torch (ktfp8.safetensors_io itself needs none)."""
    return pytest.importorskip("torch"), pytest.importorskip("safetensors.torch")


def _torch_dtypes(torch):
    return {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
            "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64,
            "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
            "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _random_bytes(rng, shape, dtype):
    nbytes = int(np.prod(shape)) * DTYPES[dtype].itemsize
    raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    if dtype == "BOOL":
        raw &= 1
    return raw.view(DTYPES[dtype]).reshape(shape)


def _raw(a):
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def test_reads_every_dtype_written_by_safetensors(tmp_path):
    torch, st_torch = _reference()
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (), (2, 0, 4), (1, 2, 3)]
    tensors = {}
    for i, (name, tdt) in enumerate(_torch_dtypes(torch).items()):
        shape = shapes[i % len(shapes)]
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * tdt.itemsize, dtype=np.uint8)
        if tdt == torch.bool:
            raw &= 1
        tensors[f"t.{name}"] = torch.frombuffer(bytearray(raw.tobytes()) or bytearray(1), dtype=torch.uint8)[
            :raw.size].view(tdt).reshape(shape)
    path = tmp_path / "ref.safetensors"
    st_torch.save_file(tensors, str(path), metadata={"format": "pt"})

    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt"}
        for name, t in tensors.items():
            dtype = name.split(".", 1)[1]
            expect = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
            mapped, copied = f.memmap(name), f.read_rows(name)
            assert mapped.shape == copied.shape == tuple(t.shape)
            assert mapped.dtype == copied.dtype == DTYPES[dtype]
            assert _raw(mapped) == _raw(copied) == expect
    assert DTYPES["F8_E4M3"] == np.uint8 and DTYPES["BF16"] == ml_dtypes.bfloat16


def test_written_file_is_read_by_safetensors(tmp_path):
    torch, st_torch = _reference()
    rng = np.random.default_rng(1)
    arrays = {"codes": ("F8_E4M3", _random_bytes(rng, (6, 10), "U8")),
              "scale": ("F32", rng.standard_normal((6, 1)).astype(np.float32)),
              "w": ("BF16", rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16)),
              "odd": ("U8", _random_bytes(rng, (3,), "U8")),        # leaves the next tensor unaligned
              "i64": ("I64", rng.integers(-5, 5, size=(4,)))}
    path = tmp_path / "ours.safetensors"
    write_file(path, arrays, metadata={"format": "pt"})
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    assert (8 + n) % 8 == 0, "data buffer must start 8-byte aligned"
    loaded = st_torch.load_file(str(path))
    assert loaded["codes"].dtype == torch.float8_e4m3fn
    for name, (_, a) in arrays.items():
        assert loaded[name].contiguous().view(torch.uint8).numpy().tobytes() == _raw(a)


def test_writer_accepts_rows_in_any_order_from_threads(tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    torch, st_torch = _reference()
    rng = np.random.default_rng(2)
    a = rng.standard_normal((64, 33)).astype(np.float32)
    b = _random_bytes(rng, (50, 7), "U8")
    path = tmp_path / "rows.safetensors"
    writer = ShardWriter(path, [("a", "F32", a.shape), ("b", "F8_E4M3", b.shape)])
    jobs = [("a", a, r) for r in range(0, 64, 5)] + [("b", b, r) for r in range(0, 50, 5)]
    rng.shuffle(jobs)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda j: writer.write(j[0], j[1][j[2]:j[2] + 5], j[2]), jobs))
    writer.close()
    loaded = st_torch.load_file(str(path))
    np.testing.assert_array_equal(loaded["a"].numpy(), a)
    np.testing.assert_array_equal(loaded["b"].view(torch.uint8).numpy(), b)


def test_writer_rejects_incomplete_and_mismatched_writes(tmp_path):
    writer = ShardWriter(tmp_path / "x.safetensors", [("a", "F32", (4, 2)), ("b", "BF16", (3,))])
    with pytest.raises(TypeError, match="'a' is F32"):
        writer.write("a", np.zeros((4, 2), np.float64))
    with pytest.raises(ValueError, match="shape"):
        writer.write("a", np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match="shape"):
        writer.write("a", np.zeros((2, 2), np.float32), row_offset=3)
    with pytest.raises(ValueError, match="not declared"):
        writer.write("c", np.zeros((4, 2), np.float32))
    writer.write("a", np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="not .or partly. written.*'b'"):
        writer.close()


def test_memmap_is_a_read_only_view_of_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    write_file(path, {"x": ("F32", np.arange(12, dtype=np.float32).reshape(3, 4))})
    f = SafetensorsFile(path)
    view = f.memmap("x")
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0, 0] = 1
    start = f.info("x").start
    fd = os.open(path, os.O_WRONLY)         # a change on disk shows through the map: nothing was copied
    os.pwrite(fd, np.float32(99).tobytes(), start + 4 * 5)
    os.close(fd)
    assert view[1, 1] == 99
    assert f.read_rows("x", 1, 2).tolist() == [[4, 99, 6, 7]]


def test_a_file_truncated_after_its_first_view_is_an_error_not_a_sigbus(tmp_path):
    """Reading a page past a truncated file's end kills the process (SIGBUS): every view checks the
    size, not only the first (the second layer of a shard truncated after the first was loaded)."""
    path = tmp_path / "t.safetensors"
    write_file(path, {"a": ("U8", np.ones((4096,), np.uint8)), "b": ("U8", np.full((65536,), 7, np.uint8))})
    f = SafetensorsFile(path)
    assert f.memmap("a").sum() == 4096
    os.truncate(path, f.info("b").start + 100)
    with pytest.raises(SafetensorsError, match="file shrank since its header was read"):
        f.memmap("b")


def test_a_closed_file_says_so_and_its_views_stay_valid(tmp_path):
    path = tmp_path / "t.safetensors"
    write_file(path, {"a": ("U8", np.arange(64, dtype=np.uint8)), "empty": ("U8", np.zeros((0,), np.uint8))})
    with SafetensorsFile(path) as f:
        view = f.memmap("a")
    for read in (lambda: f.memmap("a"), lambda: f.read_rows("a"), lambda: f.read_rows("empty")):
        with pytest.raises(ValueError, match="t.safetensors: file is closed"):
            read()
    np.testing.assert_array_equal(view, np.arange(64))


def test_a_file_replaced_under_its_name_is_read_as_opened(tmp_path):
    """The header, the reads and the map all go through one descriptor: a file written again under the
    same name (its tensors in another order) does not mix the old header with the new bytes."""
    path = tmp_path / "r.safetensors"
    first = {"a": ("F32", np.full((64,), 1, np.float32)), "b": ("F32", np.full((64,), 2, np.float32))}
    write_file(path, first)
    f = SafetensorsFile(path)
    write_file(tmp_path / "new.safetensors", {"b": first["b"], "a": ("F32", np.full((64,), 3, np.float32))})
    os.replace(tmp_path / "new.safetensors", path)
    assert (f.memmap("a") == 1).all() and (f.memmap("b") == 2).all()
    assert (f.read_rows("a") == 1).all()
    fresh = SafetensorsFile(path)
    assert (fresh.memmap("a") == 3).all() and (fresh.memmap("b") == 2).all()


def test_stacked_memmap(tmp_path):
    rng = np.random.default_rng(3)
    experts = {f"e.{i}.{p}": ("BF16", rng.standard_normal((5, 6)).astype(ml_dtypes.bfloat16))
               for i in range(4) for p in ("down", "gate", "up")}     # HF order: interleaved projections
    path = tmp_path / "s.safetensors"
    write_file(path, experts)
    f = SafetensorsFile(path)
    for p in ("down", "gate", "up"):
        names = [f"e.{i}.{p}" for i in range(4)]
        view = f.stacked_memmap(names)
        assert view.shape == (4, 5, 6) and not view.flags.writeable
        np.testing.assert_array_equal(view, np.stack([experts[n][1] for n in names]))
    assert f.stacked_memmap(["e.0.gate", "e.2.gate", "e.1.gate"]) is None       # not equally spaced


def _file_with_header(path, header, data=b"", declared_len=None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if declared_len is None else declared_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def _entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("header, data, message", [
    (b"{not json", b"", "not valid JSON"),
    (b"\xff\xfe{}", b"", "not valid JSON"),
    (b"[1, 2]", b"", "must be a JSON object"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', b"\0" * 4, "not valid JSON"),
    ({"a": _entry("C64", [1], 0, 8)}, b"\0" * 8, "unsupported dtype 'C64'"),
    ({"a": _entry("F32", [2], 0, 4)}, b"\0" * 4, "needs 8"),
    ({"a": _entry("F32", [-1], 0, 4)}, b"\0" * 4, "non-negative"),
    ({"a": _entry("F32", [1.5], 0, 4)}, b"\0" * 4, "non-negative"),
    ({"a": _entry("F32", [2**40, 2**40], 0, 4)}, b"\0" * 4, "needs"),
    ({"a": _entry("F32", [1], 4, 0)}, b"\0" * 4, "begin <= end"),
    ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "data_offsets"),
    ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [1], 4, 8)}, b"\0" * 8, "overlaps"),
    ({"a": _entry("F32", [1], 4, 8)}, b"\0" * 8, "gap of 4 bytes"),
    ({"a": _entry("F32", [1], 0, 4)}, b"\0" * 12, "8 bytes after the last tensor"),
    ({"a": _entry("F32", [4], 0, 16)}, b"\0" * 10, "truncated"),
    ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
])
def test_malformed_headers_raise_safetensors_error(tmp_path, header, data, message):
    path = _file_with_header(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(SafetensorsError, match=message) as info:
        read_header(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_truncated_and_missing_files(tmp_path):
    good = tmp_path / "good.safetensors"
    write_file(good, {"x": ("F32", np.ones((8, 8), np.float32))})
    raw = good.read_bytes()
    for cut in (0, 5, 8, 20, len(raw) - 1):
        path = tmp_path / f"cut{cut}.safetensors"
        path.write_bytes(raw[:cut])
        with pytest.raises(SafetensorsError, match="truncated|exceeds the file size"):
            read_header(path)
    huge = _file_with_header(tmp_path / "huge.safetensors", b"{}", declared_len=2**63)
    with pytest.raises(SafetensorsError, match="exceeds the file size"):
        read_header(huge)
    with pytest.raises(SafetensorsError, match="file not found"):
        read_header(tmp_path / "nope.safetensors")
    with pytest.raises(SafetensorsError, match=r"tensor 'y' is not in this file"):
        SafetensorsFile(good).memmap("y")
