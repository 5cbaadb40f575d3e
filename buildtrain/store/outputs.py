"""The outputs part of a store: each step's sealed output (`steps/<step hash>/`), the stamps that
spare a null build its re-hash, the work folder of a step in progress, and the claim the run loop
makes on an output before it builds one (`claim`, returning one of the records in `claims.py`).

It knows folders, manifests and checkpoint names, never what a step computes: whether a kind can
complete an output without a process, or whether a checkpoint belongs to its configuration, is
asked of the kind and of the step process.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.store import durability, layout, objects
from buildtrain.store.claims import Cached, Claim, Fresh, LockedBy, Resume
from buildtrain.store.folders import Folders
from buildtrain.store.locks import HeldBy, Locks

STAMP_FORMAT = 2  # sealed, names its output, stats include ctime


class Outputs:
    def __init__(self, folders: Folders, locks: Locks) -> None:
        self._folders = folders
        self._locks = locks

    def path(self, step_hash: str) -> Path:
        return self._folders.steps / step_hash

    def has(self, step_hash: str) -> bool:
        folder = self.path(step_hash)
        return not folder.is_symlink() and (folder / objects.MANIFEST).is_file()

    def verify(self, step_hash: str, *, contents: bool = True) -> list[str]:
        return objects.verify(self.path(step_hash), contents=contents)

    def stamp_path(self, step_hash: str) -> Path:
        return self._folders.stamps / layout.json_name(step_hash)

    def _stats(self, step_hash: str) -> dict[str, list[int]] | None:
        """(size, mtime, inode, ctime) of every file of an output; None if it is not a plain folder.

        ctime is set by the kernel on every write and on every change of mtime, so an edit that
        restores size and mtime still changes the stamp."""
        folder = self.path(step_hash)
        if folder.is_symlink() or not folder.is_dir():
            return None
        try:
            stats = {}
            for path in sorted(folder.rglob("*")):  # rglob does not descend into links
                s = path.lstat()
                if not stat.S_ISDIR(s.st_mode):  # a link or a pipe is recorded too, as a change
                    size = s.st_size if stat.S_ISREG(s.st_mode) else -s.st_mode
                    stats[path.relative_to(folder).as_posix()] = [
                        size,
                        s.st_mtime_ns,
                        s.st_ino,
                        s.st_ctime_ns,
                    ]
            return stats
        except OSError:
            return None

    def read_stamp(self, step_hash: str) -> dict[str, Any] | None:
        """The sealed stamp of an output, or None when it is absent, damaged or not this output's."""
        path = self.stamp_path(step_hash)
        try:
            if path.is_symlink() or not path.is_file():
                return None
            body = json.loads(path.read_bytes())
            claimed = body.pop("seal")
            if body.get("format") != STAMP_FORMAT or body.get("step") != step_hash:
                return None
            return body if claimed == digest("stamp", body) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def stamp_problem(self, step_hash: str) -> str | None:
        """Why the stamp file of `step_hash` is damaged; None when it is absent or sound."""
        path = self.stamp_path(step_hash)
        if not os.path.lexists(path):
            return None
        if path.is_symlink():
            return "a symbolic link, not a stamp"
        if not path.is_file():
            return "not a regular file"
        return None if self.read_stamp(step_hash) is not None else "does not match its seal or its name"

    def drop_stamp(self, step_hash: str) -> None:
        """Forget that an output was verified, so the next reader re-hashes it (best effort)."""
        with contextlib.suppress(OSError):
            self._folders.set_aside(self.stamp_path(step_hash), keep=False)

    def check(self, step_hash: str) -> list[str]:
        """`verify`, remembered: after a full re-hash, the (size, mtime, inode, ctime) of
        every file is stamped, and while the stamp matches the files are not hashed again. This
        keeps a null build instant with gigabytes of outputs; anything written to an output
        changes its stamp. A stamp is sealed and names its output, and only ever saves a re-hash:
        a damaged or foreign stamp is ignored, and `bt fsck`, which always re-hashes, drops the
        stamp of every output it finds damaged."""
        stats = self._stats(step_hash)
        if stats is None:
            return self.verify(step_hash) or ["output folder unreadable"]
        stamp = self.read_stamp(step_hash)
        bound = None if stamp is None else stamp.get("boot")
        if stamp is not None and stamp.get("files") == stats and bound in (None, durability.boot_id()):
            return []
        problems = self.verify(step_hash)
        if not problems:
            # Bytes pulled unsynced on this boot stay bound to it. Any others are on disk: a
            # build fsyncs what it publishes, and after a reboot every byte read came from disk
            # (an fdatasync of each file here cost 3.3 ms a file even when clean).
            self._stamp(step_hash, stats, boot=bound if bound == durability.boot_id() else None)
        else:
            self.drop_stamp(step_hash)
        return problems

    def stamp_hashed(self, step_hash: str, *, boot: str | None = None) -> bool:
        """Stamp an output whose every file's bytes the caller hashed as it wrote them and found
        as the manifest lists (a pull): its first `check` then need not read them again. `boot`:
        the files were not fsynced, so the stamp counts only on that boot (`durability.py`).
        False when no stamp was written."""
        stats = self._stats(step_hash)
        return stats is not None and self._stamp(step_hash, stats, boot=boot)

    def _stamp(self, step_hash: str, stats: dict[str, list[int]], *, boot: str | None = None) -> bool:
        body: dict[str, Any] = {"format": STAMP_FORMAT, "step": step_hash, "files": stats}
        if boot is not None:  # only when set: stamps of durable outputs keep their form
            body["boot"] = boot
        try:
            # A cache, so not fsynced: a stamp lost or torn by a crash is ignored (sealed,
            # checked against the stats), and costs one re-hash of files already durable.
            self._folders.replace_file(
                self.stamp_path(step_hash),
                canonical_bytes({**body, "seal": digest("stamp", body)}),
                durable=False,
            )
        except OSError:  # a read-only store just re-hashes next time
            return False
        return True

    def quarantine(self, step_hash: str) -> Path | None:
        """Move a damaged or foreign output aside so that it is rebuilt and never loaded.
        Call it holding the step's lock; None when another run already moved it."""
        self.drop_stamp(step_hash)
        return self._folders.set_aside(self.path(step_hash))

    def work_dir(self, step_hash: str) -> Path:
        return self._folders.work / step_hash

    def checkpoints_dir(self, step_hash: str) -> Path:
        return self._folders.work / step_hash / layout.CHECKPOINTS

    def digests(self, step_hash: str) -> dict[str, str]:
        """The logical digests a published output's manifest declares (what `bt verify` compares)."""
        return objects.sealed_digests(self.path(step_hash))

    def newest_checkpoint(self, step_hash: str) -> tuple[int, Path] | None:
        """(update, folder) of the newest sealed checkpoint in the step's work folder; None when
        there is none. Sealed means its manifest exists: whether it verifies and belongs to this
        step is the step process's question, asked when it resumes."""
        folder = self.checkpoints_dir(step_hash)
        saved = layout.newest_first(folder.iterdir()) if folder.is_dir() else []
        return next(((u, path) for u, path in saved if (path / objects.MANIFEST).is_file()), None)

    @contextlib.contextmanager
    def claim(
        self, step_hash: str, *, wait: bool = True, on_wait: Callable[[str], None] | None = None
    ) -> Iterator[Claim]:
        """Claim the step's output for a build: `Cached` when it verifies (looked at without the
        lock first, so a null build only reads and works in a read-only store); else, holding the
        step's lock for the whole `with` block, `Fresh` or `Resume`, a damaged output in its
        place set aside; `LockedBy` when the lock is busy and `wait` is false. While waiting,
        `on_wait` is told who holds it."""
        if self.has(step_hash) and not self.check(step_hash):
            yield Cached(digests=self.digests(step_hash))
            return
        with contextlib.ExitStack() as stack:
            holder = None
            try:
                lock_fd = stack.enter_context(self._locks.hold(step_hash, wait=wait, on_wait=on_wait))
            except HeldBy as busy:  # yielded outside the handler: the caller's errors chain no HeldBy
                holder = busy.holder
            if holder is not None:
                yield LockedBy(step_hash=step_hash, holder=holder)
                return
            yield self._claim_held(step_hash, lock_fd)

    def _claim_held(self, step_hash: str, lock_fd: int) -> Claim:
        """Holding the lock: the output another run built meanwhile, or room made for a build."""
        moved, problems = None, ()
        if os.path.lexists(self.path(step_hash)):
            problems = tuple(self.check(step_hash))
            if not problems:
                return Cached(digests=self.digests(step_hash), by_another_run=True)
            moved = self.quarantine(step_hash)  # None: another run moved it first
        work = self.work_dir(step_hash)
        newest = self.newest_checkpoint(step_hash)
        if newest is None:
            return Fresh(lock_fd=lock_fd, work=work, moved=moved, problems=problems)
        update, checkpoint = newest
        return Resume(
            lock_fd=lock_fd, work=work, update=update, checkpoint=checkpoint, moved=moved, problems=problems
        )
