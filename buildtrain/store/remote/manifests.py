"""What a remote's manifests say, read without trusting them: the files one lists (refused when
an entry could write outside its folder), whether an object already there is intact, and a short
description of one for a message. Pure functions of bytes: the remote is `remote.py`'s to ask.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from buildtrain.canonical import digest
from buildtrain.store import objects
from buildtrain.store.remote import keys


def json_object(raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    return body


def file_entries(listed: Mapping[str, Any]) -> dict[str, tuple[str, int]] | None:
    """relative path -> (blake3, size), or None when any entry could write outside the folder
    or is not a well-formed (blake3, size)."""
    files = {}
    for relative, entry in listed.items():
        parts = PurePosixPath(relative).parts
        if (
            not parts
            or "\0" in relative
            or any("/".join(parts[:end]) in listed for end in range(1, len(parts)))  # a file, and a folder
            or relative.startswith("/")
            or any(part in {"", ".", ".."} for part in relative.split("/"))
            or relative == objects.MANIFEST
            or not isinstance(entry, dict)
            or not isinstance(entry.get("blake3"), str)
            or not keys.HASH.match(entry["blake3"])
            or not isinstance(entry.get("size"), int)
            or entry["size"] < 0
        ):
            return None
        files[relative] = (entry["blake3"], entry["size"])
    return files


def sealed_intact(raw: bytes, name: str | None) -> bool:
    """Whether an object already on the remote is intact (an output manifest that names `name`,
    or a sealed checkpoint): intact and different means two builds disagree."""
    try:
        if name is not None:
            return objects.parse_manifest(raw)["name"] == name
        body = json_object(raw)
        claimed = body.pop("seal", None)
        return claimed == digest("remote-checkpoint", body)
    except (ValueError, TypeError):
        return False


def describe(raw: bytes) -> str:
    """A short description of a manifest's content: its declared digests, or its own digest."""
    try:
        body = json_object(raw)
        body = body.get("manifest", body)
        named = ", ".join(f"{k} {str(v)[:12]}" for k, v in sorted(body.get("digests", {}).items()))
        return named or f"manifest {str(body.get('self'))[:12]}"
    except (ValueError, TypeError, AttributeError):
        return "unreadable"
