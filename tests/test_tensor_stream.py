"""Tensor digests computed as a pull writes a file (`tensors.TensorStream`): the same digests the
file's reader gives, in any cut of the bytes, or none at all; and counted only while the file is
the one that was streamed."""

from __future__ import annotations

import itertools
import struct
import tempfile
from pathlib import Path

import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tensors import tensor_sets, write_safetensors

from buildtrain.store import tensors
from buildtrain.store.checkpoints import state_digest
from buildtrain.store.tensors import TensorStream, iter_safetensors, tensor_digest


def read_digests(path: Path, prefix: str) -> dict[str, str]:
    """What the file's reader gives, with nothing streamed."""
    return {
        prefix + name: tensor_digest(prefix + name, dtype, shape, raw)
        for name, dtype, shape, raw in iter_safetensors(path)
    }


def streamed(raw: bytes, cuts: list[int], prefixes: tuple[str, ...]) -> TensorStream:
    stream = TensorStream(prefixes)
    edges = [0, *sorted(cut % (len(raw) + 1) for cut in cuts), len(raw)]
    for start, end in itertools.pairwise(edges):
        stream.update(memoryview(raw)[start:end])
    return stream


@settings(max_examples=60, deadline=None)
@given(found=tensor_sets, data=st.data())
def test_a_stream_gives_the_readers_digests_in_any_cut(
    found: dict[str, torch.Tensor], data: st.DataObject
) -> None:
    order = data.draw(st.permutations(sorted(found)))
    padding = data.draw(st.integers(min_value=0, max_value=9))
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=6))
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.safetensors"
        write_safetensors(path, found, list(order), padding, None)
        stream = streamed(path.read_bytes(), cuts, ("", "model."))
        assert stream.digests("") == read_digests(path, "")
        assert stream.digests("model.") == read_digests(path, "model.")
        assert stream.digests("optimizer.") is None  # never streamed under that name


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=300), cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=4))
def test_a_stream_of_any_bytes_never_raises_and_gives_the_readers_digests_or_none(
    raw: bytes, cuts: list[int]
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "x.safetensors"
        path.write_bytes(raw)
        found = streamed(raw, cuts, ("",)).digests("")
        try:
            expected = read_digests(path, "")
        except (ValueError, KeyError, TypeError, AttributeError):
            expected = None
        assert found is None or found == expected


def header_file(path: Path, header: bytes, data: bytes) -> bytes:
    raw = struct.pack("<Q", len(header)) + header + data
    path.write_bytes(raw)
    return raw


def test_a_tensor_outside_the_file_or_an_odd_offset_gives_no_stream_digests(tmp_path: Path) -> None:
    """Left to the reader, which refuses them: a stream only ever spares a re-read."""
    for offsets in ("[0, 64]", "[4, 2]", "[0.0, 4.0]", '["0", "4"]', "[-8, 4]"):
        header = f'{{"w": {{"dtype": "U8", "shape": [4], "data_offsets": {offsets}}}}}'.encode()
        raw = header_file(tmp_path / "w.safetensors", header, bytes(8))
        assert streamed(raw, [3, 17], ("",)).digests("") is None, offsets


def test_remembered_digests_count_only_while_the_file_is_unchanged(tmp_path: Path) -> None:
    checkpoint = tmp_path / "pull" / "step-000004"
    checkpoint.mkdir(parents=True)
    path = checkpoint / "model.safetensors"
    safetensors.torch.save_file({"w": torch.arange(6, dtype=torch.float32)}, str(path))
    honest = state_digest(checkpoint)
    tensors.remember(path, streamed(path.read_bytes(), [5], ("", "model.")))
    assert tensors.streamed_digests(path, "model.") == read_digests(path, "model.")
    assert state_digest(checkpoint) == honest
    safetensors.torch.save_file({"w": torch.ones(6, dtype=torch.float32)}, str(path))  # same size
    assert tensors.streamed_digests(path, "model.") is None  # another file now: read again
    assert state_digest(checkpoint) != honest
    tensors.remember(path, streamed(path.read_bytes(), [], ("", "model.")))
    tensors.forget(tmp_path / "pull")
    assert tensors.streamed_digests(path, "") is None
