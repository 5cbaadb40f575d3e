"""Only regular files are read: a data file, a preset or a tokenizer file is untrusted, and a FIFO
in its place would block a reader forever, a link to /dev/zero never end. `open_regular` checks
the kind of file before opening and again on the open descriptor, never waiting on the open.

Its own small module because the data and tokenizer steps read their sources through it: what it
imports enters their code hash, and the stat cache beside it (`stat_cache.py`) must not.
"""

from __future__ import annotations

import errno
import os
import stat as stat_module
from typing import BinaryIO


def kind_of(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    if stat_module.S_ISDIR(mode):
        return "a directory"
    if stat_module.S_ISFIFO(mode):
        return "a FIFO"
    if stat_module.S_ISSOCK(mode):
        return "a socket"
    if stat_module.S_ISCHR(mode) or stat_module.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


class NotRegularFile(OSError):
    """A path that names a FIFO, device, socket or folder where a file's bytes are expected."""

    def __init__(self, path: str | os.PathLike[str], mode: int) -> None:
        self.kind = kind_of(mode)
        super().__init__(errno.EINVAL, f"is {self.kind}, not a regular file", os.fspath(path))


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` opened for reading in binary, if it is a regular file; else `NotRegularFile`.

    Checked before opening (a device is never opened) and again on the descriptor, which is opened
    without blocking (opening a FIFO would wait for a writer), so a file swapped for a FIFO or a
    link to /dev/zero between the two is refused too."""
    mode = os.stat(path).st_mode
    if not stat_module.S_ISREG(mode):
        raise NotRegularFile(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat_module.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
