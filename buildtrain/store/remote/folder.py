"""A remote in a shared folder (`file:///mnt/team/bt`): for clusters with a shared filesystem.

Every object is written to a hidden temporary file beside its key, fsynced, then renamed into
place (replace) or hard-linked into place (create-only: `link` fails when the name exists, in one
atomic step, and a reader never sees a file still being written, which O_CREAT|O_EXCL followed by
a write would show); then the folder is fsynced.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from buildtrain.errors import RemoteUnavailable
from buildtrain.sources.durable import fsync_dir
from buildtrain.store.remote.backend import AlreadyExists, ObjectMissing
from buildtrain.store.remote.url import RemoteUrl

HIDDEN = "."  # temporary files start with it; keys never do (see keys.py), listings skip them
PIECE = 256 << 10  # a streamed read's buffer (256 KB: 57 ms for 72 MB, 1 MB 81 ms, 8 MB 87 ms here)


class FolderBackend:
    def __init__(self, url: RemoteUrl) -> None:
        self.url = url
        self.root = Path(url.location)
        if not self.root.is_dir():
            raise RemoteUnavailable(
                f"remote {url}: {self.root} is not a folder; create it (mkdir -p) or mount the share"
            )

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def get(self, key: str) -> bytes:
        with self._open(key) as handle:
            return handle.read()

    def stream(self, key: str) -> Iterator[memoryview]:
        return _pieces(self._open(key))

    def _open(self, key: str) -> BinaryIO:  # unbuffered: streamed reads fill their own buffer
        """An object's file, open for reading; ObjectMissing for anything but a regular file.
        Opened without blocking, then checked: a FIFO in its place hung `bt pull` forever (open
        waits for a writer), and a device would be read without end."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectMissing(key) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ObjectMissing(key)  # not an object this protocol writes: named as missing
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)

    def _temporary(self, key: str) -> Path:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.with_name(f"{HIDDEN}{path.name}.{uuid.uuid4().hex}.tmp")

    def _place(self, temporary: Path, key: str, *, create_only: bool) -> None:
        final = self._path(key)
        try:
            if create_only:
                try:
                    os.link(temporary, final)
                except FileExistsError:
                    raise AlreadyExists(key) from None
            else:
                os.replace(temporary, final)
        finally:
            temporary.unlink(missing_ok=True)
        fsync_dir(final.parent)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        temporary = self._temporary(key)
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        self._place(temporary, key, create_only=create_only)

    def put_file(self, key: str, path: Path) -> None:
        temporary = self._temporary(key)
        shutil.copyfile(path, temporary)  # copy_file_range where the kernel offers it
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        self._place(temporary, key, create_only=False)

    def exists(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path.is_file() else None

    def list(self, prefix: str) -> list[str]:
        folder = self._path(prefix)
        if not folder.is_dir():
            return []
        found = []
        for parent, dirs, names in os.walk(folder):
            dirs[:] = [d for d in dirs if not d.startswith(HIDDEN)]
            for name in names:
                if not name.startswith(HIDDEN):
                    found.append((Path(parent) / name).relative_to(self.root).as_posix())
        return sorted(found)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self._path(key).unlink()


def _pieces(handle: BinaryIO) -> Iterator[memoryview]:
    """The file in pieces of one reused buffer, small enough to stay in the CPU's cache while
    it is hashed and written: 72 MB in 7 files on 8 threads took 57 ms against 114 ms with a
    new 8 MB bytes object per read (each one fresh memory, faulted in page by page)."""
    buffer = bytearray(PIECE)
    view = memoryview(buffer)
    with handle:
        while count := handle.readinto(buffer):
            yield view[:count]
