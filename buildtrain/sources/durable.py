"""Files published whole: written beside their name, fsynced, renamed into place, the folder
fsynced (`write_bytes_durably`, `durable_file`), and cache files that carry their own digest
(`framed`). Imports nothing of buildtrain: the store's objects (`store/objects.py`, which seals
folders with these), the stat cache beside this file and the plan's caches all write through it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import blake3

# Files this large are hashed through mmap on all cores; smaller ones are cheaper read directly.
MMAP_THRESHOLD = 8 << 20


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes | Iterable[bytes], *, durable: bool = True) -> None:
    """Write a file next to its final name, fsync it, rename it into place, fsync the folder.
    `durable=False` (caches, recomputed when lost) keeps the atomic rename and skips the fsyncs.
    `data` may be a sequence of buffers, written in order without joining them (large files)."""
    with durable_file(path, durable=durable) as handle:
        for chunk in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
            handle.write(chunk)


@contextlib.contextmanager
def durable_file(path: Path, *, durable: bool = True) -> Iterator[DurableWriter]:
    """A file written in place or in order under a temporary name beside `path`, then published
    as `write_bytes_durably` publishes: fsynced, renamed into place, the folder fsynced. Whatever
    stops the writing (an error, a signal) removes the temporary file: no name ever shows part
    of a file."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        writer = DurableWriter(fd, path, durable)
        yield writer
        writer.finish()
    except BaseException:
        os.close(fd)
        temporary.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(temporary, path)
    if durable:
        fsync_dir(path.parent)


class DurableWriter:
    """Writes to a file `durable_file` publishes, each error naming the published path (a full
    disk's error carries no name of its own), with the disk kept busy along the way."""

    def __init__(self, fd: int, path: Path, durable: bool) -> None:
        self.fd, self.path, self.durable = fd, path, durable
        self.pending = 0  # bytes written since writeback last started

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append `data` at the file's position."""
        self._write(data, lambda view, _: os.write(self.fd, view))

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write `data` at `offset`, leaving the file's position alone."""
        self._write(data, lambda view, done: os.pwrite(self.fd, view, offset + done))

    def _write(self, data: bytes | bytearray | memoryview, call: Callable[[memoryview, int], int]) -> None:
        view, done = memoryview(data).cast("B"), 0
        try:
            while done < len(view):  # short only when the disk fills (the next call raises)
                done += call(view[done:], done)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        self.pending += done
        if self.durable and self.pending >= WRITEBACK_BYTES:
            _start_writeback(self.fd)
            self.pending = 0

    def finish(self) -> None:
        if self.durable:
            try:
                os.fsync(self.fd)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None


# A large durable file asks the kernel to start writing it to disk every this many bytes, so the
# disk works while the rest is written and the final fsync waits only for the tail: an import's
# 320 MB fsync alone took 0.25 to 0.9 s here. sync_file_range(2), Linux only; elsewhere a no-op.
WRITEBACK_BYTES = 32 << 20
SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk without waiting for them."""
    sync_file_range = _libc_sync_file_range()
    if sync_file_range is not None:
        sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), SYNC_FILE_RANGE_WRITE)


@functools.cache
def _libc_sync_file_range() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux (or no such symbol): writeback starts at fsync
        return None


def framed(body: bytes) -> bytes:
    """A cache file's bytes: the blake3 of the body, a newline, the body. Checking raw bytes is
    C-speed, so a cache read thousands of times is still checked on every read."""
    return blake3.blake3(body).hexdigest().encode() + b"\n" + body


def unframed(data: bytes) -> bytes | None:
    """The body of `framed` bytes; None when the digest line does not match the body."""
    claimed, _, body = data.partition(b"\n")
    return body if claimed == blake3.blake3(body).hexdigest().encode() else None
