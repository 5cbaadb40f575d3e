"""A remote on S3-compatible object storage (`s3://bucket/prefix`), through the one S3 client
(`sources/s3_client.py`: why obstore, how the AWS_* variables configure it, how failures are sorted
and worded). This back end only names its requests and maps the client's answers onto the back-end
interface (`backend.py`). Imported only here: a `bt plan` or a null build never loads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from buildtrain.errors import RemoteUnavailable
from buildtrain.sources.s3_client import AlreadyExists as Exists
from buildtrain.sources.s3_client import NoSuchBucket, NoSuchObject, S3Client, no_bucket
from buildtrain.sources.s3_settings import shown_endpoint
from buildtrain.store.remote.backend import AlreadyExists, ObjectMissing
from buildtrain.store.remote.url import RemoteUrl


class S3Backend:
    def __init__(self, url: RemoteUrl) -> None:
        self.url = url
        self.subject = f"remote {url}"
        self.client = S3Client(url.location, url.prefix or None, subject=self.subject)
        if self.client.problem:  # never the instance metadata service unless asked (s3_settings.py)
            raise RemoteUnavailable(f"remote {url} at {shown_endpoint()}: {self.client.problem}")

    @contextlib.contextmanager
    def _answers(self, key: str) -> Iterator[None]:
        """The client's answers as the back-end interface names them."""
        try:
            yield
        except NoSuchObject:
            raise ObjectMissing(key) from None
        except Exists:
            raise AlreadyExists(key) from None
        except NoSuchBucket:
            raise no_bucket(self.subject, self.url.location) from None

    def get(self, key: str) -> bytes:
        with self._answers(key):
            return self.client.read(self.subject, key)

    def stream(self, key: str) -> Iterator[bytes]:
        with self._answers(key):
            _, pieces = self.client.stream(self.subject, key)
        return pieces

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        with self._answers(key):
            self.client.put(self.subject, key, data, create_only=create_only)

    def put_file(self, key: str, path: Path) -> None:
        # Large files go up in parts (obstore's multipart upload); the object appears whole.
        with self._answers(key):
            self.client.put(self.subject, key, path)

    def exists(self, key: str) -> int | None:
        try:
            with self._answers(key):
                return int(self.client.head(self.subject, key)["size"])
        except ObjectMissing:
            return None

    def list(self, prefix: str) -> list[str]:
        with self._answers(prefix):
            return sorted(meta["path"] for meta in self.client.list(self.subject, prefix))

    def delete(self, key: str) -> None:
        with contextlib.suppress(ObjectMissing), self._answers(key):
            self.client.delete(self.subject, key)
