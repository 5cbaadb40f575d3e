"""Data files in a bucket: found and hashed at plan time, fetched into the store at run time.

Plan time (`expand`, `digest`): an `s3://` entry of `data.files` is looked up (a HEAD for a key, a
listing of the prefix for a glob, matches in key order) and each object is hashed from its bytes,
streamed, never held whole. The blake3 and size are what enter the plan, exactly as for a file on
disk; the URL is only a hint in the plan's metadata. The stat cache remembers (URL, ETag, size,
last-modified) -> blake3, so planning again reads nothing while the object is unchanged: the ETag
only ever saves a download, it never stands in for the content.

Run time (`fetch`): the object is streamed into `cache/sources/<blake3>` under the store: written to
a temporary file in `tmp/`, hashed while written, fsynced, and renamed into place only when its
bytes are the planned ones; otherwise one line naming the URL ("changed since planning"), and
nothing is left behind. The data and tokenizer steps then read the cached file with their usual
readers (Parquet needs random access), which check the bytes once more as they read. A second
build of the same content takes the cached file without a download. `bt fsck` re-hashes the
folder; `bt gc` drops the files that no stored plan reads.

The S3 client (`sources/bucket.py`) is imported inside these functions, only for a preset that names one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from buildtrain.errors import StepFailed, UsageError
from buildtrain.sources.data_url import SCHEME, ObjectUrl, ObjectVersion, parse_object_url
from buildtrain.sources.durable import fsync_dir
from buildtrain.sources.stat_cache import SourceFile, StatCache

if TYPE_CHECKING:
    from buildtrain.sources.bucket import Bucket
    from buildtrain.store.store import Store


@functools.cache
def _bucket(name: str) -> Bucket:
    """One client per bucket and process (it keeps its connections)."""
    from buildtrain.sources.bucket import Bucket

    return Bucket(name)


def _endpoint() -> str:
    from buildtrain.sources.s3_settings import shown_endpoint

    return shown_endpoint()


def expand(pattern: str) -> tuple[list[ObjectVersion], str | None]:
    """The objects an `s3://` entry names (a key, or a glob's matches in key order), or why it
    names none: a problem for the preset's `data.files`, worded with the fix."""
    from buildtrain.sources.bucket import NoSuchBucket, NoSuchObject

    try:
        url = parse_object_url(pattern)
    except ValueError as exc:
        return [], f"'{pattern}': {exc}"
    bucket = _bucket(url.bucket)
    try:
        if not url.is_glob:
            return [bucket.version(url.key)], None
        found = [v for v in bucket.versions(url.listing_prefix()) if url.matches(_key(url, v.url))]
    except NoSuchBucket:
        return (
            [],
            f"'{pattern}': there is no bucket '{url.bucket}' at {_endpoint()}; check the name and AWS_ENDPOINT_URL",
        )
    except NoSuchObject:
        return [], f"'{pattern}': no such object in bucket '{url.bucket}'; check the key, or give a glob"
    if not found:
        return [], f"'{pattern}' matches no object in bucket '{url.bucket}'"
    return found, None


def _key(url: ObjectUrl, object_url: str) -> str:
    return object_url[len(f"{SCHEME}{url.bucket}/") :]


def digest(cache: StatCache, version: ObjectVersion) -> SourceFile:
    """The content of an object as a plan names it: remembered for this version, else read
    (streamed) and hashed. The version remembered is the one the read returned."""
    known = cache.object_digest(version)
    if known is not None:
        return known
    from buildtrain.sources.bucket import NoSuchBucket, NoSuchObject

    url = parse_object_url(version.url)
    try:
        read, pieces = _bucket(url.bucket).stream(url.key)
    except (NoSuchBucket, NoSuchObject):
        raise UsageError(f"{version.url}: gone while it was being planned; plan again") from None
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    size = 0
    for piece in pieces:
        hasher.update(piece)
        size += len(piece)
    cache.hashed_bytes += size
    source = SourceFile(blake3=hasher.hexdigest(), size=size)
    cache.remember_object(read, source)
    return source


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
                version, pieces = _bucket(parsed.bucket).stream(parsed.key)
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
