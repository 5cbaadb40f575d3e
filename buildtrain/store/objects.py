"""Immutable directories with a manifest: how every output and checkpoint is written and trusted.

A directory is built under a temporary name, every file is fsynced, then `MANIFEST.json` (the
blake3 and size of every file, plus its own digest) is written last, the directory is renamed into
place and the parent is fsynced. A directory counts only if its manifest verifies, so a crash at any
point leaves either the old state or the complete new one, never something half-written that loads.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import blake3

from buildtrain.plan.canonical import canonical_bytes, digest

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
# Files this large are hashed through mmap on all cores; smaller ones are cheaper read directly.
MMAP_THRESHOLD = 8 << 20


def hash_file(path: Path) -> tuple[str, int]:
    """(blake3 hex, size) of a file's bytes."""
    size = path.stat().st_size
    if size >= MMAP_THRESHOLD:
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        hasher.update_mmap(str(path))
        return hasher.hexdigest(), size
    hasher = blake3.blake3()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
    return hasher.hexdigest(), size


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    """Write a file next to its final name, fsync it, rename it into place, fsync the folder."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


def _files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.relative_to(root).as_posix() != MANIFEST:
            yield path


def _manifest_body(files: Mapping[str, Any], digests: Mapping[str, str]) -> dict[str, Any]:
    return {"format": MANIFEST_FORMAT, "files": dict(files), "digests": dict(digests)}


def seal(root: Path, digests: Mapping[str, str] | None = None) -> dict[str, Any]:
    """fsync every file of `root`, then write its manifest last. Returns the manifest body."""
    files: dict[str, Any] = {}
    for path in _files(root):
        fsync_file(path)
        file_digest, size = hash_file(path)
        files[path.relative_to(root).as_posix()] = {"blake3": file_digest, "size": size}
    body = _manifest_body(files, digests or {})
    body["self"] = digest("manifest", body)
    manifest_path = root / MANIFEST
    with open(manifest_path, "wb") as handle:
        handle.write(canonical_bytes(body))
        handle.flush()
        os.fsync(handle.fileno())
    for folder in {p.parent for p in root.rglob("*")} | {root}:
        fsync_dir(folder)
    return body


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest body, checked against its own digest; raises ValueError when it is damaged."""
    raw = (root / MANIFEST).read_bytes()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"manifest is not valid JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        raise ValueError("manifest has an unknown format")
    claimed = body.pop("self", None)
    if claimed != digest("manifest", body) or canonical_bytes({**body, "self": claimed}) != raw:
        raise ValueError("manifest does not match its own digest")
    return body


def sealed_digests(root: Path) -> dict[str, str]:
    """The logical digests a sealed folder declares (what `bt verify` compares)."""
    return read_manifest(root)["digests"]


def verify(root: Path, *, contents: bool = True) -> list[str]:
    """Problems with a sealed directory: an empty list means it is complete and intact.

    With `contents=False` only presence and sizes are checked (cheap, for listings).
    """
    if not (root / MANIFEST).is_file():
        return ["no manifest (incomplete or not sealed)"]
    try:
        body = read_manifest(root)
    except (OSError, ValueError) as exc:
        return [str(exc)]
    problems = []
    listed = body["files"]
    present = {p.relative_to(root).as_posix(): p for p in _files(root)}
    for name in sorted(set(present) - set(listed)):
        problems.append(f"{name}: not in the manifest")
    for name, entry in sorted(listed.items()):
        path = present.get(name)
        if path is None:
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            problems.append(f"{name}: size {size}, manifest says {entry['size']}")
        elif contents and hash_file(path)[0] != entry["blake3"]:
            problems.append(f"{name}: content does not match its blake3")
    return problems


def commit(temporary: Path, final: Path) -> None:
    """Rename a sealed directory into place and make the rename durable."""
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(temporary, final)
    fsync_dir(final.parent)


def publish(temporary: Path, final: Path, digests: Mapping[str, str] | None = None) -> None:
    """Seal a folder built under a temporary name and rename it into place: the one way a
    step output or a checkpoint comes into existence."""
    seal(temporary, digests)
    commit(temporary, final)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
