"""Which back end serves a remote URL. It sits above the back ends (`folder.py`, `s3.py`) and the
interface they implement (`backend.py`), so that the interface imports neither of them."""

from __future__ import annotations

from buildtrain.store.remote.backend import Backend
from buildtrain.store.remote.url import RemoteUrl, parse_url


def open_backend(url: str | RemoteUrl) -> Backend:
    """The back end for a remote URL. The S3 client is imported here, only for an s3:// remote."""
    parsed = parse_url(url) if isinstance(url, str) else url
    if parsed.scheme == "file":
        from buildtrain.store.remote.folder import FolderBackend

        return FolderBackend(parsed)
    from buildtrain.store.remote.s3 import S3Backend

    return S3Backend(parsed)
