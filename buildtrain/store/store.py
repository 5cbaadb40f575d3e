"""The store: plans by hash, step outputs by step hash, and the working state of steps in progress.

Layout under the store root (default `./.bt`, or `--store` / `BT_STORE`):

    plans/<plan hash>.json        the canonical plan bytes (the hash is of exactly these bytes)
    plans/<plan hash>.meta.json   when and from which preset it was planned (sealed, not in the hash)
    steps/<step hash>/            a completed step output, sealed by MANIFEST.json, immutable
    work/<step hash>/             checkpoints of a step in progress
    evals/<key>.json              evaluation results by (suite, version, weights, data)
    locks/<step hash>.lock        one writer per step
    tmp/                          outputs being built; renamed into steps/ when complete
    quarantine/                   outputs that failed verification, moved aside, never loaded
    cache/files.json              stat cache of source file digests
    cache/verified/<step>.json    stamps: an output's file stats at its last full re-hash
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from buildtrain import clock
from buildtrain.canonical import canonical_bytes, digest
from buildtrain.errors import CorruptObject, UsageError
from buildtrain.store import locks, objects
from buildtrain.store.meta import read_meta, seal_meta
from buildtrain.store.sources import StatCache

DEFAULT_STORE = ".bt"
HEX = re.compile(r"^[0-9a-f]+$")
MIN_PREFIX = 4
STAMP_FORMAT = 2  # sealed, names its output, stats include ctime


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.plans = root / "plans"
        self.steps = root / "steps"
        self.work = root / "work"
        self.evals = root / "evals"
        self.locks = root / "locks"
        self.tmp = root / "tmp"
        self.quarantined = root / "quarantine"

    @classmethod
    def at(cls, option: str | None) -> Store:
        """The store named by `--store`, else `BT_STORE`, else `./.bt`."""
        return cls(Path(option or os.environ.get("BT_STORE") or DEFAULT_STORE).absolute())

    # -- plans ------------------------------------------------------------------------------------

    def save_plan(self, plan_hash: str, raw: bytes, **meta: Any) -> dict[str, Any]:
        """Store a plan's canonical bytes under its hash (replacing a damaged copy) and its sealed
        metadata. The caller computed the hash from `raw` (`plan.stored.save_plan`); the store
        keeps bytes and never interprets them.

        Planning an already-stored plan in a read-only store still works: the metadata is only a
        record of when and from where, so failing to refresh it is not an error.
        """
        path = self.plans / f"{plan_hash}.json"
        if not self._holds(path, raw):
            self.plans.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(path):
                self.set_aside(path)
            objects.write_bytes_durably(path, raw)
        previous = self.plan_meta(plan_hash)
        now = clock.iso_seconds()
        record = {"created": previous.get("created", now), **previous, **meta, "planned": now}
        try:
            self.replace_file(self.plans / f"{plan_hash}.meta.json", seal_meta(plan_hash, record))
        except OSError:
            if not self._holds(path, raw):
                raise
        return record

    @staticmethod
    def _holds(path: Path, raw: bytes) -> bool:
        """Whether `path` is a regular file (not a link) holding exactly `raw`."""
        try:
            return not path.is_symlink() and path.is_file() and path.read_bytes() == raw
        except OSError:
            return False

    def plan_hashes(self) -> list[str]:
        if not self.plans.is_dir():
            return []
        return sorted(p.name[:-5] for p in self.plans.glob("*.json") if not p.name.endswith(".meta.json"))

    def resolve(self, ref: str) -> str:
        """The full hash of the one stored plan that `ref` (a hash or unique prefix) names."""
        ref = ref.strip().lower()
        if not HEX.match(ref) or len(ref) < MIN_PREFIX:
            raise UsageError(f"'{ref}' is not a plan hash or a prefix of at least {MIN_PREFIX} hex digits")
        matches = [h for h in self.plan_hashes() if h.startswith(ref)]
        if not matches:
            raise UsageError(f"no plan {ref} in the store {self.root}; compile one with: bt plan PRESET")
        if len(matches) > 1:
            listed = ", ".join(m[:12] for m in matches[:5])
            raise UsageError(f"plan prefix {ref} is ambiguous ({listed}); give more digits")
        return matches[0]

    def plan_bytes(self, ref: str) -> tuple[str, bytes]:
        """(full hash, stored bytes) of the plan `ref` names; unchecked: `plan.stored.load_plan`
        trusts them only once they decode to a plan with that hash."""
        plan_hash = self.resolve(ref)
        path = self.plans / f"{plan_hash}.json"
        try:
            if path.is_symlink():
                raise ValueError("a symbolic link, not a stored plan")
            return plan_hash, path.read_bytes()
        except (OSError, ValueError) as exc:
            raise CorruptObject(
                f"plan {plan_hash[:12]} in {self.root} is damaged ({exc}); run bt fsck, "
                "then plan it again from its preset (bt plan PRESET)"
            ) from None

    def plan_meta(self, plan_hash: str) -> dict[str, Any]:
        """When and from where the plan was made; {} when absent or damaged (it only holds hints:
        data files are found by content, so lost metadata costs a search, never a wrong file)."""
        return read_meta(self.plans / f"{plan_hash}.meta.json", plan_hash) or {}

    # -- step outputs -----------------------------------------------------------------------------

    def output(self, step_hash: str) -> Path:
        return self.steps / step_hash

    def has_output(self, step_hash: str) -> bool:
        folder = self.output(step_hash)
        return not folder.is_symlink() and (folder / objects.MANIFEST).is_file()

    def verify_output(self, step_hash: str, *, contents: bool = True) -> list[str]:
        return objects.verify(self.output(step_hash), contents=contents)

    def stamp_path(self, step_hash: str) -> Path:
        return self.root / "cache" / "verified" / f"{step_hash}.json"

    def _stats(self, step_hash: str) -> dict[str, list[int]] | None:
        """(size, mtime, inode, ctime) of every file of an output; None if it is not a plain folder.

        ctime is set by the kernel on every write and on every change of mtime, so an edit that
        restores size and mtime still changes the stamp."""
        folder = self.output(step_hash)
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
            self.set_aside(self.stamp_path(step_hash), keep=False)

    def check_output(self, step_hash: str) -> list[str]:
        """`verify_output`, remembered: after a full re-hash, the (size, mtime, inode, ctime) of
        every file is stamped, and while the stamp matches the files are not hashed again. This
        keeps a null build instant with gigabytes of outputs; anything written to an output
        changes its stamp. A stamp is sealed and names its output, and only ever saves a re-hash:
        a damaged or foreign stamp is ignored, and `bt fsck`, which always re-hashes, drops the
        stamp of every output it finds damaged."""
        stats = self._stats(step_hash)
        if stats is None:
            return self.verify_output(step_hash) or ["output folder unreadable"]
        stamp = self.read_stamp(step_hash)
        if stamp is not None and stamp.get("files") == stats:
            return []
        problems = self.verify_output(step_hash)
        if not problems:
            body = {"format": STAMP_FORMAT, "step": step_hash, "files": stats}
            with contextlib.suppress(OSError):  # a read-only store just re-hashes next time
                self.replace_file(
                    self.stamp_path(step_hash), canonical_bytes({**body, "seal": digest("stamp", body)})
                )
        else:
            self.drop_stamp(step_hash)
        return problems

    def set_aside(self, path: Path, *, keep: bool = True) -> Path | None:
        """Move whatever is at `path` (a folder, a file, a link; never followed) out of the way:
        into quarantine/ (or removed, with `keep=False`). None when nothing was there."""
        if not keep and (path.is_symlink() or (os.path.lexists(path) and not path.is_dir())):
            path.unlink(missing_ok=True)
            return None
        self.quarantined.mkdir(parents=True, exist_ok=True)
        target = self.quarantined / f"{path.name}.{time.time_ns()}.{os.getpid()}"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return None
        if not keep:
            objects.remove_tree(target)
            return None
        return target

    def quarantine(self, step_hash: str) -> Path | None:
        """Move a damaged or foreign output aside so that it is rebuilt and never loaded.
        Call it holding the step's lock; None when another run already moved it."""
        self.drop_stamp(step_hash)
        return self.set_aside(self.output(step_hash))

    def replace_file(self, path: Path, data: bytes) -> None:
        """Write a small store file durably, first setting aside a folder or link in its place."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.is_dir():
            self.set_aside(path)
        objects.write_bytes_durably(path, data)

    def work_dir(self, step_hash: str) -> Path:
        return self.work / step_hash

    def new_temp(self, label: str) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{label}.", dir=self.tmp))

    def stat_cache(self) -> StatCache:
        return StatCache(self.root / "cache" / "files.json", set_aside=self.set_aside)

    # -- locks ------------------------------------------------------------------------------------

    def lock(
        self, step_hash: str, *, wait: bool = True, on_wait: Callable[[str], None] | None = None
    ) -> contextlib.AbstractContextManager[int]:
        """Hold the step's lock (see `locks.hold`); yields the descriptor a child may inherit."""
        self.locks.mkdir(parents=True, exist_ok=True)
        return locks.hold(
            self.locks / f"{step_hash}.lock", step_hash, self.set_aside, wait=wait, on_wait=on_wait
        )
