"""`bt gc`: remove what no stored plan needs.

Removed: step outputs that no plan references, work folders of steps that are complete or no
longer referenced, leftover temporary folders, data files fetched from a bucket that no stored
plan reads, quarantined objects, stamps of outputs that are
gone, evaluation results that no step output holds, the cards and metrics summaries of plans and
steps that are gone, and stored sweeps that name a plan no longer stored (a sweep is a record of
a whole grid: once one of its plans is dropped, the rest stay as plain plans). Anything belonging
to a step whose lock is held (a `bt run` in progress) is left alone, and a plan being run cannot
be dropped (`Locked`, exit 7).

gc only ever works in a store that identifies itself (its marker, see `plan.stored.claim_store`): pointed at
any other folder it refuses before touching anything (exit 2).

gc fails safe: a plan that cannot be read might reference any output, so while one is damaged no
step output, work folder or evaluation result is removed (and gc says so). It never follows a
symbolic link: a link in the store is removed as a link, its size is not counted, and what it
points to is never touched. What could not be removed is reported as left, never as removed.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

import attrs

from buildtrain.errors import BuildtrainError
from buildtrain.kinds import kind_of
from buildtrain.plan.stored import claim_store, load_plan
from buildtrain.plan.sweep import sweep_problem
from buildtrain.store import objects
from buildtrain.store.store import Store


@attrs.define(kw_only=True)
class Collected:
    dropped: list[str] = attrs.Factory(list)  # plan hashes forgotten
    removed: list[str] = attrs.Factory(list)  # paths relative to the store (or would be, dry run)
    left: list[str] = attrs.Factory(list)  # 'path: why' for what could not be removed
    warnings: list[str] = attrs.Factory(list)
    freed: int = 0  # bytes
    busy: bool = False
    sources: set[str] = attrs.Factory(set)  # blake3 of the data files kept plans read


def _size(path: Path) -> int:
    """Bytes of the files under `path`, links not followed and not counted."""
    try:
        found = path.lstat()
    except OSError:
        return 0
    if stat.S_ISREG(found.st_mode):
        return found.st_size
    if not stat.S_ISDIR(found.st_mode):
        return 0
    total = 0
    for folder, _, names in os.walk(path):  # os.walk does not descend into linked folders
        for name in names:
            try:
                entry = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if stat.S_ISREG(entry.st_mode):
                total += entry.st_size
    return total


def _listing(folder: Path, pattern: str = "*") -> list[Path]:
    """Entries of a store folder; none if the folder itself is a link (it may lead anywhere)."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(folder.glob(pattern))


def _busy(store: Store) -> bool:
    """Whether any step lock is held right now."""
    for lock in _listing(store.locks.dir, "*.lock"):
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # a link or a folder is no lock anyone holds (bt fsck reports it)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def collect(store: Store, drop: list[str], dry_run: bool = False) -> Collected:
    collected = Collected()
    if not claim_store(store, create=False):
        return collected  # nothing there
    collected.warnings += [
        f"{name} is {problem}; run bt fsck --repair" for name, problem in store.folder_problems()
    ]
    for ref in drop:
        plan_hash = store.plans.resolve(ref)
        collected.dropped.append(plan_hash)
        if not dry_run:
            with store.locks.dropping(plan_hash):
                for path in (store.plans.path(plan_hash), store.plans.meta_path(plan_hash)):
                    objects.remove_tree(path)
                store.plans.index.remove(plan_hash)
    referenced, damaged_plans = _referenced(store, collected, dry_run)
    doomed = _doomed(store, collected, referenced, damaged_plans)
    for path in doomed:
        relative = str(path.relative_to(store.root))
        size = _size(path)
        if not dry_run:
            try:
                objects.remove_tree(path)
            except OSError as exc:
                collected.left.append(f"{relative}: {exc.strerror or exc}")
                continue
            if os.path.lexists(path):
                collected.left.append(f"{relative}: still there (permissions?)")
                continue
        collected.freed += size
        collected.removed.append(relative)
    return collected


def _referenced(store: Store, collected: Collected, dry_run: bool) -> tuple[dict[str, str], list[str]]:
    """(step hashes the kept plans reference, the plans that cannot be read). The digests of the
    data files their steps read are kept in `collected.sources`."""
    referenced: dict[str, str] = {}  # step hash -> its kind
    damaged_plans: list[str] = []
    for plan_hash in store.plans.hashes():
        if dry_run and plan_hash in collected.dropped:
            continue
        try:
            steps = load_plan(store, plan_hash).steps
        except BuildtrainError:
            damaged_plans.append(plan_hash)
            continue
        referenced.update((step.hash, step.kind) for step in steps)
        collected.sources.update(
            str(source.get("blake3")) for step in steps for source in step.inputs.get("sources", [])
        )
    if damaged_plans:
        listed = ", ".join(h[:12] for h in damaged_plans)
        collected.warnings.append(
            f"plan(s) {listed} cannot be read and may reference any output: no step output, work "
            "folder or evaluation result is removed; run bt fsck"
        )
    return referenced, damaged_plans


def _doomed(
    store: Store, collected: Collected, referenced: dict[str, str], damaged_plans: list[str]
) -> list[Path]:
    doomed: list[Path] = []
    outputs = _listing(store.steps)
    collected.busy = _busy(store)
    if not damaged_plans:
        doomed += [p for p in outputs if p.name not in referenced]
        if not collected.busy:
            doomed += [
                p for p in _listing(store.work) if p.name not in referenced or store.outputs.has(p.name)
            ]
    if not collected.busy:
        doomed += _listing(store.tmp)
        if not damaged_plans:  # a fetched data file goes with the last plan that reads it
            doomed += [p for p in _listing(store.source_cache) if p.name not in collected.sources]
    doomed += _listing(store.quarantined)
    kept_outputs = {p.name for p in outputs if p not in doomed}
    doomed += [p for p in _listing(store.stamps, "*.json") if p.stem not in kept_outputs]
    # What bt ls --metrics reads: a plan's card and a step's metrics summary go with their object.
    kept_plans = set(store.plans.hashes()) - set(collected.dropped)
    doomed += [p for p in _listing(store.cards, "*.json") if p.stem not in kept_plans]
    doomed += [p for p in _listing(store.sweeps, "*.json") if _names_a_gone_plan(p, kept_plans)]
    if not damaged_plans:
        doomed += [p for p in _listing(store.step_metrics, "*.json") if p.stem not in referenced]
        kept_evals = {
            key for p in outputs if p.name in referenced for key in kind_of(referenced[p.name]).references(p)
        }
        doomed += [p for p in _listing(store.evals, "*.json") if p.stem not in kept_evals]
    return doomed


def _names_a_gone_plan(path: Path, kept_plans: set[str]) -> bool:
    """A sound sweep that names a plan no longer stored (a damaged one is left to bt fsck)."""
    plans, problem = sweep_problem(path)
    return problem is None and any(plan not in kept_plans for plan in plans)
