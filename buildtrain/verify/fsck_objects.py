"""`bt fsck`'s checks, one per family of stored objects: plans, sweeps, step outputs, work folders
(checkpoints and trace segments), evaluation results, metrics, caches, fetched data files, the plan
index and locks. Each re-hashes its objects in full and returns (objects checked, the damaged ones);
none repairs anything (`verify/fsck.py` runs them in order and repairs). Every path comes from the
`Store` and `store/layout.py`; these checks spell none.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import BuildtrainError
from buildtrain.kinds import kind_of
from buildtrain.kinds.kind import stored_problems
from buildtrain.plan.card import read_card
from buildtrain.plan.plan import Step
from buildtrain.plan.stored import load_plan
from buildtrain.plan.sweep import sweep_problem
from buildtrain.sources.stat_cache import hash_regular
from buildtrain.store import layout, trace
from buildtrain.store.checkpoints import checkpoint_problems, state_problem
from buildtrain.store.evals import entry_problem
from buildtrain.store.meta import read_meta
from buildtrain.store.metrics import step_metrics_problem
from buildtrain.store.plans import META_SUFFIX
from buildtrain.store.store import Store


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


Found = tuple[int, list[Damage]]  # (objects checked, the damaged ones)


def _listing(folder: Path) -> list[Path]:
    """The entries of a store folder, leaving out the temporary files of atomic writes."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def relative(store: Store, path: Path | str) -> str:
    return Path(path).relative_to(store.root).as_posix()


@attrs.frozen
class Known:
    """What the loadable plans say of the store's objects: who refers to each step output
    ('label of plan PREFIX'), and the step itself (its kind says what else to check in it)."""

    labels: dict[str, list[str]]
    steps: dict[str, Step]


def _plain_file_problem(path: Path, what: str) -> str | None:
    if path.is_symlink():
        return f"a symbolic link, not {what}"
    if not path.is_file():
        return f"not a regular file ({what} expected)"
    return None


def _folders(store: Store, _: Known) -> Found:
    """A link or a file in place of a store folder: bt run refuses to write through it."""
    problems = store.folder_problems()
    found = [
        Damage(object=name, kind="store folder", problems=[f"{problem}, not a folder"])
        for name, problem in problems
    ]
    return len(problems), found


def _plans(store: Store, _: Known) -> Found:
    found, entries = [], _listing(store.plans.dir)
    for path in entries:
        name = relative(store, path)
        plan_hash = layout.hash_of(path.name, META_SUFFIX) or layout.hash_of(path.name)
        if plan_hash is None:
            found.append(Damage(object=name, kind="foreign file", problems=["not a plan or plan metadata"]))
        elif path.name.endswith(META_SUFFIX):
            if read_meta(path, plan_hash) is None:
                problem = _plain_file_problem(path, "plan metadata") or "does not match its seal or its plan"
                found.append(Damage(object=name, kind="plan metadata", problems=[problem]))
        else:
            try:
                load_plan(store, plan_hash)
            except BuildtrainError as exc:
                found.append(Damage(object=name, kind="plan", problems=[str(exc)]))
    return len(entries), found


def _sweeps(store: Store, _: Known) -> Found:
    """A sweep must hash to its name and name only stored plans (`bt run SWEEP` runs them all)."""
    stored = set(store.plans.hashes())
    found, entries = [], _listing(store.sweeps)
    for path in entries:
        plans, problem = sweep_problem(path) if layout.hash_of(path.name) else ([], "not a stored sweep")
        missing = [plan[: layout.SHORT] for plan in plans if plan not in stored]
        if problem is None and missing:
            problem = f"names plan(s) {', '.join(missing)} that are not in the store (dropped or lost)"
        if problem is not None:
            found.append(Damage(object=relative(store, path), kind="sweep", problems=[problem]))
    return len(entries), found


def output_damage(store: Store, step_hash: str, known: Known) -> Damage | None:
    """The check of one step output: every file against its sealed manifest, the manifest
    against its digest and its folder name, then what its kind checks (its declared digests
    computed again from its files: a resealed forgery passes every blake3; a train output's
    checkpoints carry its step's hash). Drops the output's stamp when it is damaged."""
    problems = store.outputs.verify(step_hash)
    step = known.steps.get(step_hash)
    if not problems and step is not None:
        problems = stored_problems(kind_of(step.kind), step_hash, store.outputs.path(step_hash), step.config)
    if not problems:
        return None
    store.outputs.drop_stamp(step_hash)
    return Damage(
        object=relative(store, store.outputs.path(step_hash)),
        kind="step output",
        problems=problems,
        referenced_by=known.labels.get(step_hash, ["no stored plan"]),
        step=step_hash,
    )


def _outputs(store: Store, known: Known) -> Found:
    entries = _listing(store.steps)
    found = [damage for path in entries if (damage := output_damage(store, path.name, known))]
    return len(entries), found


def _work(store: Store, known: Known) -> Found:
    checked, found = 0, []
    for work in _listing(store.work):
        guard = work.name if layout.HASH_NAME.match(work.name) else None
        folder = store.outputs.checkpoints_dir(work.name)
        # A file or link in place of the work folder, its checkpoints or their trace segments:
        # resume could not write there.
        places = (work, folder, layout.trace_segments(folder))
        misplaced = next((p for p in places if os.path.lexists(p) and _not_a_folder(p)), None)
        if misplaced is not None:
            checked += 1
            problem = _not_a_folder(misplaced) or ""
            found.append(
                Damage(object=relative(store, misplaced), kind="work folder", problems=[problem], step=guard)
            )
            continue
        for path in _listing(folder):
            update = layout.checkpoint_update(path.name)
            if update is None:
                continue  # set aside by resume (damaged-step-...), removed with the work folder
            checked += 1
            problems = checkpoint_problems(path, update, {"step_hash": work.name})
            if not problems and (problem := state_problem(path, update, required=False)):
                problems = [problem]  # resume refuses it too (a forged or damaged state)
            if problems:
                found.append(
                    Damage(
                        object=relative(store, path),
                        kind="checkpoint",
                        problems=problems,
                        referenced_by=known.labels.get(work.name, ["no stored plan"]),
                        note="resume skips it and falls back to an older checkpoint",
                        step=guard,
                    )
                )
        count, damaged = _segments(store, work.name, layout.trace_segments(folder), known)
        checked, found = checked + count, found + damaged
    return checked, found


