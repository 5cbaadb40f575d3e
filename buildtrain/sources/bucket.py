"""Reading data files from an S3-compatible bucket, through the one S3 client (`s3_client.py`, which
says why obstore and how the AWS_* variables configure it). Read-only: versions (HEAD), listings
and streamed reads.

Imported only once a preset names an `s3://` data file: `bt plan presets/tiny.toml` and a null
build never load it. Every failure is sorted by the client: no such bucket or object
(`NoSuchBucket`, `NoSuchObject`, which the caller words for plan or run time), and anything else
(`RemoteUnavailable`, one line naming the object's URL and the variables to check).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from buildtrain.sources.data_url import ObjectVersion
from buildtrain.sources.s3_client import NoSuchBucket, NoSuchObject, S3Client

__all__ = ["Bucket", "NoSuchBucket", "NoSuchObject"]


def _version(url: str, meta: Any) -> ObjectVersion:
    modified = meta["last_modified"]
    return ObjectVersion(
        url=url,
        etag=str(meta.get("e_tag") or ""),
        size=int(meta["size"]),
        modified=modified.isoformat() if isinstance(modified, datetime) else str(modified),
    )


class Bucket:
    """One bucket, configured from the environment; `url_of(key)` names an object in messages."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.client = S3Client(name)

    def url_of(self, key: str) -> str:
        return f"s3://{self.name}/{key}"

    def version(self, key: str) -> ObjectVersion:
        """The object's version (a HEAD request)."""
        url = self.url_of(key)
        return _version(url, self.client.head(url, key))

    def versions(self, prefix: str) -> list[ObjectVersion]:
        """Every object under the folder-like `prefix` ('' for the whole bucket), sorted by key;
        keys ending in '/' (folder markers some tools write) are left out."""
        found = self.client.list(self.url_of(prefix), prefix or None)
        kept = sorted(
            (meta for meta in found if not str(meta["path"]).endswith("/")), key=lambda m: m["path"]
        )
        return [_version(self.url_of(meta["path"]), meta) for meta in kept]

    def stream(self, key: str) -> tuple[ObjectVersion, Iterator[bytes]]:
        """The version being read and its bytes in pieces of about `CHUNK` (never whole)."""
        url = self.url_of(key)
        meta, pieces = self.client.stream(url, key)
        return _version(url, meta), pieces
