"""Digests of data source files, hashed once: a stat cache keyed by (size, mtime, inode, device,
ctime), and for objects in a bucket by (URL, ETag, size, last-modified).

A second `bt plan` over gigabytes of data only stats the files. The cache is a cache, not an
object: it carries its own digest and is discarded (and rebuilt) if it does not verify, so a
damaged cache can cost time but never a wrong digest. Entries for files modified in the last
two seconds are not kept, since a write within the same timestamp tick could go unnoticed. The
ctime is in the key because a file edited in place and given back its size and mtime still has a
new ctime (the kernel sets it on every write and on every change of mtime).

Data files are untrusted: only regular files are read. A FIFO would block the reader forever and a
link to /dev/zero never ends, so every read here (and in the steps, through `open_regular`) checks
the kind of file first and again on the open descriptor, never waiting on the file to open.
"""

from __future__ import annotations

import json
import mmap
import os
import stat as stat_module
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import blake3

from buildtrain.errors import BuildtrainError
from buildtrain.sources.data_url import ObjectVersion
from buildtrain.sources.durable import MMAP_THRESHOLD, framed, unframed, write_bytes_durably
from buildtrain.sources.regular import NotRegularFile, kind_of, open_regular

CACHE_FORMAT = 3  # 3: ctime in the key
RACY_SECONDS = 2.0


@attrs.frozen
class SourceFile:
    """A data file as a plan sees it: its content, never its name or place."""

    blake3: str
    size: int


