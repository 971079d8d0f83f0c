"""Fuzzing of the safetensors header / offset reader (ktfp8.safetensors_io) with hypothesis.

Every input -- random bytes, random JSON headers with wrong dtypes, shapes and offsets (out of range,
overlapping, overflowing), and mutations of a valid file (flipped bytes, truncation, a rewritten
header length) -- must either raise SafetensorsError (a ValueError) or open as a file whose every
tensor lies inside it and reads back exactly the bytes at its offsets.  Anything else (another
exception type, a crash, a read outside the file) fails.  Budgets: fuzz_settings."""
import json
import math
import struct

import numpy as np
from hypothesis import event, given
from hypothesis import strategies as st

from fuzz_settings import budget
from ktfp8.safetensors_io import DTYPES, MAX_HEADER_BYTES, SafetensorsError, SafetensorsFile, write_file

INT64 = 2 ** 63


def _check_file(path):
    """Opens `path` like the loader does and reads every tensor both ways; returns normally or
    raises SafetensorsError, and checks every tensor against the raw file bytes."""
    raw = path.read_bytes()
    try:
        f = SafetensorsFile(path)
    except SafetensorsError:
        return "rejected"
    with f:
        (n,) = struct.unpack("<Q", raw[:8])
        for name, info in f.tensors.items():
            assert 8 + n <= info.start <= info.end <= len(raw), (name, info)
            assert info.nbytes == math.prod(info.shape) * DTYPES[info.dtype].itemsize
            want = raw[info.start:info.end]
            assert f.memmap(name).tobytes() == want
            rows = f.read_rows(name)
            assert rows.shape == info.shape and rows.tobytes() == want
        return "accepted"


def _write(tmp_path, data, name="f.safetensors"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _framed(header_bytes, data=b"", length=None):
    return struct.pack("<Q", len(header_bytes) if length is None else length) + header_bytes + data


# ---------------------------------------------------------------------------- raw bytes

@budget(300)
@given(data=st.binary(max_size=512))
def test_random_bytes(tmp_path_factory, data):
    event(_check_file(_write(tmp_path_factory.mktemp("raw"), data)))


@budget(300)
@given(header=st.binary(max_size=256), tail=st.binary(max_size=64), slack=st.integers(-8, 8))
def test_random_header_bytes_with_a_plausible_length(tmp_path_factory, header, tail, slack):
    event(_check_file(_write(tmp_path_factory.mktemp("hdr"), _framed(header, tail, max(0, len(header) + slack)))))


# ---------------------------------------------------------------------------- structured headers

_ints = st.one_of(st.integers(-3, 64), st.integers(-2 ** 70, 2 ** 70),
                  st.sampled_from([INT64 - 1, INT64, 2 ** 64 - 1, 2 ** 64, -INT64]))
_json_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(allow_nan=False), st.text(max_size=8))
_json_any = st.recursive(_json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                               st.dictionaries(st.text(max_size=4), inner,
                                                                               max_size=3)),
                         max_leaves=8)
_dtypes = st.one_of(st.sampled_from(sorted(DTYPES)), st.sampled_from(["F4", "f32", "", "I128", "F8_E4M3FN"]),
                    _json_any)
_shapes = st.one_of(st.lists(st.integers(0, 6), max_size=4), st.lists(_ints, max_size=4),
                    st.lists(st.sampled_from([0, 1, INT64, 2 ** 64]), max_size=70), _json_any)


