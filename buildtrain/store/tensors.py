"""Canonical tensor digests: (name, dtype, shape, little-endian bytes), never file bytes.

Outputs are compared by these digests, so two files holding the same tensors compare equal
whatever their layout or metadata. safetensors files are read here with a small header parser
(no torch, no pickle), which keeps `bt fsck` and output checks fast and import-free.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import blake3

from buildtrain.canonical import canonical_bytes, digest

MAX_HEADER = 100 << 20
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


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of a safetensors file and the offset where tensor data starts."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path.name}: too short for safetensors")
        (size,) = struct.unpack("<Q", prefix)
        if size > MAX_HEADER:
            raise ValueError(f"{path.name}: safetensors header of {size} bytes is implausible")
        raw = handle.read(size)
    if len(raw) != size:
        raise ValueError(f"{path.name}: truncated safetensors header")
    try:
        header = json.loads(raw)
    except RecursionError:  # inputs are untrusted: a crafted header must be rejected, not crash
        raise ValueError(f"{path.name}: safetensors header is nested too deeply") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: safetensors header is not an object")
    return header, 8 + size


def iter_safetensors(path: Path) -> Iterator[tuple[str, str, list[int], memoryview]]:
    """(name, dtype, shape, bytes) of each tensor in a safetensors file, by name."""
    header, start = read_safetensors_header(path)
    data = memoryview(path.read_bytes())
    for name in sorted(k for k in header if k != "__metadata__"):
        entry = header[name]
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= len(data) - start:
            raise ValueError(f"{path.name}: tensor {name} lies outside the file")
        yield name, entry["dtype"].lower(), list(entry["shape"]), data[start + begin : start + end]


def safetensors_digests(path: Path) -> dict[str, str]:
    return {
        name: tensor_digest(name, dtype, shape, raw) for name, dtype, shape, raw in iter_safetensors(path)
    }