def _segments(store: Store, step_hash: str, pool: Path, known: Known) -> Found:
    """The trace segments beside a step's checkpoints: each must hash to its name."""
    segments = _listing(pool)
    found = [
        Damage(
            object=relative(store, path),
            kind="trace segment",
            problems=[problem],
            referenced_by=known.labels.get(step_hash, ["no stored plan"]),
            note="a build whose trace links to it starts the step again from update 1",
            step=step_hash if layout.HASH_NAME.match(step_hash) else None,
        )
        for path in segments
        if (problem := trace.pool_problem(path)) is not None
    ]
    return len(segments), found


def _not_a_folder(path: Path) -> str | None:
    if path.is_symlink():
        return "a symbolic link, not a folder"
    return None if path.is_dir() else "a file, not a folder"


def _evals(store: Store, _: Known) -> Found:
    found, entries = [], _listing(store.evals)
    for path in entries:
        key = layout.hash_of(path.name)
        _, problem = entry_problem(path, key) if key else (None, "not an evaluation result")
        if problem is not None:
            found.append(Damage(object=relative(store, path), kind="evaluation result", problems=[problem]))
    return len(entries), found


def _metrics(store: Store, _: Known) -> Found:
    """Plan cards and step summaries: what `bt ls --metrics` and `bt report` show."""
    found = []
    cards, summaries = _listing(store.cards), _listing(store.step_metrics)
    for path in cards:
        plan_hash = layout.hash_of(path.name)
        problem = _plain_file_problem(path, "a plan card") or (
            None if plan_hash and read_card(store, plan_hash) else "does not match its digest or its plan"
        )
        if problem is not None:
            note = "a cache: it is computed again from the plan"
            found.append(
                Damage(object=relative(store, path), kind="plan card", problems=[problem], note=note)
            )
    for path in summaries:
        step_hash = layout.hash_of(path.name)
        problem = _plain_file_problem(path, "a metrics summary") or (
            step_metrics_problem(str(path), step_hash)[1] if step_hash else "not a step's metrics summary"
        )
        if problem is not None:
            note = "never shown: tables leave its numbers blank"
            found.append(
                Damage(object=relative(store, path), kind="metrics summary", problems=[problem], note=note)
            )
    return len(cards) + len(summaries), found


def _caches(store: Store, _: Known) -> Found:
    found, entries = [], _listing(store.stamps)
    for path in entries:
        step_hash = layout.hash_of(path.name)
        problem = store.outputs.stamp_problem(step_hash) if step_hash else "not a stamp"
        if problem is not None:
            note = "a stamp only saves a re-hash; a damaged one is ignored"
            found.append(Damage(object=relative(store, path), kind="stamp", problems=[problem], note=note))
    checked = len(entries)
    if os.path.lexists(store.stat_cache_path):
        checked += 1
        if store.stat_cache().damaged:
            path = store.stat_cache_path
            problem = _plain_file_problem(path, "the stat cache") or "does not match its digest"
            note = "no digest is trusted from it; it is rebuilt"
            found.append(
                Damage(object=relative(store, path), kind="stat cache", problems=[problem], note=note)
            )
    return checked, found


def _fetched_sources(store: Store, _: Known) -> Found:
    """Data files fetched from a bucket (`cache/sources/<blake3>`): each re-hashed against its name."""
    found, entries = [], _listing(store.source_cache)
    for path in entries:
        problem = _plain_file_problem(path, "a fetched data file")
        if problem is None and not layout.HASH_NAME.match(path.name):
            problem = "not named by a blake3 digest"
        if problem is None:
            try:
                content, _size = hash_regular(path)
                if content != path.name:
                    problem = f"its bytes hash to {content[:16]}…, not to its name"
            except OSError as exc:
                problem = f"unreadable ({exc.strerror or exc})"
        if problem is not None:
            note = "a copy of an object in a bucket: removed, it is fetched again when a run needs it"
            found.append(
                Damage(object=relative(store, path), kind="fetched data file", problems=[problem], note=note)
            )
    return len(entries), found


def _plan_index(store: Store, _: Known) -> Found:
    """The plan index must list exactly the stored plans (it is rebuilt, never trusted alone)."""
    problems = store.plans.index_problems()
    if not problems:
        return int(store.plans.index.is_ready()), []
    note = "an optimisation only: every plan is found through plans/; it is rebuilt from there"
    return 1, [Damage(object=layout.PLAN_INDEX, kind="plan index", problems=problems, note=note)]


def _locks(store: Store, _: Known) -> Found:
    found, entries = [], _listing(store.locks.dir)
    for path in entries:
        problem = _plain_file_problem(path, "a lock file")
        if problem is not None:
            found.append(Damage(object=relative(store, path), kind="lock", problems=[problem]))
    return len(entries), found


# In the order `bt fsck` runs them: the store's own folders first, since every other check reads
# through them.
CHECKS: tuple[Callable[[Store, Known], Found], ...] = (
    _folders,
    _plans,
    _sweeps,
    _outputs,
    _work,
    _evals,
    _metrics,
    _caches,
    _fetched_sources,
    _plan_index,
    _locks,
)
