"""Canonical bytes and digests: the one encoding every hash in buildtrain is computed over.

JSON with sorted keys, no whitespace, UTF-8, and floats in Python's shortest round-trip form, so
`1e-3` and `0.001` encode alike. Anything that would make two encodings of one value possible, or
one encoding of two values, is refused: NaN and infinities, non-string keys, and objects without a
defined encoding. Each digest is domain-separated by a tag so that a plan and a step with equal
bodies still hash differently.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import blake3

ENCODING_FORMAT = 1


class EncodingError(ValueError):
    """A value has no canonical encoding."""


def _normalize(value: Any, path: str) -> Any:
    # bool before int: bool is a subclass of int and must stay true/false.
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise EncodingError(f"{path or '$'}: {value!r} has no canonical encoding")
        return value + 0.0  # -0.0 == 0.0, so they must encode alike (adding +0.0 turns -0.0 into 0.0)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise EncodingError(f"{path or '$'}: key {key!r} is not a string")
            out[key] = _normalize(item, f"{path}.{key}" if path else key)
        return out
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return [_normalize(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise EncodingError(f"{path or '$'}: {type(value).__name__} has no canonical encoding")


def canonical_bytes(value: Any) -> bytes:
    """The canonical JSON encoding of plain data (dicts, lists, str, int, finite float, bool, None)."""
    return json.dumps(
        _normalize(value, ""),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def plain(value: Any) -> Any:
    """`value` as the plain JSON data its encoding decodes to (tuples become lists), so that an
    object built in memory equals the same object read back from the store."""
    return json.loads(canonical_bytes(value))


def digest(tag: str, value: Any) -> str:
    """Full 64-hex blake3 of `tag` and the canonical encoding of `value`."""
    hasher = blake3.blake3(f"buildtrain:{tag}:v{ENCODING_FORMAT}\0".encode())
    hasher.update(canonical_bytes(value))
    return hasher.hexdigest()
