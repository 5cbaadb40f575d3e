"""Digests of data source files, hashed once: a stat cache keyed by (size, mtime, inode).

A second `bt plan` over gigabytes of data only stats the files. The cache is a cache, not an
object: it carries its own digest and is discarded (and rebuilt) if it does not verify, so a
damaged cache can cost time but never a wrong digest. Entries for files modified in the last
two seconds are not kept, since a write within the same timestamp tick could go unnoticed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from buildtrain.plan.canonical import canonical_bytes, digest
from buildtrain.plan.plan import SourceFile
from buildtrain.store.objects import hash_file, write_bytes_durably

CACHE_FORMAT = 1
RACY_SECONDS = 2.0


def _stat_key(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev]


class StatCache:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, Any] = {}
        self.dirty = False
        self.hashed_bytes = 0
        self.damaged = False
        if path.is_file():
            self._load()

    def _load(self) -> None:
        try:
            body = json.loads(self.path.read_bytes())
            claimed = body.pop("self")
            if body.get("format") != CACHE_FORMAT or claimed != digest("stat-cache", body):
                raise ValueError("digest mismatch")
            self.entries = body["entries"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.entries = {}
            self.damaged = True
            self.dirty = True

    def digest_of(self, path: Path) -> SourceFile:
        real = os.path.realpath(path)
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
        if not self.dirty:
            return
        body: dict[str, Any] = {"format": CACHE_FORMAT, "entries": self.entries}
        body["self"] = digest("stat-cache", body)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_durably(self.path, canonical_bytes(body))
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
