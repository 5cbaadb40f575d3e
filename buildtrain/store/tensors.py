"""Canonical tensor digests: (name, dtype, shape, little-endian bytes), never file bytes.

Outputs are compared by these digests, so two files holding the same tensors compare equal
whatever their layout or metadata. safetensors files are read here with a small header parser
(no torch, no pickle), which keeps `bt fsck` and output checks fast and import-free.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import blake3

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.sources.safetensors_header import decode_header, header_size, read_safetensors_header
from buildtrain.store.layout import FROZEN, MODEL, OPTIMIZER

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
    streamed = streamed_digests(path, "")
    if streamed is not None:
        return streamed
    return {
        name: tensor_digest(name, dtype, shape, raw) for name, dtype, shape, raw in iter_safetensors(path)
    }


# -- digests computed as a file is written --------------------------------------------------------

# The names a safetensors file's tensors are digested under (a prefix per use): a checkpoint's
# weights and AdamW moments enter its state digest as `model.*` and `optimizer.*`
# (`checkpoints.STATE_FILES`), a weights file its own digest bare.
HEAD_LIMIT = 1 << 20  # larger headers are left to the file's reader
STREAM_PREFIXES = {MODEL: ("", "model."), FROZEN: ("", "model."), OPTIMIZER: ("optimizer.",)}


class TensorStream:
    """The tensor digests of a safetensors file, computed from its bytes as they are written (a
    pull hashes each piece as it arrives), so that checking the digests a manifest declares does
    not read the file again: a pull's check of a 72 MB train output spent 10 ms on that second
    pass. The same digests `iter_safetensors` would give, or none at all (`digests` None) for
    anything it would refuse or that is not plain: then the file is read as before."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        self.head = bytearray()
        self.offset = 0  # bytes seen
        self.start = 0  # where the tensor data starts
        self.tensors: list[tuple[str, int, int, list[Any]]] | None = None  # name, begin, end, hashers
        self.failed = False

    @classmethod
    def for_file(cls, path: Path) -> TensorStream | None:
        if path.suffix != ".safetensors":
            return None
        return cls(STREAM_PREFIXES.get(path.name, ("",)))

    def update(self, piece: Any) -> None:
        if self.failed:
            return
        view = memoryview(piece).cast("B")
        if self.tensors is None and not self._read_header(view):
            self.offset += len(view)
            return
        first, last = self.offset, self.offset + len(view)
        for _, begin, end, hashers in self.tensors or ():
            low, high = max(begin, first), min(end, last)
            if low < high:
                part = view[low - first : high - first]
                for hasher in hashers:
                    hasher.update(part)
        self.offset = last

    def _read_header(self, view: memoryview) -> bool:
        """Collect the header from the first pieces: True once the tensors are known."""
        self.head += view[: max(0, 8 + HEAD_LIMIT - len(self.head))]  # never a whole file here
        if len(self.head) < 8:
            return False
        size = 0
        try:
            size = header_size(bytes(self.head[:8]), "stream")
            if len(self.head) < 8 + size:
                self.failed = size > HEAD_LIMIT  # a header this large: left to the file's reader
                return False
            header = decode_header(self.head[8 : 8 + size], size, "stream")
            entries = list(tensor_entries(header, 8 + size))
            plain = all(type(begin) is int and type(end) is int for *_, begin, end in entries)
            self.tensors = [
                (
                    name,
                    begin,
                    end,
                    [blake3.blake3(_identity(p + name, dtype, tuple(shape))) for p in self.prefixes],
                )
                for name, dtype, shape, begin, end in entries
            ]
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
            plain = False
        self.failed, self.head, self.start = not plain, bytearray(), 8 + size
        return plain

    def digests(self, prefix: str) -> dict[str, str] | None:
        """{prefix + name: digest} once the whole file was seen; None unless it is all plain."""
        if self.failed or self.tensors is None or prefix not in self.prefixes:
            return None
        at = self.prefixes.index(prefix)
        if not all(self.start <= begin <= end <= self.offset for _, begin, end, _ in self.tensors):
            return None  # a tensor outside the file: `iter_safetensors` names it
        return {prefix + name: hashers[at].hexdigest() for name, _, _, hashers in self.tensors}


# Streams of files written and checked by a pull, by path, with the (size, mtime, inode) they had
# then: looked up only while that file is unchanged, and forgotten when the pull ends.
_STREAMED: dict[str, tuple[tuple[int, int, int], TensorStream]] = {}


def _signature(path: Path) -> tuple[int, int, int]:
    found = os.stat(path)
    return found.st_size, found.st_mtime_ns, found.st_ino


def remember(path: Path, stream: TensorStream) -> None:
    """Record the stream of a file whose every byte it saw, as written and found whole."""
    _STREAMED[os.path.abspath(path)] = (_signature(path), stream)


def forget(folder: Path) -> None:
    """Drop every stream remembered under `folder`."""
    inside = os.path.join(os.path.abspath(folder), "")
    for key in [key for key in list(_STREAMED) if key.startswith(inside)]:
        _STREAMED.pop(key, None)


def streamed_digests(path: Path, prefix: str) -> dict[str, str] | None:
    """The digests a pull computed of `path` as it wrote it, while the file is unchanged."""
    found = _STREAMED.get(os.path.abspath(path))
    try:
        if found is None or found[0] != _signature(path):
            return None
    except OSError:
        return None
    return found[1].digests(prefix)


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
