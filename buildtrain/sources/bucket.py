"""Reading data files from an S3-compatible bucket, through obstore (see `s3.py` for why obstore and
how the AWS_* variables configure it). Read-only: versions (HEAD), listings and streamed reads.

Imported only once a preset names an `s3://` data file: `bt plan presets/tiny.toml` and a null
build never load it. Every failure is sorted into what the user can act on: no such bucket or
object (`NoSuchBucket`, `NoSuchObject`, which the caller words for plan or run time), and no
credentials or an endpoint that cannot be reached (`RemoteUnavailable`, one line naming the URL
and the variables to check).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from buildtrain.errors import RemoteUnavailable
from buildtrain.sources.data_url import ObjectVersion
from buildtrain.sources.s3_settings import CHUNK, credentials_problem, redact, shown_endpoint, store_options

try:
    import obstore
    from obstore.exceptions import BaseError, PermissionDeniedError, UnauthenticatedError
    from obstore.store import S3Store
except ImportError as missing:  # the optional extra is not installed
    raise RemoteUnavailable(
        f"an s3:// data file needs obstore, which is not installed ({missing}); "
        "install it with: pip install 'buildtrain[remote]'"
    ) from None

# What obstore's messages say when the credentials were refused (with none at all, `Bucket` stops
# before asking the instance metadata service: s3_settings.py).
NO_CREDENTIALS = ("169.254.169.254", "credential", "InvalidAccessKeyId", "SignatureDoesNotMatch")
UNREACHABLE = ("error sending request", "connection", "dns error", "timed out")


class NoSuchBucket(Exception):
    """The bucket does not exist (or the credentials cannot see it)."""


class NoSuchObject(Exception):
    """No object under the key."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return redact(text)[:240]


def unavailable(url: str, exc: BaseException) -> RemoteUnavailable:
    """One line for a failure that is neither a missing bucket nor a missing object."""
    text, endpoint = str(exc), shown_endpoint()
    if isinstance(exc, UnauthenticatedError | PermissionDeniedError) or any(
        marker in text for marker in NO_CREDENTIALS
    ):
        return RemoteUnavailable(
            f"{url}: no usable credentials for the bucket ({_first_line(exc)}); "
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_REGION)"
        )
    if any(marker in text.lower() for marker in UNREACHABLE):
        return RemoteUnavailable(
            f"{url}: cannot reach the S3 endpoint {endpoint} ({_first_line(exc)}); "
            "check AWS_ENDPOINT_URL and the network"
        )
    return RemoteUnavailable(
        f"{url}: the bucket refused the request ({_first_line(exc)}); check AWS_ENDPOINT_URL, "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION"
    )


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
        # Without credentials no client is built (it would ask the instance metadata service);
        # the first request says so, naming the object it was for.
        self.problem = credentials_problem()
        if self.problem:
            return
        try:
            self.store = S3Store(name, **store_options())
        except BaseError as exc:
            raise unavailable(f"s3://{name}", exc) from None

    def url_of(self, key: str) -> str:
        return f"s3://{self.name}/{key}"

    def _client(self, key: str) -> Any:
        if self.problem:
            raise RemoteUnavailable(
                f"{self.url_of(key)}: no usable credentials for the bucket: {self.problem}"
            )
        return self.store

    def _missing(self, key: str) -> Exception:
        """NoSuchBucket or NoSuchObject, for a key the server did not find (a HEAD or GET of an
        object in a missing bucket is a plain 404 too: a listing tells them apart)."""
        try:
            next(iter(obstore.list(self._client(key), None, chunk_size=1)), None)
        except (BaseError, OSError) as exc:
            if "NoSuchBucket" in str(exc):
                return NoSuchBucket(self.name)
            return unavailable(self.url_of(key), exc)
        return NoSuchObject(key)

    def version(self, key: str) -> ObjectVersion:
        """The object's version (a HEAD request)."""
        try:
            return _version(self.url_of(key), obstore.head(self._client(key), key))
        except FileNotFoundError:
            raise self._missing(key) from None
        except (BaseError, OSError) as exc:
            raise unavailable(self.url_of(key), exc) from None

    def versions(self, prefix: str) -> list[ObjectVersion]:
        """Every object under the folder-like `prefix` ('' for the whole bucket), sorted by key;
        keys ending in '/' (folder markers some tools write) are left out."""
        found = []
        try:
            for batch in obstore.list(self._client(prefix), prefix or None, chunk_size=1000):
                found += [meta for meta in batch if not str(meta["path"]).endswith("/")]
        except (BaseError, OSError) as exc:
            if "NoSuchBucket" in str(exc):
                raise NoSuchBucket(self.name) from None
            raise unavailable(self.url_of(prefix), exc) from None
        return [_version(self.url_of(meta["path"]), meta) for meta in sorted(found, key=lambda m: m["path"])]

    def stream(self, key: str) -> tuple[ObjectVersion, Iterator[bytes]]:
        """The version being read and its bytes in pieces of about `CHUNK` (never whole)."""
        try:
            result = obstore.get(self._client(key), key)
        except FileNotFoundError:
            raise self._missing(key) from None
        except (BaseError, OSError) as exc:
            raise unavailable(self.url_of(key), exc) from None
        return _version(self.url_of(key), result.meta), self._pieces(key, result.stream(min_chunk_size=CHUNK))

    def _pieces(self, key: str, pieces: Any) -> Iterator[bytes]:
        try:
            yield from pieces  # obstore's Bytes: a buffer, hashed and written without a copy
        except (BaseError, OSError) as exc:
            raise unavailable(self.url_of(key), exc) from None
