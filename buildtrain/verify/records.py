"""`bt gc --records`: prune run records, which pile up in `experiments/` (every null build adds one).

What goes: a record of a null build (the run finished and executed nothing: its log says only
"cached"), unless it is its plan's newest record; with `keep`, also every record of a plan past
its `keep` newest. What stays: any record that executed a step, failed or was interrupted (the
only copy of that run's log and TensorBoard events) unless `keep` says otherwise; a run still
going (its summary is written last); and anything that is not a run record: a folder counts only
when its name is `<UTC time>-<plan hash prefix>[.N]` and its summary.json names it, so a typo'd
`--experiments` deletes nothing of the user's. Links are never followed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import attrs

RECORD_NAME = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{12}(?:\.(\d+))?$")
SUMMARY = "summary.json"


@attrs.frozen(kw_only=True)
class RecordFolder:
    folder: Path
    plan: str
    null_build: bool  # finished, nothing executed or joined

    @property
    def order(self) -> tuple[str, int]:
        """Oldest first: the start time in the name, then the `.N` of records of the same second."""
        match = RECORD_NAME.match(self.folder.name)
        return self.folder.name.split(".")[0], int(match.group(1) or 0) if match else 0


@attrs.frozen(kw_only=True)
class Pruned:
    removed: tuple[Path, ...]
    kept: int
    freed: int  # bytes
    left: tuple[str, ...]  # "PATH: why" for each record that could not be removed


def read_record(folder: Path) -> RecordFolder | None:
    """The record in `folder`, or None when it is not a finished run record."""
    if folder.is_symlink() or not folder.is_dir() or not RECORD_NAME.match(folder.name):
        return None
    summary = folder / SUMMARY
    try:
        if summary.is_symlink():
            return None
        body = json.loads(summary.read_bytes())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(body, dict)
        or body.get("run_id") != folder.name
        or not isinstance(body.get("plan"), str)
    ):
        return None
    done = body.get("outcome") == "done" and body.get("exit_code") == 0
    return RecordFolder(
        folder=folder,
        plan=body["plan"],
        null_build=done and not body.get("executed") and not body.get("joined"),
    )


def doomed(records: Sequence[RecordFolder], keep: int | None) -> list[RecordFolder]:
    """The records to remove: per plan, null builds but the newest record, and past `keep`."""
    by_plan: dict[str, list[RecordFolder]] = {}
    for record in sorted(records, key=lambda r: r.order, reverse=True):  # newest first
        by_plan.setdefault(record.plan, []).append(record)
    out = []
    for newest_first in by_plan.values():
        for index, record in enumerate(newest_first):
            if (index > 0 and record.null_build) or (keep is not None and index >= keep):
                out.append(record)
    return sorted(out, key=lambda r: r.order)


def _size(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):  # does not follow links
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def prune_records(experiments: Path, keep: int | None = None, dry_run: bool = False) -> Pruned:
    folders = sorted(experiments.iterdir()) if experiments.is_dir() and not experiments.is_symlink() else []
    records = [record for folder in folders if (record := read_record(folder)) is not None]
    removed, left, freed = [], [], 0
    for record in doomed(records, keep):
        size = _size(record.folder)
        if not dry_run:
            try:
                shutil.rmtree(record.folder)
            except OSError as exc:
                left.append(f"{record.folder}: {exc.strerror or exc}")
                continue
        removed.append(record.folder)
        freed += size
    return Pruned(removed=tuple(removed), kept=len(records) - len(removed), freed=freed, left=tuple(left))
