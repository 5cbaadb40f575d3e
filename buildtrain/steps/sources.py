"""A data file as a step reads it: found by the executor, checked against the plan while it is read.

The plan names each source by content (blake3 and size); the executor finds a file with that
content before the step starts, but the file can change after that, even while the step reads
it. So every byte a step reads from a source goes through `SourceReader`, which hashes it on the
way and, at the end of the file, refuses the step unless the bytes read are the bytes planned:
an output is never published for content its step hash does not name. A reader never reads past
the planned size plus one byte, so a file that grew without end (a link to /dev/zero) fails at
once instead of being read for ever. Needs no torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar

import attrs
import blake3

from buildtrain.errors import StepFailed
from buildtrain.sources.regular import NotRegularFile, open_regular

READ_CHUNK = 1 << 20
# What a read returns: bytes of its own, or a view of the caller's buffer
Read = TypeVar("Read", bytes, memoryview)


@attrs.frozen(kw_only=True)
class Source:
    """A data file: where the executor found it, and the content the plan was made with."""

    path: Path
    blake3: str
    size: int

    def __str__(self) -> str:  # messages name the file, as they did for a plain path
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)


def planned_sources(planned: Sequence[Mapping[str, Any]], paths: Sequence[str]) -> list[Source]:
    """The step's sources: its plan inputs (`{"blake3", "size"}` in plan order) with the paths
    the executor found for them, in the same order (one path per planned file, or it is a bug)."""
    return [
        Source(path=Path(path), blake3=str(want["blake3"]), size=int(want["size"]))
        for want, path in zip(planned, paths, strict=True)
    ]


class SourceReader:
    """A binary file read once from start to end, hashed as it is read; `check` at the end."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.hasher = blake3.blake3()
        self.count = 0
        self.handle = open_file(source.path)

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.handle.close()

    def _seen(self, data: Read) -> Read:
        self.hasher.update(data)
        self.count += len(data)
        if self.count > self.source.size:
            self.check()  # grown past its planned size: no need to read on
        elif not data:
            self.check()
        return data

    def read(self, size: int = READ_CHUNK) -> bytes:
        return self._seen(self.handle.read(min(size, self.source.size + 1 - self.count)))

    def readinto(self, buffer: bytearray | memoryview) -> memoryview:
        """Read into `buffer` (reused: no fresh pages per read); the part filled, hashed."""
        view = memoryview(buffer)[: self.source.size + 1 - self.count]
        return self._seen(view[: self.handle.readinto(view)])

    def readline(self) -> bytes:
        return self._seen(self.handle.readline(self.source.size + 1 - self.count))

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line

    def check(self) -> None:
        """Refuse the step unless the bytes read so far are exactly the planned content."""
        found = self.hasher.hexdigest()
        if self.count != self.source.size or found != self.source.blake3:
            raise StepFailed(
                f"{self.source.path}: changed since it was planned (read {self.count} bytes with "
                f"blake3 {found[:16]}…, the plan has {self.source.size} bytes with blake3 "
                f"{self.source.blake3[:16]}…); nothing was published: restore the file, or plan again"
            )


def open_source(path: Source | Path) -> IO[bytes] | SourceReader:
    """A source opened for reading from start to end: checked against the plan when it is a
    `Source` (what the executor hands a step), plain for a path (a library caller's own file)."""
    if isinstance(path, Source):
        return SourceReader(path)
    return open_file(path)


def open_file(path: str | os.PathLike[str]) -> BinaryIO:
    """A regular file opened for reading; a FIFO, device or folder in its place stops the step
    (a FIFO would block the read forever, /dev/zero never end it)."""
    try:
        return open_regular(path)
    except NotRegularFile as exc:
        raise StepFailed(
            f"{path}: {exc.strerror}; plan again from the preset with a data file there"
        ) from None


def read_source(path: Source | Path) -> bytes:
    """A whole source file, checked like any other read. A planned one is read in one call of
    its planned size (then to its end, which checks it): joining 1 MB chunks cost 0.18 s of a
    320 MB checkpoint's 0.45 s here."""
    with open_source(path) as handle:
        first = handle.read(path.size + 1) if isinstance(path, Source) else b""
        chunks = []
        while chunk := handle.read(READ_CHUNK):
            chunks.append(chunk)
        return first + b"".join(chunks) if chunks else first


def private_copy(path: Source | Path) -> IO[bytes]:
    """For a reader that seeks (Parquet): the source copied, checked, into an unnamed temporary
    file that nothing else can write, so the bytes it reads are the bytes checked. A plain path
    is opened as it is (a regular file only: a FIFO in its place would block the reader)."""
    if not isinstance(path, Source):
        return open_file(path)
    copy = tempfile.TemporaryFile()  # noqa: SIM115 (closed when the reader drops it)
    with SourceReader(path) as reader:
        shutil.copyfileobj(reader, copy, READ_CHUNK)
    copy.flush()
    copy.seek(0, os.SEEK_SET)
    return copy
