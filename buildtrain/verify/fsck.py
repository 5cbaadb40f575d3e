"""`bt fsck`: re-hash every object in the store and say what each damaged one breaks.

Every stored object is checked in full against the digest that names or seals it, and against the
name it is found under, ignoring every stamp:

- plans: their bytes must hash to their name; plan metadata: its seal, which names the plan;
- step outputs and checkpoints: every file against the sealed manifest, the manifest against its
  own digest and against the folder name (a checkpoint's state also records its step and step hash);
- evaluation results: a seal over their key, identity and value;
- stamps, locks and the stat cache: sealed (stamps, cache) and plain files where files belong.

Links, and folders or files where the other is expected, are damage too. `check` only reads, apart
from dropping the stamp of an output it finds damaged, so the next `bt run` re-hashes and rebuilds
it; `repair` moves every damaged object to quarantine/ (or removes it, for the caches), each step's
objects under that step's lock, after which `bt run` rebuilds what is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import BuildtrainError, Locked
from buildtrain.plan.stored import load_plan
from buildtrain.steps.eval_cache import entry_problem
from buildtrain.steps.train.identity import checkpoint_problems, checkpoint_update
from buildtrain.store.meta import read_meta
from buildtrain.store.store import Store

HASH_NAME = re.compile(r"^[0-9a-f]{64}$")
# The folders of a store; each must be a real folder (a link would take fsck and gc elsewhere).
FOLDERS = ("plans", "steps", "work", "evals", "locks", "tmp", "quarantine", "cache", "cache/verified")


@attrs.frozen(kw_only=True)
class Damage:
    object: str  # path relative to the store root
    kind: str
    problems: list[str]
    referenced_by: list[str] = attrs.Factory(list)
    note: str = ""
    step: str | None = None  # the step whose lock guards the object, if any

    def to_json(self) -> dict[str, Any]:
        body = attrs.asdict(self)
        del body["step"]
        if not body["note"]:
            del body["note"]
        return body


@attrs.frozen(kw_only=True)
class Report:
    store: str
    checked: int
    damaged: list[Damage]
    repaired: list[str] = attrs.Factory(list)  # 'object: what was done'
    not_repaired: list[str] = attrs.Factory(list)  # 'object: why not'


def _listing(folder: Path) -> list[Path]:
    """The entries of a store folder, leaving out the temporary files of atomic writes."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def _referrers(store: Store) -> dict[str, list[str]]:
    """Step hash -> 'label of plan PREFIX' for every loadable plan."""
    found: dict[str, list[str]] = {}
    for plan_hash in store.plan_hashes():
        try:
            plan = load_plan(store, plan_hash)
        except BuildtrainError:  # reported as a damaged plan
            continue
        for step in plan.steps:
            found.setdefault(step.hash, []).append(f"{step.label} of plan {plan_hash[:12]} '{plan.name}'")
    return found


def _plain_file_problem(path: Path, what: str) -> str | None:
    if path.is_symlink():
        return f"a symbolic link, not {what}"
    if not path.is_file():
        return f"not a regular file ({what} expected)"
    return None


def check(store: Store) -> tuple[list[dict[str, Any]], int]:
    """(damaged objects as JSON-ready dicts, number of objects checked)."""
    report = scan(store)
    return [item.to_json() for item in report.damaged], report.checked


