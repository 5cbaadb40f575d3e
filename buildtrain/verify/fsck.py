"""`bt fsck`: re-hash every object in the store and say what each damaged one breaks.

Every stored object is checked in full against the digest that names or seals it, and against the
name it is found under, ignoring every stamp:

- plans: their bytes must hash to their name; plan metadata: its seal, which names the plan;
- step outputs and checkpoints: every file against the sealed manifest, the manifest against its
  own digest and against the folder name (a checkpoint's state also records its step and step hash);
- evaluation results: a seal over their key, identity and value;
- sweeps: their bytes must hash to their name, and every plan they name must be stored;
- plan cards and step metrics summaries (`metrics/`): framed by a digest and bound to their name;
- stamps, locks and the stat cache: sealed (stamps, cache) and plain files where files belong;
- data files fetched from a bucket (`cache/sources/`): their bytes must hash to their name.

Links, and folders or files where the other is expected, are damage too, the store's own folders
included. `check` only reads, apart from dropping the stamp of an output it finds damaged, so the
next `bt run` re-hashes and rebuilds it; `repair` first moves a link or file found in place of a
store folder aside, then moves every damaged object to quarantine/ (or removes it, for the caches
and summaries), each step's objects under that step's lock, after which `bt run` rebuilds what is
missing. Every path comes from the `Store` and `store/layout.py`; fsck spells none. The checks,
one per family of objects, are in `verify/fsck_objects.py`; this module runs them and repairs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs

from buildtrain.errors import BuildtrainError, Locked
from buildtrain.plan.plan import Step
from buildtrain.plan.stored import claim_store, load_plan
from buildtrain.store import layout
from buildtrain.store.store import Store
from buildtrain.verify.fsck_objects import CHECKS, Damage, Known, relative

# Derived records: a damaged one is removed, never kept (they are recomputed or left blank).
CACHES = ("stamp", "stat cache", "plan card", "metrics summary", "fetched data file")


@attrs.frozen(kw_only=True)
class FsckResult:
    store: str
    checked: int
    damaged: list[Damage]
    repaired: list[str] = attrs.Factory(list)  # 'object: what was done'
    not_repaired: list[str] = attrs.Factory(list)  # 'object: why not'


def _known(store: Store) -> Known:
    labels: dict[str, list[str]] = {}
    steps: dict[str, Step] = {}
    for plan_hash in store.plans.hashes():
        try:
            plan = load_plan(store, plan_hash)
        except BuildtrainError:  # reported as a damaged plan
            continue
        for step in plan.steps:
            labels.setdefault(step.hash, []).append(
                f"{step.label} of plan {plan_hash[: layout.SHORT]} '{plan.name}'"
            )
            steps[step.hash] = step
    return Known(labels, steps)


def check(store: Store) -> tuple[list[dict[str, Any]], int]:
    """(damaged objects as JSON-ready dicts, number of objects checked)."""
    result = scan(store)
    return [item.to_json() for item in result.damaged], result.checked


def scan(store: Store) -> FsckResult:
    """Re-hash every object in full; drop the stamps of damaged outputs (best effort)."""
    known = _known(store)
    checked, damaged = 0, []
    for run_check in CHECKS:
        count, found = run_check(store, known)
        checked += count
        damaged += found
    return FsckResult(store=str(store.root), checked=checked, damaged=damaged)


def repair(store: Store, result: FsckResult) -> FsckResult:
    """Move every damaged object to quarantine/ (caches are removed), under its step's lock; an
    object whose step is being built right now is left for a later `bt fsck --repair`. Links or
    files in place of store folders go first (quarantine/ itself before the rest), since every
    other repair writes into those folders."""
    repaired, not_repaired = [], []
    folders = sorted(
        (item for item in result.damaged if item.kind == "store folder"),
        key=lambda item: item.object != layout.QUARANTINE,
    )
    for item in folders:
        try:
            moved = store.clear_folder(item.object)
            if moved is not None:
                repaired.append(f"{item.object}: moved to {relative(store, moved)}")
        except OSError as exc:
            not_repaired.append(f"{item.object}: {exc.strerror or exc}")
    for item in result.damaged:
        if item.kind != "store folder":
            _repair_one(store, item, repaired, not_repaired)
    return attrs.evolve(result, repaired=repaired, not_repaired=not_repaired)


def _repair_one(store: Store, item: Damage, repaired: list[str], not_repaired: list[str]) -> None:
    path = store.root / item.object
    try:
        with contextlib.ExitStack() as stack:
            if item.step is not None and layout.HASH_NAME.match(item.step):
                stack.enter_context(store.locks.hold(item.step, wait=False))
            if item.kind == "plan index":
                store.plans.repair_index()
                repaired.append(f"{item.object}: rebuilt from plans/")
                return
            if item.kind in CACHES:
                store.set_aside(path, keep=False)
                repaired.append(f"{item.object}: removed")
                return
            if item.kind == "step output":
                store.outputs.drop_stamp(item.step or "")
            moved = store.set_aside(path)
            if moved is not None:
                repaired.append(f"{item.object}: moved to {relative(store, moved)}")
    except Locked:
        not_repaired.append(f"{item.object}: its step is being built by another bt run; try again later")
    except BuildtrainError as exc:
        not_repaired.append(f"{item.object}: {exc}")
    except OSError as exc:
        not_repaired.append(f"{item.object}: {exc.strerror or exc}")


def fsck(store: Store, *, fix: bool = False) -> FsckResult | None:
    """The result of a full check (and repair, with `fix`); None when there is no store. A
    folder that is not a store is refused (`UsageError`), and `--repair` needs a store that
    identifies itself (a store made before markers is recognised and marked first)."""
    found = store.identity()
    if found == "new":
        return None
    if found == "foreign" or fix:
        claim_store(store, create=False)
    result = scan(store)
    return repair(store, result) if fix and result.damaged else result
