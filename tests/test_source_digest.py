"""The toolchain digest covers exactly the code that computes a step: both ways.

Each test copies the package, edits one module of the copy (a comment is enough: the digest is
over bytes), and compiles the two-stage micro preset with a trained BPE (so the plan holds every
step kind) against the copy. A module a step kind computes with changes exactly the hashes of
that kind's steps and of the steps downstream of them; a module no step computes with changes no
hash at all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from buildtrain.kinds import KINDS
from buildtrain.plan import sources_digest
from buildtrain.plan.plan import Plan
from buildtrain.plan.planner import plan_preset
from buildtrain.plan.sources_digest import computing_modules, module_path
from buildtrain.store.store import Store

REPO = Path(__file__).resolve().parent.parent
MICRO_STAGES = REPO / "tests" / "presets" / "micro_stages.toml"
WITH_BPE = ['data.tokenizer={ kind = "bpe", vocab_size = 300 }']
PRESENTATION = (
    "buildtrain.cli",
    "buildtrain.report",
    "buildtrain.executor.progress",
    "buildtrain.executor.run",
    "buildtrain.verify.verify",
    "buildtrain.verify.watch",
    "buildtrain.verify.fsck",
    "buildtrain.config.reference",
)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("package") / "buildtrain"
    shutil.copytree(sources_digest.PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def compiled(root: Path, store: Store) -> Plan:
    """The micro preset's plan, with buildtrain's code read from `root`."""
    previous = sources_digest.PACKAGE_ROOT
    sources_digest.PACKAGE_ROOT = root
    sources_digest.clear_cache()  # the copy's files change between calls; a process's do not
    try:
        return plan_preset(MICRO_STAGES, WITH_BPE, store).plan
    finally:
        sources_digest.PACKAGE_ROOT = previous


def step_hashes(root: Path, store: Store) -> dict[str, str]:
    return {step.label: step.hash for step in compiled(root, store).steps}


def downstream(plan: Plan, labels: set[str]) -> set[str]:
    """`labels` and every step that reads one of them, directly or not."""
    found = set(labels)
    for step in plan.steps:  # plan order: inputs come first
        if any(plan.step(h).label in found for h in step.upstream.values()):
            found.add(step.label)
    return found


def edited(root: Path, module: str) -> Path:
    """Append a comment to `module` in the copy at `root`; returns the file, to restore it."""
    path = module_path(root, module)
    assert path is not None, module
    with path.open("a", encoding="utf-8") as handle:
        handle.write("\n# an edit\n")
    return path


def all_modules(root: Path) -> list[str]:
    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def changed_labels(root: Path, store: Store, module: str, before: dict[str, str]) -> set[str]:
    path = edited(root, module)
    original = path.read_bytes()[: -len(b"\n# an edit\n")]
    try:
        after = step_hashes(root, store)
    finally:
        path.write_bytes(original)
    return {label for label in before if before[label] != after[label]}


def test_presentation_modules_compute_nothing(package: Path) -> None:
    computing = {m for kind in KINDS for m in computing_modules(kind, package)}
    assert computing.isdisjoint(PRESENTATION)


def test_a_presentation_edit_changes_no_hash(package: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    before = step_hashes(package, store)
    computing = {m for kind in KINDS for m in computing_modules(kind, package)}
    outside = [m for m in all_modules(package) if m not in computing]
    assert set(PRESENTATION) <= set(outside)
    # All at once: had any of them entered a digest, some hash would change.
    paths = {module_path(package, m): module_path(package, m).read_bytes() for m in outside}
    for module in outside:
        edited(package, module)
    try:
        assert step_hashes(package, store) == before
    finally:
        for path, original in paths.items():
            path.write_bytes(original)


def test_a_computing_edit_changes_the_steps_it_computes(package: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    plan = compiled(package, store)
    before = {step.label: step.hash for step in plan.steps}
    assert {step.kind for step in plan.steps} == set(KINDS)  # every kind is exercised
    computing = {kind: computing_modules(kind, package) for kind in KINDS}
    for module in sorted(set().union(*computing.values())):
        users = {kind for kind, modules in computing.items() if module in modules}
        computed = {step.label for step in plan.steps if step.kind in users}
        # Exactly the steps it computes, and those downstream of them (through their inputs).
        assert changed_labels(package, store, module, before) == downstream(plan, computed), module