@st.composite
def _entries(draw):
    """A header of 0..4 tensors: mostly well-formed with consistent offsets, then damaged."""
    n = draw(st.integers(0, 4))
    header, offset = {}, 0
    for i in range(n):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        size = math.prod(shape) * DTYPES[dtype].itemsize
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    for _ in range(draw(st.integers(0 if n else 1, 3))):      # damage: at least one edit without tensors
        kind = draw(st.sampled_from(["dtype", "shape", "offsets", "shift", "drop_key", "entry", "meta",
                                     "extra_key"]))
        name = draw(st.sampled_from(sorted(header))) if header and kind != "meta" else "t0"
        entry = header.setdefault(name, {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})
        if not isinstance(entry, dict):
            continue
        if kind == "dtype":
            entry["dtype"] = draw(_dtypes)
        elif kind == "shape":
            entry["shape"] = draw(_shapes)
        elif kind == "offsets":
            entry["data_offsets"] = draw(st.one_of(st.lists(_ints, max_size=3), _json_any))
        elif kind == "shift":        # overlap, gap, past the end or before the start
            delta = draw(st.integers(-16, 16))
            offsets = entry.get("data_offsets")
            if isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets):
                entry["data_offsets"] = [offsets[0] + delta, offsets[1] + delta]
        elif kind == "drop_key":
            entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif kind == "entry":
            header[name] = draw(_json_any)
        elif kind == "meta":
            header["__metadata__"] = draw(_json_any)
        else:
            entry[draw(st.text(max_size=4))] = draw(_json_any)
    return header, offset


@budget(400)
@given(case=_entries(), extra=st.integers(-12, 12), fill=st.integers(0, 255))
def test_structured_headers(tmp_path_factory, case, extra, fill):
    header, size = case
    data = bytes([fill]) * max(0, size + extra)
    raw = json.dumps(header).encode()
    event(_check_file(_write(tmp_path_factory.mktemp("json"), _framed(raw, data))))


def _valid_file(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a": ("F32", rng.standard_normal((3, 5)).astype(np.float32)),
               "b": ("F8_E4M3", rng.integers(0, 256, (4, 7), dtype=np.uint8)),
               "c": ("BF16", rng.integers(0, 2 ** 16, (2,), dtype=np.uint16)),
               "d": ("I64", np.zeros((0, 3), np.int64))}
    path = tmp_path / "valid.safetensors"
    write_file(path, tensors, metadata={"format": "pt"})
    return path.read_bytes()


@budget(300)
@given(data=st.data())
def test_mutations_of_a_valid_file(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("mut")
    raw = bytearray(_valid_file(folder))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "truncate", "extend", "length", "insert"]))
        if kind in ("flip", "set") and raw:
            at = data.draw(st.integers(0, len(raw) - 1))
            raw[at] = raw[at] ^ (1 << data.draw(st.integers(0, 7))) if kind == "flip" else \
                data.draw(st.integers(0, 255))
        elif kind == "truncate":
            del raw[data.draw(st.integers(0, len(raw))):]
        elif kind == "extend":
            raw += data.draw(st.binary(min_size=1, max_size=16))
        elif kind == "insert":
            at = data.draw(st.integers(0, len(raw)))
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif len(raw) >= 8:
            length = data.draw(st.one_of(st.integers(0, len(raw)), st.sampled_from(
                [MAX_HEADER_BYTES + 1, 2 ** 63, 2 ** 64 - 1])))
            raw[:8] = struct.pack("<Q", length)
    event(_check_file(_write(folder, bytes(raw))))


# ---------------------------------------------------------------------------- fixed cases the fuzzer found

def test_deeply_nested_header_is_a_clear_error(tmp_path):
    for raw in (b"[" * 100_000, b'{"a":' * 50_000):
        assert _check_file(_write(tmp_path, _framed(raw))) == "rejected"


def test_non_string_dtype_and_non_object_metadata_are_rejected(tmp_path):
    for header in ({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
                   {"a": {"dtype": {"F32": 1}, "shape": [1], "data_offsets": [0, 4]}},
                   {"__metadata__": [], "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                   {"__metadata__": 0, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                   {"a": {"dtype": "F32", "shape": [0, 2 ** 64], "data_offsets": [0, 0]}, "b": {
                       "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                   {"a": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}):
        path = _write(tmp_path, _framed(json.dumps(header).encode(), b"\0" * 4))
        assert _check_file(path) == "rejected", header
