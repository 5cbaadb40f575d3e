"""One writer per step: an exclusive flock on `locks/<step hash>.lock`, holding the holder's pid.

flock belongs to the open file description, so a child process that inherits the descriptor keeps
the step locked even if its parent is killed first; the lock disappears with the last process that
holds it, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from buildtrain.errors import CorruptObject, Locked


@contextlib.contextmanager
def hold(
    path: Path,
    step_hash: str,
    set_aside: Callable[[Path], Any],
    *,
    wait: bool = True,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[int]:
    """Hold the lock at `path`; yields its file descriptor. Busy: raise `Locked` (without
    `wait`), else tell `on_wait` who holds it and wait."""
    fd = _open(path, set_aside)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            if not wait:
                raise Locked(f"step {step_hash[:12]} is being built by pid {holder}") from None
            if on_wait is not None:
                on_wait(holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield fd
    finally:
        os.close(fd)


def _open(path: Path, set_aside: Callable[[Path], Any]) -> int:
    """Open (or create) a lock file, never through a link; a folder or link found in its place is
    set aside (a lock holds no data, so a fresh one loses nothing)."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.ELOOP):
                raise
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    set_aside(path)
    raise CorruptObject(f"lock {path} cannot be opened as a file; run bt fsck --repair")
