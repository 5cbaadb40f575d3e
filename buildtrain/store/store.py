"""The store: plans by hash, step outputs by step hash, and the working state of steps in progress.

Its layout (every folder and file name) is in `store/layout.py`; this class is the one owner of
the paths: fsck, gc, the executor and the tables ask it for them and never spell one. A store
identifies itself by a marker (`STORE.json`, written when it is created), and a folder in place
of a store folder must be a real folder: a link or a file there is damage, never written through.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from buildtrain import clock
from buildtrain.canonical import canonical_bytes, digest
from buildtrain.errors import CorruptObject, Locked, UsageError
from buildtrain.sources.stat_cache import StatCache
from buildtrain.store import layout, locks, metrics, objects, plan_index
from buildtrain.store.meta import read_meta, seal_meta

DEFAULT_STORE = ".bt"
HEX = re.compile(r"^[0-9a-f]+$")
MIN_PREFIX = 4
STAMP_FORMAT = 2  # sealed, names its output, stats include ctime
META_SUFFIX = ".meta.json"
MARKER_BODY = {"format": 1, "store": "buildtrain"}  # the bytes of STORE.json, canonical


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = root / layout.MARKER
        self.plans = root / layout.PLANS
        self.sweeps = root / layout.SWEEPS
        self.steps = root / layout.STEPS
        self.work = root / layout.WORK
        self.evals = root / layout.EVALS
        self.metrics = root / layout.METRICS
        self.cards = root / layout.CARDS
        self.step_metrics = root / layout.STEP_METRICS
        self.locks = root / layout.LOCKS
        self.tmp = root / layout.TMP
        self.quarantined = root / layout.QUARANTINE
        self.stamps = root / layout.STAMPS
        self.stat_cache_path = root / layout.STAT_CACHE
        self.source_cache = root / layout.SOURCE_CACHE
        self.plan_index = plan_index.PlanIndex(root / layout.PLAN_INDEX, self.plans)
        self._claimed = False  # known to be a store (or made one) by `folder`

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
        path = self.plan_path(plan_hash)
        if not self._holds(path, raw):
            self.folder(self.plans)
            self.index_plan(plan_hash)  # before the file: a plan of this bt is never unindexed
            if os.path.lexists(path):
                self.set_aside(path)
            objects.write_bytes_durably(path, raw)
        self.index_plan(plan_hash)  # and after: `bt fsck --repair` may have dropped it meanwhile
        previous = self.plan_meta(plan_hash)
        now = clock.iso_seconds()
        record = {"created": previous.get("created", now), **previous, **meta, "planned": now}
        # Planning a stored plan again from the same place moves only the time it was planned:
        # that refresh is replaced atomically but not fsynced (a null build of a preset syncs
        # nothing), since a crash that loses it loses a hint (see plan_meta), never a plan.
        moved_only_the_time = {**record, "planned": previous.get("planned")} == previous
        try:
            self.replace_file(
                self.plan_meta_path(plan_hash),
                seal_meta(plan_hash, record),
                durable=not moved_only_the_time,
            )
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
        return sorted(p.name[:-5] for p in self.plans.glob("*.json") if not p.name.endswith(META_SUFFIX))

    def resolve(self, ref: str) -> str:
        """The full hash of the one stored plan that `ref` (a hash or unique prefix) names.
        A full hash is looked up by its path and a prefix in the index (`store/plan_index.py`):
        neither lists plans/, unless the index knows no plan with that prefix."""
        ref = ref.strip().lower()
        if not HEX.match(ref) or len(ref) < MIN_PREFIX:
            raise UsageError(f"'{ref}' is not a plan hash or a prefix of at least {MIN_PREFIX} hex digits")
        if layout.HASH_NAME.match(ref):
            matches = [ref] if os.path.lexists(self.plan_path(ref)) else []
        else:
            matches = self._indexed(ref)
        if not matches and _not_a_folder(self.plans):
            self.check_layout()  # plans/ is a file or a link: say so, not "no such plan"
        if not matches:
            raise UsageError(f"no plan {ref} in the store {self.root}; compile one with: bt plan PRESET")
        if len(matches) > 1:
            listed = ", ".join(m[: layout.SHORT] for m in matches[:5])
            raise UsageError(f"plan prefix {ref} is ambiguous ({listed}); give more digits")
        return matches[0]

    def index_plan(self, plan_hash: str) -> None:
        """Add a plan to the index (best effort: a read-only store is searched by listing)."""
        with contextlib.suppress(OSError, CorruptObject):
            self.folder(self.plan_index.folder)
            self.plan_index.add(plan_hash)

    def rebuild_plan_index(self) -> None:
        """Index every stored plan and mark the index complete (`bt fsck --repair`, and the
        first lookup by prefix in a store without an index)."""
        self.folder(self.plan_index.folder)
        self.plan_index.rebuild(self.plan_hashes())

    def plan_index_problems(self) -> list[str]:
        """What is wrong with the plan index (`bt fsck`); [] when it is sound, or not complete
        yet (`bt plan` adds entries, and the first lookup by prefix completes it). Only a stored
        plan missing from a complete index is wrong: a prefix could then resolve to another plan
        without seeing it. An entry whose plan is gone (a plan file deleted by hand) is skipped by
        every lookup, so it is no damage (an empty file, dropped when the index is next repaired)."""
        if not self.plan_index.is_ready():
            return []
        missing = sorted(set(self.plan_hashes()) - self.plan_index.indexed())
        if not missing:
            return []
        return [f"{len(missing)} stored plan(s) not indexed ({missing[0][: layout.SHORT]}, ...)"]

    def repair_plan_index(self) -> None:
        """Drop the entries of plans that are not stored, then index every stored plan."""
        self.plan_index.prune(set(self.plan_hashes()))
        self.rebuild_plan_index()

    def _indexed(self, prefix: str) -> list[str]:
        """Stored plans whose hash starts with `prefix`, through the index; an index that is not
        complete, or that knows none, is checked against a listing of plans/ (and rebuilt)."""
        if self.plan_index.is_ready():
            matches = self.plan_index.matches(prefix)
            if matches:
                return matches
        listed = [h for h in self.plan_hashes() if h.startswith(prefix)]
        # Only in a marked store (a lookup never marks one), and a read-only store is listed every time.
        with contextlib.suppress(OSError, CorruptObject):
            if (listed or not self.plan_index.is_ready()) and _is_marker(self.marker):
                self.rebuild_plan_index()
        return listed

    def plan_bytes(self, ref: str) -> tuple[str, bytes]:
        """(full hash, stored bytes) of the plan `ref` names; unchecked: `plan.stored.load_plan`
        trusts them only once they decode to a plan with that hash."""
        plan_hash = self.resolve(ref)
        path = self.plan_path(plan_hash)
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
        return read_meta(self.plan_meta_path(plan_hash), plan_hash) or {}

    def plan_path(self, plan_hash: str) -> Path:
        return self.plans / layout.json_name(plan_hash)

    def plan_meta_path(self, plan_hash: str) -> Path:
        return self.plans / f"{plan_hash}{META_SUFFIX}"

    def sweep_path(self, sweep_hash: str) -> Path:
        return self.sweeps / layout.json_name(sweep_hash)

    def card_path(self, plan_hash: str) -> str:
        """A plain string: a table asks for thousands of these, and `os.path` is cheaper than Path."""
        return os.path.join(self.cards, plan_hash + ".json")

    def step_metrics_path(self, step_hash: str) -> str:
        return os.path.join(self.step_metrics, step_hash + ".json")

    def read_step_metrics(self, step_hash: str) -> dict[str, Any] | None:
        """A built step's sealed metrics summary; None when absent or not sound (a blank)."""
        return metrics.read_step_metrics(self.step_metrics_path(step_hash), step_hash)

    def save_step_metrics(self, step_hash: str, body: dict[str, Any]) -> None:
        self.folder(self.step_metrics)
        self.replace_file(
            Path(self.step_metrics_path(step_hash)), metrics.encode({**body, "step": step_hash})
        )

    def eval_path(self, key: str) -> Path:
        return self.evals / layout.json_name(key)

    # -- step outputs -----------------------------------------------------------------------------

    def output(self, step_hash: str) -> Path:
        return self.steps / step_hash

    def has_output(self, step_hash: str) -> bool:
        folder = self.output(step_hash)
        return not folder.is_symlink() and (folder / objects.MANIFEST).is_file()

    def verify_output(self, step_hash: str, *, contents: bool = True) -> list[str]:
        return objects.verify(self.output(step_hash), contents=contents)

    def stamp_path(self, step_hash: str) -> Path:
        return self.stamps / layout.json_name(step_hash)

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
            self._stamp(step_hash, stats)
        else:
            self.drop_stamp(step_hash)
        return problems

    def stamp_hashed(self, step_hash: str) -> None:
        """Stamp an output whose every file's bytes the caller hashed as it wrote them and found
        as the manifest lists (a pull): its first `check_output` then need not read them again."""
        stats = self._stats(step_hash)
        if stats is not None:
            self._stamp(step_hash, stats)

    def _stamp(self, step_hash: str, stats: dict[str, list[int]]) -> None:
        body = {"format": STAMP_FORMAT, "step": step_hash, "files": stats}
        with contextlib.suppress(OSError):  # a read-only store just re-hashes next time
            # A cache, so not fsynced: a stamp lost or torn by a crash is ignored (sealed,
            # checked against the stats), and costs one re-hash of files already durable.
            self.replace_file(
                self.stamp_path(step_hash),
                canonical_bytes({**body, "seal": digest("stamp", body)}),
                durable=False,
            )

    def set_aside(self, path: Path, *, keep: bool = True) -> Path | None:
        """Move whatever is at `path` (a folder, a file, a link; never followed) out of the way:
        into quarantine/ (or removed, with `keep=False`). None when nothing was there."""
        if not os.path.lexists(path):  # nothing to move: quarantine/ is not even looked at (it may
            return None  # be the damage being repaired, a file in its place)
        if not keep and (path.is_symlink() or not path.is_dir()):
            path.unlink(missing_ok=True)
            return None
        self.folder(self.quarantined)
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

    def replace_file(self, path: Path, data: bytes, *, durable: bool = True) -> None:
        """Write a small store file atomically (and durably unless told otherwise: caches and
        hints), first setting aside a folder or link in its place."""
        self.folder(path.parent)
        if path.is_symlink() or path.is_dir():
            self.set_aside(path)
        objects.write_bytes_durably(path, data, durable=durable)

    def work_dir(self, step_hash: str) -> Path:
        return self.work / step_hash

    def checkpoints_dir(self, step_hash: str) -> Path:
        return self.work / step_hash / layout.CHECKPOINTS

    def new_temp(self, label: str) -> Path:
        self.folder(self.tmp)
        return Path(tempfile.mkdtemp(prefix=f"{label}.", dir=self.tmp))

    def stat_cache(self) -> StatCache:
        return StatCache(self.stat_cache_path, set_aside=self.set_aside, folder=self.folder)

    # -- locks ------------------------------------------------------------------------------------

    def lock(
        self, step_hash: str, *, wait: bool = True, on_wait: Callable[[str], None] | None = None
    ) -> contextlib.AbstractContextManager[int]:
        """Hold the step's lock (see `locks.hold`); yields the descriptor a child may inherit.
        Every write into the store happens under one, so the layout is checked here too."""
        self.check_layout()
        self.folder(self.locks)
        return locks.hold(
            self.locks / f"{step_hash}.lock", step_hash, self.set_aside, wait=wait, on_wait=on_wait
        )

    def plan_lock(self, plan_hash: str) -> Path:
        return self.locks / f"{layout.PLAN_LOCK_PREFIX}{plan_hash}.lock"

    @contextlib.contextmanager
    def running(self, plan_hash: str) -> Iterator[None]:
        """Held by `bt run` for the whole run of a plan (shared: several runs of one plan may
        overlap), so that `bt gc --drop` never drops a plan whose steps are being built. Checks
        the layout first: a run never writes through a link or into a file in a folder's place."""
        self.check_layout()
        fd = None
        with contextlib.suppress(OSError):  # a read-only store: nothing can drop the plan either
            self.folder(self.locks)
            fd = os.open(self.plan_lock(plan_hash), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        if fd is None:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if not self.plan_path(plan_hash).is_file():  # dropped between the load and the lock
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

    # -- layout and identity ----------------------------------------------------------------------

    def folder_problems(self) -> list[tuple[str, str]]:
        """(folder relative to the root, what is wrong) for each store folder that is a link, or
        something other than a folder, in its place."""
        found = []
        for name in layout.FOLDERS:
            problem = _not_a_folder(self.root / name)
            if problem is not None:
                found.append((name, problem))
        return found

    def check_layout(self) -> None:
        """Refuse (exit 5) a store with a link or a file in place of one of its folders: writing
        through a link would put locks, builds or outputs somewhere else entirely."""
        problems = self.folder_problems()
        if problems:
            name, problem = problems[0]
            raise CorruptObject(
                f"{self.root / name} is {problem}, not a store folder; run bt fsck --repair "
                "(it moves it to quarantine/), then bt run again"
            )

    def folder(self, path: Path) -> Path:
        """Make the store folder `path` (and its parents), refusing a link or a file in its place,
        and a root that is not a store: the first folder made in a new or empty root marks it."""
        if not self._claimed:
            found = self.identity()
            if found == "foreign":
                raise self.not_a_store()
            if found == "new":
                self.mark()
            self._claimed = True
        full = self.root
        for part in path.relative_to(self.root).parts:
            full = full / part
            problem = _not_a_folder(full)
            if problem is not None:
                raise CorruptObject(
                    f"{full} is {problem}, not a store folder; run bt fsck --repair (it moves it to quarantine/)"
                )
        path.mkdir(parents=True, exist_ok=True)
        return path

    def clear_folder(self, name: str) -> Path | None:
        """Move the link or file found in place of the store folder `name` into quarantine/
        (when it is quarantine/ itself: out of the way first, then into a fresh quarantine/)."""
        path = self.root / name
        if _not_a_folder(path) is None:
            return None
        if name != layout.QUARANTINE:
            return self.set_aside(path)
        aside = self.root / f".{name}.{time.time_ns()}.{os.getpid()}"  # hidden: no listing sees it
        os.rename(path, aside)
        self.quarantined.mkdir()
        target = self.quarantined / f"{name}.{time.time_ns()}.{os.getpid()}"
        os.rename(aside, target)
        return target

    def identity(self) -> str:
        """'marked' (it holds the marker), 'new' (absent or empty), 'unmarked' (only store folders
        at its top: possibly a store made before markers existed) or 'foreign'."""
        if _is_marker(self.marker):
            return "marked"
        try:
            # Less the marker being written by another process creating the store right now.
            names = {n for n in os.listdir(self.root) if not _marker_in_writing(n)}
        except FileNotFoundError:
            return "new"
        except NotADirectoryError:
            return "foreign"
        if not names:
            return "new"
        return "unmarked" if names <= layout.TOP_LEVEL and not os.path.lexists(self.marker) else "foreign"

    def mark(self) -> None:
        """Write the marker that makes this folder a store (creating the folder)."""
        self.root.mkdir(parents=True, exist_ok=True)
        objects.write_bytes_durably(self.marker, canonical_bytes(MARKER_BODY))

    def not_a_store(self) -> UsageError:
        return UsageError(
            f"{self.root} is not a buildtrain store (no {layout.MARKER}, and it holds other files); "
            "give --store (or BT_STORE) a store's folder, or a new or empty one"
        )


def _not_a_folder(path: Path) -> str | None:
    """What is in place of a folder at `path` ('a symbolic link', 'a file'); None for a real
    folder or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None  # a parent is not a folder: reported for the parent
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return None
    return "a file" if stat.S_ISREG(mode) else "neither a folder nor a file"


def _marker_in_writing(name: str) -> bool:
    """The temporary name `objects.write_bytes_durably` writes the marker under."""
    return name.startswith(f".{layout.MARKER}.") and name.endswith(".tmp")


def _is_marker(path: Path) -> bool:
    try:
        return not path.is_symlink() and path.is_file() and json.loads(path.read_bytes()) == MARKER_BODY
    except (OSError, ValueError):
        return False
