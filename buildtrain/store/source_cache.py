"""The store's copies of data files fetched from a bucket (`cache/sources/<blake3>`), at run time.

`fetch` streams the object into `cache/sources/<blake3>` under the store: written to a temporary
file in `tmp/`, hashed while written, fsynced, and renamed into place only when its bytes are the
planned ones; otherwise one line naming the URL ("changed since planning"), and nothing is left
behind. The data and tokenizer steps then read the cached file with their usual readers (Parquet
needs random access), which check the bytes once more as they read. A second build of the same
content takes the cached file without a download (`cached`). `bt fsck` re-hashes the folder;
`bt gc` drops the files that no stored plan reads. Planning (finding and hashing the objects) is
`sources/bucket_sources.py`, whose client this reuses; the S3 client is imported inside these
functions, only for a plan that reads a bucket.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from buildtrain.errors import StepFailed
from buildtrain.sources.bucket_sources import bucket_client
from buildtrain.sources.data_url import parse_object_url
from buildtrain.sources.durable import fsync_dir
from buildtrain.sources.stat_cache import SourceFile, StatCache

if TYPE_CHECKING:
    from buildtrain.store.store import Store


def cached(store: Store, cache: StatCache, source: SourceFile) -> Path | None:
    """The store's copy of a fetched data file with `source`'s content, if it holds a sound one; a
    copy that does not hash to its name is removed (it is fetched again)."""
    path = store.source_cache / source.blake3
    if not os.path.lexists(path):
        return None
    with contextlib.suppress(OSError):
        if not path.is_symlink() and cache.digest_of(path) == source:
            return path
    store.set_aside(path, keep=False)
    return None


def fetch(store: Store, source: SourceFile, url: str) -> Path:
    """Stream the object at `url` into the store's source cache under its blake3, which must be
    `source`'s (else StepFailed naming the URL, and nothing is kept)."""
    from buildtrain.sources.bucket import NoSuchBucket, NoSuchObject

    parsed = parse_object_url(url)
    target = store.folder(store.source_cache) / source.blake3
    fd, temporary = tempfile.mkstemp(prefix="source.", dir=store.folder(store.tmp))
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                version, pieces = bucket_client(parsed.bucket).stream(parsed.key)
            except (NoSuchBucket, NoSuchObject):
                raise StepFailed(
                    f"{url}: no such object any more ({_planned(source)} when planned); restore it, or plan again"
                ) from None
            found, count = _copy(pieces, out, source.size)
            out.flush()
            os.fsync(out.fileno())
        if (found, count) != (source.blake3, source.size):
            raise StepFailed(
                f"{url}: changed since planning ({_planned(source)} when planned, {version.size} bytes "
                "now); nothing was published: re-plan (bt plan PRESET) to build the new content"
            )
        os.replace(temporary, target)
        fsync_dir(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return target


def _copy(pieces: Any, out: Any, limit: int) -> tuple[str, int]:
    """Write and hash the pieces; stop once past `limit` bytes (an object that grew is refused
    without being read to its end). (blake3 hex, bytes seen)."""
    hasher = blake3.blake3()
    count = 0
    for piece in pieces:
        count += len(piece)
        if count > limit:
            break
        hasher.update(piece)
        out.write(piece)
    return hasher.hexdigest(), count


def _planned(source: SourceFile) -> str:
    return f"blake3 {source.blake3[:16]}…, {source.size} bytes"
