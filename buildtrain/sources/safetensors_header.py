"""The header of a safetensors file, read with a small parser (no torch, no pickle): its length in
the first 8 bytes, then a JSON object, checked as untrusted input. The config reads a pretrained
model's shapes through it and the store its tensors (`store/tensors.py`, the digests).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MAX_HEADER = 100 << 20


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of a safetensors file and the offset where tensor data starts."""
    with open(path, "rb") as handle:
        size = header_size(handle.read(8), path.name)
        raw = handle.read(size)
    return decode_header(raw, size, path.name), 8 + size


def header_size(prefix: bytes, label: str) -> int:
    """The header's length from a safetensors file's first 8 bytes (little-endian u64)."""
    if len(prefix) != 8:
        raise ValueError(f"{label}: too short for safetensors")
    (size,) = struct.unpack("<Q", prefix)
    if size > MAX_HEADER:
        raise ValueError(f"{label}: safetensors header of {size} bytes is implausible")
    return int(size)


def decode_header(raw: bytes | memoryview, size: int, label: str) -> dict[str, Any]:
    """The JSON header of `size` bytes, read as `raw`: an object, or a ValueError naming `label`."""
    if len(raw) != size:
        raise ValueError(f"{label}: truncated safetensors header")
    try:
        header = json.loads(bytes(raw))
    except RecursionError:  # inputs are untrusted: a crafted header must be rejected, not crash
        raise ValueError(f"{label}: safetensors header is nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError(f"{label}: safetensors header is not UTF-8") from None
    if not isinstance(header, dict):
        raise ValueError(f"{label}: safetensors header is not an object")
    return header
