"""The narrow interface every remote back end implements: objects are bytes under '/'-separated
keys. Nothing above this file knows whether the keys live in a bucket or in a folder.

A back end checks nothing about content (the protocol in `remote.py` does); it reports a missing
object as `ObjectMissing`, a create-only write that lost as `AlreadyExists`, and anything else it
cannot do (no credentials, no bucket, no network) as `RemoteUnavailable`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from buildtrain.store.remote.url import RemoteUrl


class ObjectMissing(KeyError):
    """No object under this key."""


class AlreadyExists(Exception):
    """A create-only write found an object under its key."""


class Backend(Protocol):
    url: RemoteUrl

    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectMissing when there is none."""
        ...

    def stream(self, key: str) -> Iterator[bytes | memoryview]:
        """The object's bytes in pieces (for large objects: a download writes and hashes each
        piece as it arrives); ObjectMissing, raised before the first piece, when there is none.
        A piece may be a view of a buffer that the next piece reuses: use it before the next."""
        ...

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        """Write the object whole (readers never see a part of it). `create_only`: raise
        AlreadyExists instead of replacing an object already there."""
        ...

    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file's bytes under `key`, replacing whatever is there."""
        ...

    def exists(self, key: str) -> int | None:
        """The object's size, or None when there is none."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Every key under the folder-like `prefix` (`plans` lists `plans/...`), sorted."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object; no error when there is none."""
        ...
