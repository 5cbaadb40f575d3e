"""Data files in a bucket, found and hashed at plan time (`expand`, `digest`).

An `s3://` entry of `data.files` is looked up (a HEAD for a key, a listing of the prefix for a
glob, matches in key order) and each object is hashed from its bytes, streamed, never held whole.
The blake3 and size are what enter the plan, exactly as for a file on disk; the URL is only a hint
in the plan's metadata. The stat cache remembers (URL, ETag, size, last-modified) -> blake3, so
planning again reads nothing while the object is unchanged: the ETag only ever saves a download,
it never stands in for the content.

At run time the store fetches the object into its source cache (`store/source_cache.py`) through
the same client (`bucket_client`). The S3 client (`bucket.py` over `s3_client.py`) is imported
inside these functions, only for a preset that names one; the config's preflight and the planner
call them, so they live here below both, outside the team cache (`store/remote/`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import blake3

from buildtrain.errors import UsageError
from buildtrain.sources.data_url import SCHEME, ObjectUrl, ObjectVersion, parse_object_url
from buildtrain.sources.stat_cache import SourceFile, StatCache

if TYPE_CHECKING:
    from buildtrain.sources.bucket import Bucket


@functools.cache
def bucket_client(name: str) -> Bucket:
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
    bucket = bucket_client(url.bucket)
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
        read, pieces = bucket_client(url.bucket).stream(url.key)
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
