"""`bt gc`: remove what no stored plan needs.

Removed: step outputs that no plan references, work folders of steps that are complete or no
longer referenced, leftover temporary folders, quarantined outputs, and evaluation results that no
step output holds. Anything belonging to a step whose lock is held (a `bt run` in progress) is
left alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path

from buildtrain.errors import ExitCode
from buildtrain.plan.canonical import digest
from buildtrain.steps.eval import EVAL_RESULT
from buildtrain.store import objects
from buildtrain.store.store import Store


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _busy(store: Store) -> bool:
    """Whether any step lock is held right now."""
    for lock in store.locks.glob("*.lock") if store.locks.is_dir() else []:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def collect(store: Store, drop: list[str], dry_run: bool = False) -> int:
    for ref in drop:
        plan_hash = store.resolve(ref)
        for path in (store.plans / f"{plan_hash}.json", store.plans / f"{plan_hash}.meta.json"):
            if not dry_run:
                path.unlink(missing_ok=True)
        print(f"{'would drop' if dry_run else 'dropped'} plan {plan_hash[:12]}", file=sys.stderr)

    referenced: set[str] = set()
    for plan_hash in store.plan_hashes():
        if dry_run and any(plan_hash.startswith(ref) for ref in drop):
            continue
        try:
            referenced.update(step.hash for step in store.load_plan(plan_hash).steps)
        except Exception:  # a damaged plan protects nothing; bt fsck reports it
            continue

    doomed: list[Path] = []
    outputs = sorted(store.steps.glob("*")) if store.steps.is_dir() else []
    doomed += [p for p in outputs if p.name not in referenced]
    busy = _busy(store)
    if not busy:
        work = sorted(store.work.glob("*")) if store.work.is_dir() else []
        doomed += [p for p in work if p.name not in referenced or store.has_output(p.name)]
        doomed += sorted(store.tmp.glob("*")) if store.tmp.is_dir() else []
    doomed += sorted(store.quarantined.glob("*")) if store.quarantined.is_dir() else []
    kept_outputs = {p.name for p in outputs if p.name in referenced}
    stamps = store.root / "cache" / "verified"
    doomed += (
        [p for p in sorted(stamps.glob("*.json")) if p.stem not in kept_outputs] if stamps.is_dir() else []
    )

    kept_evals = set()
    for output in outputs:
        if output.name in referenced and (output / EVAL_RESULT).is_file():
            try:
                kept_evals.add(digest("eval", json.loads((output / EVAL_RESULT).read_bytes())["identity"]))
            except (ValueError, KeyError):
                continue
    doomed += (
        [p for p in sorted(store.evals.glob("*.json")) if p.stem not in kept_evals]
        if store.evals.is_dir()
        else []
    )

    freed = 0
    for path in doomed:
        freed += _size(path)
        print(f"{'would remove' if dry_run else 'removed'} {path.relative_to(store.root)}", file=sys.stderr)
        if not dry_run:
            if path.is_dir():
                objects.remove_tree(path)
            else:
                path.unlink(missing_ok=True)
    if busy:
        print("note: a bt run holds a step lock; work and temporary folders were left alone", file=sys.stderr)
    print(
        f"bt gc: {'would free' if dry_run else 'freed'} {freed / 1e6:.1f} MB in {len(doomed)} item(s)",
        file=sys.stderr,
    )
    return ExitCode.OK
