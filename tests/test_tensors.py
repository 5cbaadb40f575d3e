"""Canonical tensor digests: the torch-free safetensors reader agrees with the torch side, and a
digest depends on (name, dtype, shape, bytes) and never on how a file lays the tensors out."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.sources.safetensors_header import MAX_HEADER, read_safetensors_header
from buildtrain.steps.train.state import digest_tensor, digests
from buildtrain.store.tensors import (
    DTYPE_CODES,
    SHARDING_INFO,
    combine,
    safetensors_digests,
    settle_header,
    sharded_digests,
    tensor_digest,
)

DTYPES = [getattr(torch, name) for name in DTYPE_CODES]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(min_value=0, max_value=4), min_size=0, max_size=3))
    count = 1
    for extent in shape:
        count *= extent
    raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:  # only 0 and 1 are booleans
        raw = bytes(b & 1 for b in raw)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()


names = st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=12).filter(
    lambda n: n != "__metadata__"
)
tensor_sets = st.dictionaries(names, tensors(), min_size=1, max_size=5)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), which torch.equal does not give for NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a) == raw_bytes(b)


def write_safetensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    order: list[str],
    padding: int,
    metadata: dict[str, str] | None,
) -> None:
    """A valid safetensors file with the tensors' data in `order` and a padded header."""
    header: dict[str, object] = {}
    chunks, offset = [], 0
    for name in order:
        tensor = tensors[name]
        raw = raw_bytes(tensor)
        code = DTYPE_CODES[str(tensor.dtype).removeprefix("torch.")].upper()
        header[name] = {
            "dtype": code,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode() + b" " * padding
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets)
def test_safetensors_digests_equal_torch_side_digests(tensors: dict[str, torch.Tensor]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "t.safetensors"
        safetensors.torch.save_file(tensors, str(path))
        assert safetensors_digests(path) == digests(tensors)
        assert combine(safetensors_digests(path)) == combine(digests(tensors))


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets, data=st.data())
def test_digests_do_not_depend_on_file_layout(tensors: dict[str, torch.Tensor], data: st.DataObject) -> None:
    order = data.draw(st.permutations(sorted(tensors)))
    padding = data.draw(st.integers(min_value=0, max_value=9))
    metadata = data.draw(st.none() | st.dictionaries(names, names, max_size=2))
    with tempfile.TemporaryDirectory() as scratch:
        reference, other = Path(scratch) / "reference.safetensors", Path(scratch) / "other.safetensors"
        safetensors.torch.save_file(tensors, str(reference))
        write_safetensors(other, tensors, list(order), padding, metadata)
        loaded = safetensors.torch.load_file(str(other))  # the hand-written file is valid safetensors
        assert all(same_bits(loaded[name], tensors[name]) for name in tensors)
        assert safetensors_digests(other) == safetensors_digests(reference)


def test_digest_depends_on_name_dtype_shape_and_every_byte() -> None:
    raw = bytes(range(24))
    base = tensor_digest("w", "f32", [2, 3], raw)
    assert tensor_digest("w", "f32", [2, 3], raw) == base
    others = {
        tensor_digest("v", "f32", [2, 3], raw),
        tensor_digest("w", "i32", [2, 3], raw),
        tensor_digest("w", "f32", [3, 2], raw),
        tensor_digest("w", "f32", [6], raw),
        tensor_digest("w", "u8", [24], raw),
    }
    for index in range(len(raw)):
        changed = bytearray(raw)
        changed[index] ^= 1
        others.add(tensor_digest("w", "f32", [2, 3], bytes(changed)))
    assert base not in others
    assert len(others) == 5 + len(raw)


def test_digest_tensor_is_independent_of_memory_layout() -> None:
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed_back = values.t().contiguous().t()  # same values, column-major storage
    assert not transposed_back.is_contiguous()
    assert digest_tensor("w", transposed_back) == digest_tensor("w", values)
    assert digest_tensor("w", values[1:]) == digest_tensor("w", values[1:].clone())  # storage offset
    assert digest_tensor("w", values) != digest_tensor("w", values.to(torch.float64))


def test_combine_depends_on_names_and_digests() -> None:
    one = combine({"a": "1" * 64, "b": "2" * 64})
    assert one == combine({"b": "2" * 64, "a": "1" * 64})
    assert one != combine({"a": "2" * 64, "b": "1" * 64})
    assert one != combine({"a": "1" * 64})


