"""The plans part of a store: plan bytes by hash, their sealed metadata, the index by prefix
(`plan_index.py`) and where sweeps are kept.

It keeps bytes and never interprets them: `plan/stored.py` computes a plan's hash from its bytes
and trusts stored bytes only once they decode to a plan with that hash.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

from buildtrain import clock
from buildtrain.errors import CorruptObject, UsageError
from buildtrain.sources import durable
from buildtrain.store import layout, plan_index
from buildtrain.store.folders import Folders, not_a_folder
from buildtrain.store.meta import read_meta, seal_meta

HEX = re.compile(r"^[0-9a-f]+$")
MIN_PREFIX = 4
META_SUFFIX = ".meta.json"


class Plans:
    def __init__(self, folders: Folders) -> None:
        self._folders = folders
        self.dir = folders.root / layout.PLANS
        self.index = plan_index.PlanIndex(folders.root / layout.PLAN_INDEX, self.dir)

    def save(self, plan_hash: str, raw: bytes, **meta: Any) -> dict[str, Any]:
        """Store a plan's canonical bytes under its hash (replacing a damaged copy) and its sealed
        metadata. The caller computed the hash from `raw` (`plan.stored.save_plan`); the store
        keeps bytes and never interprets them.

        Planning an already-stored plan in a read-only store still works: the metadata is only a
        record of when and from where, so failing to refresh it is not an error.
        """
        path = self.path(plan_hash)
        if not self._holds(path, raw):
            self._folders.folder(self.dir)
            self.add_to_index(plan_hash)  # before the file: a plan of this bt is never unindexed
            if os.path.lexists(path):
                self._folders.set_aside(path)
            durable.write_bytes_durably(path, raw)
        self.add_to_index(plan_hash)  # and after: `bt fsck --repair` may have dropped it meanwhile
        previous = self.meta(plan_hash)
        now = clock.iso_seconds()
        record = {"created": previous.get("created", now), **previous, **meta, "planned": now}
        # Planning a stored plan again from the same place moves only the time it was planned:
        # that refresh is replaced atomically but not fsynced (a null build of a preset syncs
        # nothing), since a crash that loses it loses a hint (see meta), never a plan.
        moved_only_the_time = {**record, "planned": previous.get("planned")} == previous
        try:
            self._folders.replace_file(
                self.meta_path(plan_hash),
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

    def hashes(self) -> list[str]:
        if not self.dir.is_dir():
            return []
        return sorted(p.name[:-5] for p in self.dir.glob("*.json") if not p.name.endswith(META_SUFFIX))

    def resolve(self, ref: str) -> str:
        """The full hash of the one stored plan that `ref` (a hash or unique prefix) names.
        A full hash is looked up by its path and a prefix in the index (`store/plan_index.py`):
        neither lists plans/, unless the index knows no plan with that prefix."""
        ref = ref.strip().lower()
        if not HEX.match(ref) or len(ref) < MIN_PREFIX:
            raise UsageError(f"'{ref}' is not a plan hash or a prefix of at least {MIN_PREFIX} hex digits")
        if layout.HASH_NAME.match(ref):
            matches = [ref] if os.path.lexists(self.path(ref)) else []
        else:
            matches = self._indexed(ref)
        if not matches and not_a_folder(self.dir):
            self._folders.check_layout()  # plans/ is a file or a link: say so, not "no such plan"
        if not matches:
            raise UsageError(
                f"no plan {ref} in the store {self._folders.root}; compile one with: bt plan PRESET"
            )
        if len(matches) > 1:
            listed = ", ".join(m[: layout.SHORT] for m in matches[:5])
            raise UsageError(f"plan prefix {ref} is ambiguous ({listed}); give more digits")
        return matches[0]

    def add_to_index(self, plan_hash: str) -> None:
        """Add a plan to the index (best effort: a read-only store is searched by listing)."""
        with contextlib.suppress(OSError, CorruptObject):
            self._folders.folder(self.index.folder)
            self.index.add(plan_hash)

    def rebuild_index(self) -> None:
        """Index every stored plan and mark the index complete (`bt fsck --repair`, and the
        first lookup by prefix in a store without an index)."""
        self._folders.folder(self.index.folder)
        self.index.rebuild(self.hashes())

    def index_problems(self) -> list[str]:
        """What is wrong with the plan index (`bt fsck`); [] when it is sound, or not complete
        yet (`bt plan` adds entries, and the first lookup by prefix completes it). Only a stored
        plan missing from a complete index is wrong: a prefix could then resolve to another plan
        without seeing it. An entry whose plan is gone (a plan file deleted by hand) is skipped by
        every lookup, so it is no damage (an empty file, dropped when the index is next repaired)."""
        if not self.index.is_ready():
            return []
        missing = sorted(set(self.hashes()) - self.index.indexed())
        if not missing:
            return []
        return [f"{len(missing)} stored plan(s) not indexed ({missing[0][: layout.SHORT]}, ...)"]

    def repair_index(self) -> None:
        """Drop the entries of plans that are not stored, then index every stored plan."""
        self.index.prune(set(self.hashes()))
        self.rebuild_index()

    def _indexed(self, prefix: str) -> list[str]:
        """Stored plans whose hash starts with `prefix`, through the index; an index that is not
        complete, or that knows none, is checked against a listing of plans/ (and rebuilt)."""
        if self.index.is_ready():
            matches = self.index.matches(prefix)
            if matches:
                return matches
        listed = [h for h in self.hashes() if h.startswith(prefix)]
        # Only in a marked store (a lookup never marks one), and a read-only store is listed every time.
        with contextlib.suppress(OSError, CorruptObject):
            if (listed or not self.index.is_ready()) and self._folders.is_marked():
                self.rebuild_index()
        return listed

    def read(self, ref: str) -> tuple[str, bytes]:
        """(full hash, stored bytes) of the plan `ref` names; unchecked: `plan.stored.load_plan`
        trusts them only once they decode to a plan with that hash."""
        plan_hash = self.resolve(ref)
        path = self.path(plan_hash)
        try:
            if path.is_symlink():
                raise ValueError("a symbolic link, not a stored plan")
            return plan_hash, path.read_bytes()
        except (OSError, ValueError) as exc:
            raise CorruptObject(
                f"plan {plan_hash[:12]} in {self._folders.root} is damaged ({exc}); run bt fsck, "
                "then plan it again from its preset (bt plan PRESET)"
            ) from None

    def meta(self, plan_hash: str) -> dict[str, Any]:
        """When and from where the plan was made; {} when absent or damaged (it only holds hints:
        data files are found by content, so lost metadata costs a search, never a wrong file)."""
        return read_meta(self.meta_path(plan_hash), plan_hash) or {}

    def path(self, plan_hash: str) -> Path:
        return self.dir / layout.json_name(plan_hash)

    def meta_path(self, plan_hash: str) -> Path:
        return self.dir / f"{plan_hash}{META_SUFFIX}"

    def sweep_path(self, sweep_hash: str) -> Path:
        return self._folders.sweeps / layout.json_name(sweep_hash)
