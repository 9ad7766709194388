"""The strict safetensors reader against hand-built attack files and the `safetensors` library."""

import json
import os
import random
import struct

import pytest
import safetensors.torch as st
import torch

from core.ckpt import (
    CheckpointError,
    StreamingWriter,
    open_safetensors,
    open_safetensors_set,
    save_safetensors,
    save_safetensors_set,
)


def _raw(path, header, data: bytes, header_len=None, raw_header: bytes | None = None):
    """Write a file byte by byte, so malformed files can be built."""
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h) if header_len is None else header_len))
        f.write(h)
        f.write(data)
    return str(path)


def _entry(dtype, shape, b, e):
    return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}


def _library_rejects(path) -> bool:
    try:
        st.load_file(path)
    except Exception:  # noqa: BLE001 - any refusal counts
        return True
    return False


GOOD = {"a": _entry("F32", [2, 2], 0, 16), "b": _entry("I64", [1], 16, 24)}

ATTACKS = {
    # name: (header, data, header_len override, raw header, expected message fragment)
    "truncated_below_8": (None, None, None, None, "truncated file"),
    "header_longer_than_file": (GOOD, bytes(24), 10_000, None, "larger than the file"),
    "truncated_data": (GOOD, bytes(20), None, None, "beyond the data buffer"),
    "garbage_header": (None, bytes(8), None, b"\x00\x01garbage{", "not valid JSON"),
    "not_utf8": (None, b"", None, b'{"a\xff\xfe":1}', "not valid UTF-8"),
    "non_dict_json": (None, b"", None, b"[1, 2, 3]", "must be a JSON object"),
    "bad_dtype": ({"a": _entry("F31", [2], 0, 8)}, bytes(8), None, None, "unknown dtype 'F31'"),
    "shape_offset_mismatch": ({"a": _entry("F32", [3], 0, 8)}, bytes(8), None, None, "needs 12 bytes"),
    "overlap": ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)}, bytes(12), None, None,
                "overlaps key 'a'"),
    "gap": ({"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, bytes(12), None, None,
            "gap of 4 bytes before key 'b'"),
    "gap_at_start": ({"a": _entry("F32", [1], 4, 8)}, bytes(8), None, None, "gap of 4 bytes before key 'a'"),
    "trailing_bytes": ({"a": _entry("F32", [1], 0, 4)}, bytes(8), None, None, "trailing bytes"),
    "negative_shape": ({"a": _entry("F32", [-1], 0, 4)}, bytes(4), None, None, "non-negative integers"),
    "reversed_offsets": ({"a": _entry("F32", [0], 4, 0)}, bytes(4), None, None, "data_offsets must be"),
    "missing_field": ({"a": {"dtype": "F32", "shape": [1]}}, bytes(4), None, None, "exactly dtype"),
    "bad_metadata": ({"__metadata__": {"k": 1}, "a": _entry("F32", [1], 0, 4)}, bytes(4), None, None,
                     "__metadata__"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_refused_naming_the_file(tmp_path, name):
    header, data, hlen, raw_h, fragment = ATTACKS[name]
    path = str(tmp_path / f"{name}.safetensors")
    if name == "truncated_below_8":
        with open(path, "wb") as f:
            f.write(b"\x01\x02\x03")
    else:
        _raw(path, header, data, hlen, raw_h)
    with pytest.raises(CheckpointError, match=fragment) as e:
        open_safetensors(path)
    assert path in str(e.value)
    # the outside implementation agrees the file is malformed (the metadata one it tolerates)
    if name not in ("bad_metadata",):
        assert _library_rejects(path)


def test_duplicate_keys_refused(tmp_path):
    raw = (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
           b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    path = _raw(tmp_path / "dup.safetensors", None, bytes(8), raw_header=raw)
    with pytest.raises(CheckpointError, match="duplicate key 'a'"):
        open_safetensors(path)
    assert _library_rejects(path)


def test_offsets_in_header_are_relative_to_buffer_and_key_named(tmp_path):
    path = _raw(tmp_path / "ok.safetensors", GOOD, struct.pack("<4f", 1, 2, 3, 4) + struct.pack("<q", 7))
    f = open_safetensors(path)
    assert torch.equal(f.get("a"), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert f.get("b").tolist() == [7]
    with pytest.raises(CheckpointError, match="no key 'zz'"):
        f.get("zz")
    with pytest.raises(CheckpointError, match=r"slice \[1, 3\) out of range"):
        f.get_slice("a", 0, 1, 3)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 7, generator=g),
        "h": torch.randn(3, 4, 2, generator=g).to(torch.bfloat16),
        "f16": torch.randn(6, generator=g).half(),
        "d": torch.randn(2, 3, generator=g, dtype=torch.float64),
        "i": torch.arange(-5, 5, dtype=torch.int32),
        "l": torch.tensor(123456789012, dtype=torch.int64),
        "u": torch.arange(9, dtype=torch.uint8).reshape(3, 3),
        "m": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def test_interop_both_directions_including_bf16(tmp_path):
    ts = _tensors()
    ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
    save_safetensors(ts, ours, metadata={"format": "pt", "note": "x"})
    st.save_file(ts, theirs, metadata={"format": "pt"})
    by_library = st.load_file(ours)
    with st.safe_open(ours, "pt") as lib_file:  # metadata via the library's own header parsing
        assert lib_file.metadata() == {"format": "pt", "note": "x"}
    f = open_safetensors(theirs)
    assert sorted(f.keys()) == sorted(ts) and f.metadata == {"format": "pt"}
    for k, t in ts.items():
        assert by_library[k].dtype == t.dtype and torch.equal(by_library[k], t), k
        assert f.dtype(k) == t.dtype and f.shape(k) == tuple(t.shape)
        assert torch.equal(f.get(k), t), k
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_get_slice_matches_narrow(tmp_path, dim):
    t = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5).to(torch.bfloat16)
    path = str(tmp_path / "s.safetensors")
    st.save_file({"t": t}, path)
    f = open_safetensors(path)
    n = t.shape[dim]
    for start, stop in [(0, n), (1, n - 1), (2, 2), (n - 1, n)]:
        assert torch.equal(f.get_slice("t", dim, start, stop), t.narrow(dim, start, stop - start))


def test_writer_is_atomic_on_failure(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_safetensors({"a": torch.ones(2)}, path)
    before = open(path, "rb").read()
    with pytest.raises(TypeError, match="'bad'"):
        save_safetensors({"a": torch.zeros(2), "bad": torch.zeros(2, dtype=torch.complex64)}, path)
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["w.safetensors"]


def test_fuzzed_files_refused_or_read_as_library_reads(tmp_path):
    path = str(tmp_path / "base.safetensors")
    st.save_file({"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.int64)}, path)
    base = open(path, "rb").read()
    rng = random.Random(0)
    refused = 0
    for i in range(150):
        b = bytearray(base)
        kind = i % 3
        if kind == 0:
            b = b[: rng.randrange(len(b))]
        elif kind == 1:
            pos = rng.randrange(8 + struct.unpack("<Q", base[:8])[0])  # inside the header
            b[pos] = rng.randrange(256)
        else:
            b[rng.randrange(8)] = rng.randrange(256)
        p = str(tmp_path / f"f{i}.safetensors")
        open(p, "wb").write(bytes(b))
        try:
            f = open_safetensors(p)
        except CheckpointError:
            refused += 1
            continue
        lib = st.load_file(p)  # whatever we accept, the library accepts and reads the same
        assert sorted(lib) == sorted(f.keys())
        for k in lib:
            assert torch.equal(lib[k], f.get(k))
    assert refused > 50


def test_sharded_set_round_trip_and_index_checks(tmp_path):
    ts = {f"layer.{i}": torch.full((4, 4), float(i)) for i in range(5)}
    files = save_safetensors_set(ts, str(tmp_path), max_shard_bytes=2 * 64)
    assert files[-1] == "model.safetensors.index.json" and len(files) == 4
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == 5 * 64
    s = open_safetensors_set(str(tmp_path))
    assert s.keys() == list(ts)
    for k, t in ts.items():
        assert torch.equal(s.get(k), t) and torch.equal(st.load_file(str(tmp_path / index["weight_map"][k]))[k], t)
    # an index that points at a missing shard, or at a shard lacking a key, is named
    index["weight_map"]["layer.0"] = "model-00002-of-00003.safetensors"
    json.dump(index, open(tmp_path / "model.safetensors.index.json", "w"))
    with pytest.raises(CheckpointError, match="'layer.0' is listed in model-00002-of-00003"):
        open_safetensors_set(str(tmp_path))
    index["weight_map"]["layer.0"] = "../evil.safetensors"
    json.dump(index, open(tmp_path / "model.safetensors.index.json", "w"))
    with pytest.raises(CheckpointError, match="plain file name"):
        open_safetensors_set(str(tmp_path))
    os.remove(tmp_path / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        open_safetensors_set(str(tmp_path))


def test_single_file_set(tmp_path):
    assert save_safetensors_set({"x": torch.ones(3)}, str(tmp_path), prefix="optim") == ["optim.safetensors"]
    with open_safetensors_set(str(tmp_path), prefix="optim") as s:
        assert torch.equal(s.get("x"), torch.ones(3))


@pytest.mark.parametrize("cap", [None, 64])
def test_streaming_writer_reads_back_with_the_library(tmp_path, cap):
    g = torch.Generator().manual_seed(0)
    ts = {"w": torch.randn(3, 5, generator=g), "h": torch.randn(7, generator=g).half(),
          "d": torch.randn(2, 2, generator=g, dtype=torch.float64), "s": torch.tensor(4.0), "e": torch.zeros(0, 3)}
    with StreamingWriter(str(tmp_path), "model", {k: (v.dtype, v.shape) for k, v in ts.items()}, cap) as w:
        assert w.order[0] == "d" and w.order[-1] == "h"  # 8-byte items first: every tensor aligned
        with pytest.raises(ValueError, match="expected 'd'"):
            w.write("w", ts["w"])
        with pytest.raises(ValueError, match="declared"):
            w.write("d", ts["d"].float())
        for n in w.order:
            w.write(n, ts[n])
        files = w.close()
    got = {}
    for f in files:
        if f.endswith(".safetensors"):
            got.update(st.load_file(str(tmp_path / f)))  # the reference implementation
    assert sorted(got) == sorted(ts) and all(torch.equal(got[k], v) for k, v in ts.items())
    assert (len(files) > 1) == (cap is not None) and not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    with open_safetensors_set(str(tmp_path)) as s:
        assert torch.equal(s.get_slice("w", 1, 1, 4), ts["w"][:, 1:4])
