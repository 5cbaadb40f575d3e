"""Canonical tensor digests: (name, dtype, shape, little-endian bytes), never file bytes.

Outputs are compared by these digests, so two files holding the same tensors compare equal
whatever their layout or metadata. safetensors files are read here with a small header parser
(no torch, no pickle), which keeps `bt fsck` and output checks fast and import-free.
"""

from __future__ import annotations

import functools
import json
import mmap
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import blake3

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.sources.safetensors_header import read_safetensors_header

# Canonical dtype names are safetensors' codes in lower case; torch names map onto them.
DTYPE_CODES = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint64": "u64",
    "uint32": "u32",
    "uint16": "u16",
    "uint8": "u8",
    "bool": "bool",
}


@functools.lru_cache(maxsize=4096)
def _identity(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    # Encoded once per tensor: a training run digests the same few hundred tensors every update.
    return canonical_bytes({"name": name, "dtype": dtype, "shape": list(shape)}) + b"\0"


def tensor_digest(name: str, dtype: str, shape: Iterable[int], data: Any) -> str:
    """blake3 of a tensor's identity and its raw bytes (a bytes-like object, little-endian)."""
    hasher = blake3.blake3(_identity(name, dtype, tuple(shape)))
    hasher.update(data)
    return hasher.hexdigest()


def combine(digests: dict[str, str]) -> str:
    """One digest for a set of named tensor digests."""
    return digest("tensors", digests)


def encode_header(tensors: Iterable[tuple[str, str, list[int], int]]) -> tuple[bytes, dict[str, int]]:
    """The start of a safetensors file holding (name, dtype code, shape, byte length) tensors, in
    name order with no gaps, and where each tensor's bytes start in the file: the same tensors give
    the same bytes, wherever they came from."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, length in sorted(tensors):
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + length]}
        offset += length
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    start = 8 + len(encoded)
    places = {
        name: start + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"
    }
    return struct.pack("<Q", len(encoded)) + encoded, places


def tensor_entries(header: dict[str, Any], start: int) -> Iterator[tuple[str, str, list[int], int, int]]:
    """(name, dtype, shape, first byte, end) of each tensor a safetensors header names, by name,
    the offsets counted from the start of the file (its data starts at `start`)."""
    for name in sorted(k for k in header if k != "__metadata__"):
        entry = header[name]
        begin, end = entry["data_offsets"]
        yield name, entry["dtype"].lower(), list(entry["shape"]), start + begin, start + end


def iter_safetensors(path: Path) -> Iterator[tuple[str, str, list[int], memoryview]]:
    """(name, dtype, shape, bytes) of each tensor in a safetensors file, by name."""
    header, start = read_safetensors_header(path)
    data = _mapped(path)
    for name, dtype, shape, begin, end in tensor_entries(header, start):
        if not start <= begin <= end <= len(data):
            raise ValueError(f"{path.name}: tensor {name} lies outside the file")
        yield name, dtype, shape, data[begin:end]


def _mapped(path: Path) -> memoryview:
    """A file's bytes, mapped rather than read: no copy and no fresh memory to fault in (a pull's
    check of 72 MB of checkpoints spent more on `read_bytes` than on hashing). Store files are
    never truncated in place (they are replaced by rename), so a mapping never loses its pages.
    The mapping lives as long as the views of it."""
    with open(path, "rb") as handle:
        try:
            return memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
        except (ValueError, OSError):  # an empty file, or one that cannot be mapped
            return memoryview(handle.read())


def safetensors_digests(path: Path) -> dict[str, str]:
    return {
        name: tensor_digest(name, dtype, shape, raw) for name, dtype, shape, raw in iter_safetensors(path)
    }


# torch.distributed.checkpoint's key, in a shard file's metadata, for where each tensor's rows start.
SHARDING_INFO = "DCP_SHARDING_INFO"


def sharded_tensors(folder: Path, prefix: str = "") -> dict[str, tuple[str, list[int], bytes]]:
    """(dtype, shape, bytes) of each whole tensor named `prefix...` in a folder of shard files (a
    sharded checkpoint's, one per rank). Shards are cut between rows of dim 0, so a whole tensor's
    bytes are its shards' bytes in the order of their first rows."""
    pieces: dict[str, list[tuple[int, str, list[int], memoryview]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        header, _ = read_safetensors_header(path)
        metadata = header.get("__metadata__") or {}
        offsets = json.loads(metadata.get(SHARDING_INFO, "{}"))
        for name, dtype, shape, raw in iter_safetensors(path):
            if name.startswith(prefix):
                first = (offsets.get(name, {}).get("saved_offsets") or [0])[0]
                pieces.setdefault(name, []).append((first, dtype, shape, raw))
    whole = {}
    for name, found in sorted(pieces.items()):
        found.sort(key=lambda piece: piece[0])
        dtype, shape = found[0][1], list(found[0][2])
        if shape:
            shape[0] = sum(piece[2][0] for piece in found)
        whole[name] = (dtype, shape, b"".join(bytes(piece[3]) for piece in found))
    return whole


def sharded_digests(folder: Path, prefix: str) -> dict[str, str]:
    """The digests `safetensors_digests` gives a file of the whole tensors named `prefix...`,
    named without the prefix, from a folder of shard files."""
    return {
        name.removeprefix(prefix): tensor_digest(name.removeprefix(prefix), dtype, shape, data)
        for name, (dtype, shape, data) in sharded_tensors(folder, prefix).items()
    }


def settle_header(path: Path) -> None:
    """Rewrite a safetensors header with its metadata keys in sorted order, in place.

    safetensors writes `__metadata__` from a hash map, so a file with several metadata keys (the
    shard files of torch.distributed.checkpoint) comes out in another order from every process,
    and a checkpoint's bytes would depend on the process that wrote it. The rewrite keeps the
    header's length (a permutation of the same JSON, padded with spaces as the format allows), so
    the tensor data stays where it is.
    """
    header, start = read_safetensors_header(path)
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        return
    settled = {
        "__metadata__": dict(sorted(metadata.items())),
        **{k: v for k, v in header.items() if k != "__metadata__"},
    }
    raw = json.dumps(settled, separators=(",", ":"), ensure_ascii=False).encode()
    size = start - 8
    if len(raw) > size:
        raise ValueError(f"{path.name}: its header does not fit back in {size} bytes")
    with open(path, "r+b") as handle:
        handle.seek(8)
        handle.write(raw + b" " * (size - len(raw)))
