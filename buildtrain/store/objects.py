"""Immutable directories with a manifest: how every output and checkpoint is written and trusted.

A directory is built under a temporary name, every file is fsynced, then `MANIFEST.json` (the
blake3 and size of every file, the name the directory is published under, plus its own digest) is
written last, the directory is renamed into place and the parent is fsynced. A directory counts only
if its manifest verifies, so a crash at any point leaves either the old state or the complete new
one, never something half-written that loads. The recorded name binds the content to the place it is
found: another object copied, renamed or linked into that place does not verify.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import blake3

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.sources.durable import MMAP_THRESHOLD, fsync_dir

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 2  # 2: the manifest records the name it is sealed for


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


def append_flushed(handle: IO[Any], data: str | bytes) -> None:
    """Append to an open record file and flush, naming the file when that fails: a full disk's
    error carries no name of its own (it read "cannot use: No space left on device")."""
    try:
        handle.write(data)
        handle.flush()
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, handle.name) from None


def _entries(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative name, path) of everything under `root`, without following symbolic links."""
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted([*dirs, *names]):
            path = Path(folder) / name
            yield path.relative_to(root).as_posix(), path


def _files(root: Path) -> Iterator[Path]:
    for relative, path in _entries(root):
        if relative != MANIFEST and path.is_file() and not path.is_symlink():
            yield path


def _manifest_body(files: Mapping[str, Any], digests: Mapping[str, str], name: str) -> dict[str, Any]:
    return {"format": MANIFEST_FORMAT, "name": name, "files": dict(files), "digests": dict(digests)}


def seal(root: Path, digests: Mapping[str, str] | None = None, *, name: str | None = None) -> dict[str, Any]:
    """fsync every file of `root`, then write its manifest last. Returns the manifest body.

    `name` is the folder name the directory will be found under (default: its current name);
    `verify` refuses the directory under any other name.
    """
    files: dict[str, Any] = {}
    for path in _files(root):
        fsync_file(path)
        file_digest, size = hash_file(path)
        files[path.relative_to(root).as_posix()] = {"blake3": file_digest, "size": size}
    body = _manifest_body(files, digests or {}, name if name is not None else root.name)
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
    return parse_manifest((root / MANIFEST).read_bytes())


def parse_manifest(raw: bytes) -> dict[str, Any]:
    """`read_manifest` of a manifest's bytes (a remote's copy, before any folder holds it)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"manifest is not valid JSON ({exc})") from None
    if isinstance(body, dict) and isinstance(body.get("format"), int) and body["format"] < MANIFEST_FORMAT:
        raise ValueError(
            f"manifest format {body['format']}, written by an older buildtrain (bound to no name)"
        )
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        raise ValueError("manifest has an unknown format")
    if not all(
        isinstance(body.get(key), kind) for key, kind in (("name", str), ("files", dict), ("digests", dict))
    ):
        raise ValueError("manifest has an unknown format")
    claimed = body.pop("self", None)
    try:
        intact = claimed == digest("manifest", body) and canonical_bytes({**body, "self": claimed}) == raw
    except (TypeError, ValueError):  # a value with no canonical encoding was never sealed by us
        intact = False
    if not intact:
        raise ValueError("manifest does not match its own digest")
    return body


def manifest_self(raw: bytes) -> str | None:
    """A manifest's own digest (what names one build of a folder), or None when it is damaged."""
    try:
        parse_manifest(raw)
        return str(json.loads(raw)["self"])
    except (ValueError, KeyError, TypeError):
        return None


def sealed_digests(root: Path) -> dict[str, str]:
    """The logical digests a sealed folder declares (what `bt verify` compares)."""
    return read_manifest(root)["digests"]


def sealed_files(root: Path) -> dict[str, str]:
    """The blake3 of every file the manifest of a sealed folder lists, by relative path (true of
    the bytes on disk once `verify` found no problem)."""
    return {name: entry["blake3"] for name, entry in read_manifest(root)["files"].items()}


def verify(root: Path, *, contents: bool = True) -> list[str]:
    """Problems with a sealed directory: an empty list means it is complete and intact.

    With `contents=False` only presence and sizes are checked (cheap, for listings). Symbolic
    links and anything that is neither a file nor a folder are problems: an object holds its own
    bytes. Never raises for what it finds on disk.
    """
    if root.is_symlink():
        return ["is a symbolic link, not a sealed folder (foreign)"]
    if not root.is_dir():
        return ["is not a folder"]
    manifest = root / MANIFEST
    if manifest.is_symlink() or not manifest.is_file():
        return ["no manifest (incomplete or not sealed)"]
    try:
        body = read_manifest(root)
    except (OSError, ValueError) as exc:
        return [str(exc)]
    if body["name"] != root.name:
        return [f"sealed as {body['name'][:24]}, found under {root.name[:24]} (a foreign object)"]
    problems = []
    listed = body["files"]
    present: dict[str, Path] = {}
    try:
        for relative, path in _entries(root):
            if path.is_symlink():
                problems.append(f"{relative}: a symbolic link (foreign)")
            elif path.is_file():
                if relative != MANIFEST:
                    present[relative] = path
            elif not path.is_dir():
                problems.append(f"{relative}: not a regular file")
    except OSError as exc:
        return [f"unreadable ({exc.strerror or exc})"]
    for name in sorted(set(present) - set(listed)):
        problems.append(f"{name}: not in the manifest")
    for name, entry in sorted(listed.items()):
        path = present.get(name)
        if path is None:
            problems.append(f"{name}: missing")
            continue
        try:
            size = path.stat().st_size
            listed_size = entry.get("size") if isinstance(entry, dict) else None
            if size != listed_size:
                problems.append(f"{name}: size {size}, manifest says {listed_size}")
            elif contents and hash_file(path)[0] != entry.get("blake3"):
                problems.append(f"{name}: content does not match its blake3")
        except OSError as exc:
            problems.append(f"{name}: unreadable ({exc.strerror or exc})")
    return problems


def commit(temporary: Path, final: Path) -> None:
    """Rename a sealed directory into place and make the rename durable."""
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(temporary, final)
    fsync_dir(final.parent)


def publish(temporary: Path, final: Path, digests: Mapping[str, str] | None = None) -> None:
    """Seal a folder built under a temporary name and rename it into place: the one way a
    step output or a checkpoint comes into existence."""
    seal(temporary, digests, name=final.name)
    commit(temporary, final)


def remove_tree(path: Path) -> None:
    """Remove a folder, or a file or link in its place; a link is removed, never followed."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
        return
    shutil.rmtree(path, ignore_errors=True)


def link_tree(source: Path, target: Path) -> None:
    """Copy a folder by hard links where the file system allows (instant, and safe for files that
    are never written again, as everything in the store), else by copying."""
    for path in sorted(source.rglob("*")):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, destination)
        except OSError:  # another file system, or links not supported
            shutil.copy2(path, destination)
