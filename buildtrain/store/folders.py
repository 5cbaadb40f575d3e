"""The store's folders and identity: where each folder of the layout is, the marker that makes a
folder a store, and the two ways anything is written or moved there (`folder`, `set_aside`).

The parts of a store (`plans.py`, `outputs.py`, `results.py`, `locks.py`) each take one of these
and never spell a path of their own; `store.py` composes them. A folder in place of a store folder
must be a real folder: a link or a file there is damage, never written through.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from pathlib import Path

from buildtrain.canonical import canonical_bytes
from buildtrain.errors import CorruptObject, UsageError
from buildtrain.sources import durable as durable_files
from buildtrain.sources.stat_cache import StatCache
from buildtrain.store import layout, objects

MARKER_BODY = {"format": 1, "store": "buildtrain"}  # the bytes of STORE.json, canonical


class Folders:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = root / layout.MARKER
        self.sweeps = root / layout.SWEEPS
        self.steps = root / layout.STEPS
        self.work = root / layout.WORK
        self.evals = root / layout.EVALS
        self.metrics = root / layout.METRICS
        self.cards = root / layout.CARDS
        self.step_metrics = root / layout.STEP_METRICS
        self.tmp = root / layout.TMP
        self.quarantined = root / layout.QUARANTINE
        self.stamps = root / layout.STAMPS
        self.stat_cache_path = root / layout.STAT_CACHE
        self.source_cache = root / layout.SOURCE_CACHE
        self._claimed = False  # known to be a store (or made one) by `folder`

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

    def replace_file(self, path: Path, data: bytes, *, durable: bool = True) -> None:
        """Write a small store file atomically (and durably unless told otherwise: caches and
        hints), first setting aside a folder or link in its place."""
        self.folder(path.parent)
        if path.is_symlink() or path.is_dir():
            self.set_aside(path)
        durable_files.write_bytes_durably(path, data, durable=durable)

    def new_temp(self, label: str) -> Path:
        self.folder(self.tmp)
        return Path(tempfile.mkdtemp(prefix=f"{label}.", dir=self.tmp))

    def stat_cache(self) -> StatCache:
        return StatCache(self.stat_cache_path, set_aside=self.set_aside, folder=self.folder)

    def folder_problems(self) -> list[tuple[str, str]]:
        """(folder relative to the root, what is wrong) for each store folder that is a link, or
        something other than a folder, in its place."""
        found = []
        for name in layout.FOLDERS:
            problem = not_a_folder(self.root / name)
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
            problem = not_a_folder(full)
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
        if not_a_folder(path) is None:
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
        durable_files.write_bytes_durably(self.marker, canonical_bytes(MARKER_BODY))

    def not_a_store(self) -> UsageError:
        return UsageError(
            f"{self.root} is not a buildtrain store (no {layout.MARKER}, and it holds other files); "
            "give --store (or BT_STORE) a store's folder, or a new or empty one"
        )

    def is_marked(self) -> bool:
        """Whether the root holds the marker (a lookup never marks a store, only a write does)."""
        return _is_marker(self.marker)


def not_a_folder(path: Path) -> str | None:
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
    """The temporary name `durable.write_bytes_durably` writes the marker under."""
    return name.startswith(f".{layout.MARKER}.") and name.endswith(".tmp")


def _is_marker(path: Path) -> bool:
    try:
        return not path.is_symlink() and path.is_file() and json.loads(path.read_bytes()) == MARKER_BODY
    except (OSError, ValueError):
        return False