def header_file(path: Path, declared: int, body: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", declared) + body)
    return path


@pytest.mark.parametrize(
    ("declared", "body", "message"),
    [
        (MAX_HEADER + 1, b"{}", "implausible"),
        ((1 << 64) - 1, b"{}", "implausible"),
        (2, b"[]", "not an object"),
        (4, b'"ab"', "not an object"),
        (5, b"{nope", None),
        (2, b"\xff\xfe", None),
    ],
)
def test_read_safetensors_header_rejects_implausible_headers(
    tmp_path: Path, declared: int, body: bytes, message: str | None
) -> None:
    with pytest.raises(ValueError, match=message):
        read_safetensors_header(header_file(tmp_path / "bad.safetensors", declared, body))


@pytest.mark.parametrize("content", [b"", b"\x02\x00\x00"])
def test_read_safetensors_header_rejects_a_file_shorter_than_its_length_prefix(
    tmp_path: Path, content: bytes
) -> None:
    (tmp_path / "short.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="too short"):
        read_safetensors_header(tmp_path / "short.safetensors")


def test_read_safetensors_header_rejects_a_header_longer_than_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        read_safetensors_header(header_file(tmp_path / "truncated.safetensors", 1000, b"{}"))


def test_read_safetensors_header_returns_header_and_data_offset(tmp_path: Path) -> None:
    path = tmp_path / "ok.safetensors"
    safetensors.torch.save_file({"w": torch.ones(2, 2)}, str(path), metadata={"k": "v"})
    header, start = read_safetensors_header(path)
    assert header["w"]["shape"] == [2, 2] and header["__metadata__"] == {"k": "v"}
    assert start == 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert path.stat().st_size - start == 16


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=40))
def test_read_safetensors_header_never_fails_with_anything_but_value_error(raw: bytes) -> None:
    """Untrusted input: any bytes either give a header object or a ValueError, never a crash."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "fuzz.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)
        try:
            header, _ = read_safetensors_header(path)
        except ValueError:
            return
        assert isinstance(header, dict)


def test_deeply_nested_header_is_rejected_with_value_error(tmp_path: Path) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError):
        read_safetensors_header(header_file(tmp_path / "deep.safetensors", len(body), body))


@settings(max_examples=40, deadline=None)
@given(tensors=tensor_sets, data=st.data())
def test_sharded_digests_equal_the_digests_of_the_whole_tensors(
    tensors: dict[str, torch.Tensor], data: st.DataObject
) -> None:
    """Rows of dim 0 cut among any number of shard files, each file naming where its rows start
    (as torch.distributed.checkpoint writes them), digest as the whole tensors do."""
    files = data.draw(st.integers(1, 4))
    bounds = {}
    for name, tensor in tensors.items():
        rows = tensor.shape[0] if tensor.dim() else 1
        cuts = data.draw(st.lists(st.integers(0, rows), min_size=files - 1, max_size=files - 1))
        bounds[name] = [0, *sorted(cuts), rows]
    with tempfile.TemporaryDirectory() as folder:
        whole, shards = Path(folder) / "whole.safetensors", Path(folder) / "shards"
        shards.mkdir()
        write_safetensors(whole, tensors, sorted(tensors), 0, None)
        for index in range(files):
            part, offsets = {}, {}
            for name, tensor in tensors.items():
                if tensor.dim() == 0 and index > 0:
                    continue  # a scalar is written once
                first, end = bounds[name][index : index + 2]
                part[f"model.{name}"] = tensor[first:end] if tensor.dim() else tensor
                offsets[f"model.{name}"] = {"saved_offsets": [first] + [0] * max(0, tensor.dim() - 1)}
            metadata = {SHARDING_INFO: json.dumps(offsets), "format": "pt"}
            write_safetensors(shards / f"shard-{index}.safetensors", part, sorted(part), 0, metadata)
        assert sharded_digests(shards, "model.") == safetensors_digests(whole)


def test_settle_header_sorts_the_metadata_in_place_and_keeps_the_tensors(tmp_path: Path) -> None:
    tensors = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(2)}
    files = []
    for order in (["x", "format", "DCP"], ["DCP", "x", "format"]):  # two processes' hash maps
        path = tmp_path / f"{len(files)}.safetensors"
        write_safetensors(path, tensors, ["a", "b"], 3, {key: f"value of {key}" for key in order})
        size = path.stat().st_size
        settle_header(path)
        assert path.stat().st_size == size
        files.append(path.read_bytes())
    assert files[0] == files[1]
    header, _ = read_safetensors_header(tmp_path / "0.safetensors")
    assert list(header["__metadata__"]) == ["DCP", "format", "x"]
    loaded = safetensors.torch.load_file(str(tmp_path / "0.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