def hash_regular(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(blake3 hex, size) of a regular file's bytes, read through `open_regular`."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size >= MMAP_THRESHOLD:  # large files: mapped and hashed on every core
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                hasher.update(mapped)
            return hasher.hexdigest(), size
        hasher = blake3.blake3()
        size = 0
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
            size += len(chunk)
        return hasher.hexdigest(), size


def _stat_key(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev, stat.st_ctime_ns]


class StatCache:
    def __init__(
        self,
        path: Path,
        set_aside: Callable[[Path], object] | None = None,
        folder: Callable[[Path], object] | None = None,
    ) -> None:
        self.path = path
        self._folder = folder  # makes the cache's folder: the store's, which refuses a link there
        self.entries: dict[str, Any] = {}
        # Small facts derived from a file's content, by its blake3 (a tokenizer's vocabulary):
        # parsing a 10 MB tokenizer.json took 200-300 ms of every `bt plan` here.
        self.derived: dict[str, Any] = {}
        # Objects in a bucket by URL: the version hashed (ETag, size, last-modified) and its blake3.
        # A hint that saves a download at plan time; the run re-checks the bytes it fetches.
        self.objects: dict[str, Any] = {}
        self.dirty = False
        self.hashed_bytes = 0
        self.damaged = False
        self._set_aside = set_aside  # moves a folder or link found in the cache's place
        if path.is_symlink() or (os.path.lexists(path) and not path.is_file()):
            self.damaged = self.dirty = True
        elif path.is_file():
            self._load()

    def _load(self) -> None:
        try:
            raw = unframed(self.path.read_bytes())  # the body under its own digest line
            if raw is None:
                raise ValueError("digest mismatch")
            body = json.loads(raw)
            if body.get("format") != CACHE_FORMAT:
                raise ValueError("unknown format")
            entries = body["entries"]
            if not isinstance(entries, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("blake3"), str) and isinstance(e.get("stat"), list)
                for e in entries.values()
            ):
                raise ValueError("malformed entries")
            self.entries = entries
            derived = body.get("derived", {})
            self.derived = derived if isinstance(derived, dict) else {}
            objects = body.get("objects", {})
            if isinstance(objects, dict) and all(isinstance(e, dict) for e in objects.values()):
                self.objects = objects
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.entries = {}
            self.damaged = True
            self.dirty = True

    def digest_of(self, path: Path) -> SourceFile:
        real = os.path.abspath(path)  # the stat below identifies the file; no need to resolve links
        stat = os.stat(real)
        if not stat_module.S_ISREG(stat.st_mode):
            raise NotRegularFile(path, stat.st_mode)
        entry = self.entries.get(real)
        if entry is not None and entry["stat"] == _stat_key(stat):
            return SourceFile(blake3=entry["blake3"], size=stat.st_size)
        file_digest, size = hash_regular(real)
        self.hashed_bytes += size
        if time.time() - stat.st_mtime > RACY_SECONDS:
            self.entries[real] = {"stat": _stat_key(stat), "blake3": file_digest}
            self.dirty = True
        return SourceFile(blake3=file_digest, size=size)

    def derived_fact(self, kind: str, source: SourceFile) -> Any:
        """A fact of `kind` remembered for the content `source`, or None."""
        return self.derived.get(f"{kind}:{source.blake3}")

    def remember(self, kind: str, content: bytes, source: SourceFile, fact: Any) -> None:
        """Remember `fact` (JSON), derived from `content`, if `content` is what `source` names: a
        file that changed between its digest and its reading is not remembered under either."""
        if blake3.blake3(content).hexdigest() == source.blake3 and len(content) == source.size:
            self.derived[f"{kind}:{source.blake3}"] = fact
            self.dirty = True

    def object_digest(self, version: ObjectVersion) -> SourceFile | None:
        """The content last hashed for this version of an object, if the cache has it."""
        entry = self.objects.get(version.url)
        if not version.etag or not isinstance(entry, dict) or not isinstance(entry.get("blake3"), str):
            return None  # a server that gives no ETag is re-read every time
        if {key: entry.get(key) for key in ("etag", "size", "modified")} != {
            "etag": version.etag,
            "size": version.size,
            "modified": version.modified,
        }:
            return None
        return SourceFile(blake3=entry["blake3"], size=version.size)

    def remember_object(self, version: ObjectVersion, source: SourceFile) -> None:
        """Remember that `version` of an object held `source` (hashed from its bytes)."""
        if version.size == source.size:
            self.objects[version.url] = {**attrs.asdict(version), "blake3": source.blake3}
            self.dirty = True

    def paths_with(self, blake3_hex: str) -> list[str]:
        return [path for path, entry in self.entries.items() if entry["blake3"] == blake3_hex]

    def save(self) -> None:
        """Write the cache back; best effort, since it is only a cache (a read-only store, say)."""
        if not self.dirty:
            return
        body = {"format": CACHE_FORMAT, "entries": self.entries, "derived": self.derived}
        if self.objects:  # only when used: a cache written before buckets keeps its bytes
            body["objects"] = self.objects
        raw = json.dumps(body, separators=(",", ":")).encode()
        try:
            if self._folder is not None:
                self._folder(self.path.parent)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_symlink() or self.path.is_dir():
                if self._set_aside is None:
                    return
                self._set_aside(self.path)
            write_bytes_durably(self.path, framed(raw))
        except (OSError, BuildtrainError):  # read-only, a link in the folder's place, not a store
            return
        self.dirty = False


def locate(cache: StatCache, source: SourceFile, hints: list[str]) -> Path | None:
    """A path whose current content is `source`: the plan's recorded paths first, then any path
    the stat cache has seen with that digest (a moved or renamed file is still found)."""
    for candidate in [*hints, *cache.paths_with(source.blake3)]:
        try:
            if cache.digest_of(Path(candidate)) == source:
                return Path(candidate)
        except OSError:
            continue
    return None


def whereabouts(source: SourceFile, hints: list[str]) -> str:
    """Why `locate` found no file with `source`'s content, for a message: what is at the paths
    the plan recorded now (changed, not a regular file, or gone)."""
    planned = f"blake3 {source.blake3[:16]}…, {source.size} bytes"
    for hint in hints:
        try:
            info = os.stat(hint)
        except (OSError, ValueError):
            continue
        if not stat_module.S_ISREG(info.st_mode):
            return f"the data file {hint} is now {kind_of(info.st_mode)}, not a regular file (planned: {planned})"
        return (
            f"the data file {hint} changed since planning ({planned} when planned, {info.st_size} bytes now)"
        )
    where = ", ".join(hints) or "unknown"
    return f"a data file ({planned}) is gone (it was at {where})"
