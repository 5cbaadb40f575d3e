"""The index of stored plans by hash prefix, so that naming a plan by a prefix does not list plans/.

`cache/plans/<first two hex digits>/<plan hash>`: one empty file per stored plan, fanned out by
prefix like git's objects, plus `cache/plans/INDEX.json` once a full build of the index is done.
Listing plans/ on every lookup made `bt ls` at 1,000 plans take 5.35 s (a lookup per plan); one
bucket holds about 1/256th of the plans.

The index is an optimisation only: plans/ stays the truth. An entry is a hint that is checked
(its plan file must exist, and the loaded plan must hash to its name, as for every lookup); an
entry whose plan is gone is skipped. Adding is creating a file, so concurrent `bt plan` processes
never lose one another's entries (no read-modify-write, no lock); entries are removed only by
`bt gc --drop` (with their plan) and `bt fsck --repair`. A plan written without an entry (by an
older bt, or copied in) is found by its full hash at once; a prefix that matches nothing in the
index falls back to listing plans/ and rebuilds the index when that finds the plan.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from buildtrain.canonical import canonical_bytes
from buildtrain.sources import durable
from buildtrain.store import objects
from buildtrain.store.layout import HASH_NAME

FAN_OUT = 2  # hex digits of a bucket's name: 256 buckets
READY_BODY = {"format": 1, "index": "plans"}  # INDEX.json: a full build of the index is done
READY = "INDEX.json"


class PlanIndex:
    def __init__(self, folder: Path, plans: Path) -> None:
        self.folder = folder
        self.plans = plans
        self.ready_path = folder / READY

    def entry(self, plan_hash: str) -> Path:
        return self.folder / plan_hash[:FAN_OUT] / plan_hash

    def add(self, plan_hash: str) -> None:
        """Record a plan (idempotent, atomic: the file exists or not). Raises OSError."""
        path = self.entry(plan_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))

    def remove(self, plan_hash: str) -> None:
        with contextlib.suppress(OSError):
            self.entry(plan_hash).unlink()

    def is_ready(self) -> bool:
        try:
            return not self.ready_path.is_symlink() and self.ready_path.read_bytes() == canonical_bytes(
                READY_BODY
            )
        except OSError:
            return False

    def rebuild(self, plan_hashes: Iterable[str]) -> None:
        """Add every stored plan, then mark the index complete. Never removes an entry: a plan
        being saved right now adds its own entry before and after its file is written."""
        for plan_hash in plan_hashes:
            self.add(plan_hash)
        durable.write_bytes_durably(self.ready_path, canonical_bytes(READY_BODY), durable=False)

    def prune(self, stored: set[str]) -> list[str]:
        """Remove the entries of plans that are not `stored` (anything else in the buckets too);
        returns their names. An entry added meanwhile by a plan being saved is added again by
        that save once its file is written."""
        removed = []
        with contextlib.suppress(OSError):
            for bucket in os.scandir(self.folder):
                if not bucket.is_dir(follow_symlinks=False):
                    continue
                for name in os.listdir(bucket.path):
                    if name not in stored or not name.startswith(bucket.name):
                        objects.remove_tree(Path(bucket.path) / name)
                        removed.append(name)
        return removed

    def indexed(self) -> set[str]:
        """Every entry (its plan may be gone)."""
        found: set[str] = set()
        with contextlib.suppress(OSError):
            for bucket in os.scandir(self.folder):
                if bucket.is_dir(follow_symlinks=False):
                    found.update(n for n in os.listdir(bucket.path) if n.startswith(bucket.name))
        return found

    def matches(self, prefix: str) -> list[str]:
        """Hashes in the index that start with `prefix` (at least FAN_OUT digits) and whose plan
        file is there, sorted."""
        try:
            names = os.listdir(self.folder / prefix[:FAN_OUT])
        except OSError:
            return []
        return sorted(
            name
            for name in names
            if name.startswith(prefix)
            and HASH_NAME.match(name)
            and os.path.lexists(self.plans / f"{name}.json")
        )
