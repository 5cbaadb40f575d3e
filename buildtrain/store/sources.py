"""Digests of data source files, hashed once: a stat cache keyed by (size, mtime, inode, device,
ctime).

A second `bt plan` over gigabytes of data only stats the files. The cache is a cache, not an
object: it carries its own digest and is discarded (and rebuilt) if it does not verify, so a
damaged cache can cost time but never a wrong digest. Entries for files modified in the last
two seconds are not kept, since a write within the same timestamp tick could go unnoticed. The
ctime is in the key because a file edited in place and given back its size and mtime still has a
new ctime (the kernel sets it on every write and on every change of mtime).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import BuildtrainError
from buildtrain.store.objects import framed, hash_file, unframed, write_bytes_durably

CACHE_FORMAT = 3  # 3: ctime in the key
RACY_SECONDS = 2.0


@attrs.frozen
class SourceFile:
    """A data file as a plan sees it: its content, never its name or place."""

    blake3: str
    size: int


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
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.entries = {}
            self.damaged = True
            self.dirty = True

    def digest_of(self, path: Path) -> SourceFile:
        real = os.path.abspath(path)  # the stat below identifies the file; no need to resolve links
        stat = os.stat(real)
        entry = self.entries.get(real)
        if entry is not None and entry["stat"] == _stat_key(stat):
            return SourceFile(blake3=entry["blake3"], size=stat.st_size)
        file_digest, size = hash_file(Path(real))
        self.hashed_bytes += size
        if time.time() - stat.st_mtime > RACY_SECONDS:
            self.entries[real] = {"stat": _stat_key(stat), "blake3": file_digest}
            self.dirty = True
        return SourceFile(blake3=file_digest, size=size)

    def paths_with(self, blake3_hex: str) -> list[str]:
        return [path for path, entry in self.entries.items() if entry["blake3"] == blake3_hex]

    def save(self) -> None:
        """Write the cache back; best effort, since it is only a cache (a read-only store, say)."""
        if not self.dirty:
            return
        raw = json.dumps({"format": CACHE_FORMAT, "entries": self.entries}, separators=(",", ":")).encode()
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