def scan(store: Store) -> Report:
    """Re-hash every object in full; drop the stamps of damaged outputs (best effort)."""
    damaged: list[Damage] = []
    checked = 0
    referrers = _referrers(store)
    root = store.root

    for name in FOLDERS:
        folder = root / name
        if folder.is_symlink() or (os.path.lexists(folder) and not folder.is_dir()):
            checked += 1
            damaged.append(
                Damage(object=name, kind="store folder", problems=["not a folder (a link or a file)"])
            )

    for path in _listing(store.plans):
        checked += 1
        relative = f"plans/{path.name}"
        if path.name.endswith(".meta.json"):
            plan_hash = path.name[: -len(".meta.json")]
            if read_meta(path, plan_hash) is None:
                problem = _plain_file_problem(path, "plan metadata") or "does not match its seal or its plan"
                damaged.append(Damage(object=relative, kind="plan metadata", problems=[problem]))
        elif path.name.endswith(".json") and HASH_NAME.match(path.name[:-5]):
            try:
                load_plan(store, path.name[:-5])
            except BuildtrainError as exc:
                damaged.append(Damage(object=relative, kind="plan", problems=[str(exc)]))
        else:
            damaged.append(
                Damage(object=relative, kind="foreign file", problems=["not a plan or plan metadata"])
            )

    for path in _listing(store.steps):
        checked += 1
        problems = store.verify_output(path.name)
        if problems:
            store.drop_stamp(path.name)
            damaged.append(
                Damage(
                    object=f"steps/{path.name}",
                    kind="step output",
                    problems=problems,
                    referenced_by=referrers.get(path.name, ["no stored plan"]),
                    step=path.name,
                )
            )

    for work in _listing(store.work):
        if work.is_symlink() or not work.is_dir():
            checked += 1
            damaged.append(Damage(object=f"work/{work.name}", kind="work folder", problems=["not a folder"]))
            continue
        for path in _listing(work / "checkpoints"):
            update = checkpoint_update(path.name)
            if update is None:
                continue  # set aside by resume (damaged-step-...), removed with the work folder
            checked += 1
            problems = checkpoint_problems(path, update, {"step_hash": work.name})
            if problems:
                damaged.append(
                    Damage(
                        object=f"work/{work.name}/checkpoints/{path.name}",
                        kind="checkpoint",
                        problems=problems,
                        referenced_by=referrers.get(work.name, ["no stored plan"]),
                        note="resume skips it and falls back to an older checkpoint",
                        step=work.name,
                    )
                )

    for path in _listing(store.evals):
        checked += 1
        key = path.name[:-5] if path.name.endswith(".json") else ""
        _, problem = entry_problem(path, key) if HASH_NAME.match(key) else (None, "not an evaluation result")
        if problem is not None:
            damaged.append(Damage(object=f"evals/{path.name}", kind="evaluation result", problems=[problem]))

    for path in _listing(root / "cache" / "verified"):
        checked += 1
        step_hash = path.name[:-5] if path.name.endswith(".json") else ""
        problem = store.stamp_problem(step_hash) if HASH_NAME.match(step_hash) else "not a stamp"
        if problem is not None:
            damaged.append(
                Damage(
                    object=f"cache/verified/{path.name}",
                    kind="stamp",
                    problems=[problem],
                    note="a stamp only saves a re-hash; a damaged one is ignored",
                )
            )

    cache_path = root / "cache" / "files.json"
    if os.path.lexists(cache_path):
        checked += 1
        if store.stat_cache().damaged:
            problem = _plain_file_problem(cache_path, "the stat cache") or "does not match its digest"
            damaged.append(
                Damage(
                    object="cache/files.json",
                    kind="stat cache",
                    problems=[problem],
                    note="no digest is trusted from it; it is rebuilt",
                )
            )

    for path in _listing(store.locks):
        checked += 1
        problem = _plain_file_problem(path, "a lock file")
        if problem is not None:
            damaged.append(Damage(object=f"locks/{path.name}", kind="lock", problems=[problem]))

    return Report(store=str(root), checked=checked, damaged=damaged)


def repair(store: Store, report: Report) -> Report:
    """Move every damaged object to quarantine/ (caches are removed), under its step's lock; an
    object whose step is being built right now is left for a later `bt fsck --repair`."""
    repaired, not_repaired = [], []
    for item in report.damaged:
        path = store.root / item.object
        try:
            with contextlib.ExitStack() as stack:
                if item.step is not None and HASH_NAME.match(item.step):
                    stack.enter_context(store.lock(item.step, wait=False))
                if item.kind in ("stamp", "stat cache"):
                    store.set_aside(path, keep=False)
                    repaired.append(f"{item.object}: removed")
                elif item.kind == "store folder":
                    not_repaired.append(f"{item.object}: move it aside by hand, then bt run")
                else:
                    if item.kind == "step output":
                        store.drop_stamp(item.step or "")
                    moved = store.set_aside(path)
                    if moved is not None:
                        repaired.append(f"{item.object}: moved to {moved.relative_to(store.root)}")
        except Locked:
            not_repaired.append(f"{item.object}: its step is being built by another bt run; try again later")
        except OSError as exc:
            not_repaired.append(f"{item.object}: {exc.strerror or exc}")
    return attrs.evolve(report, repaired=repaired, not_repaired=not_repaired)


def fsck(store: Store, *, fix: bool = False) -> Report | None:
    """The report of a full check (and repair, with `fix`); None when there is no store."""
    if not store.root.is_dir():
        return None
    report = scan(store)
    return repair(store, report) if fix and report.damaged else report
