"""The locks part of a store. One writer per step: an exclusive flock on `locks/<step hash>.lock`,
holding the holder's pid; and `locks/plan-<plan hash>.lock`, shared by the runs of a plan and
taken exclusively by `bt gc --drop` (`Locks.running`, `Locks.dropping`).

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

from buildtrain.errors import CorruptObject, Locked, UsageError
from buildtrain.store import layout
from buildtrain.store.folders import Folders
from buildtrain.store.plans import Plans


class HeldBy(Locked):
    """The step's lock is held by another process (`holder`: its pid, as it wrote it), and the
    caller would not wait; `Outputs.claim` turns it into a `LockedBy` claim."""

    def __init__(self, step_hash: str, holder: str) -> None:
        super().__init__(f"step {step_hash[:12]} is being built by pid {holder}")
        self.holder = holder


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
                raise HeldBy(step_hash, holder) from None
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


class Locks:
    def __init__(self, folders: Folders, plans: Plans) -> None:
        self._folders = folders
        self._plans = plans
        self.dir = folders.root / layout.LOCKS

    def hold(
        self, step_hash: str, *, wait: bool = True, on_wait: Callable[[str], None] | None = None
    ) -> contextlib.AbstractContextManager[int]:
        """Hold the step's lock (see `hold` above); yields the descriptor a child may inherit.
        Every write into the store happens under one, so the layout is checked here too."""
        self._folders.check_layout()
        self._folders.folder(self.dir)
        return hold(
            self.dir / f"{step_hash}.lock", step_hash, self._folders.set_aside, wait=wait, on_wait=on_wait
        )

    def plan_lock(self, plan_hash: str) -> Path:
        return self.dir / f"{layout.PLAN_LOCK_PREFIX}{plan_hash}.lock"

    @contextlib.contextmanager
    def running(self, plan_hash: str) -> Iterator[None]:
        """Held by `bt run` for the whole run of a plan (shared: several runs of one plan may
        overlap), so that `bt gc --drop` never drops a plan whose steps are being built. Checks
        the layout first: a run never writes through a link or into a file in a folder's place."""
        self._folders.check_layout()
        fd = None
        with contextlib.suppress(OSError):  # a read-only store: nothing can drop the plan either
            self._folders.folder(self.dir)
            fd = os.open(self.plan_lock(plan_hash), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        if fd is None:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if not self._plans.path(plan_hash).is_file():  # dropped between the load and the lock
                raise UsageError(
                    f"plan {plan_hash[: layout.SHORT]} was dropped by bt gc as this run started; plan it again"
                )
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def dropping(self, plan_hash: str) -> Iterator[None]:
        """Held while a plan is dropped; raises `Locked` if a `bt run` of it is going on."""
        path = self.plan_lock(plan_hash)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            yield  # no run of this plan has started since its lock was last removed
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Locked(
                    f"plan {plan_hash[: layout.SHORT]} is being built by a bt run; drop it once that run ends"
                ) from None
            yield
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
