"""A step kind is one module and one registry entry: a toy kind added to a copy of the package, and
nothing else changed, is planned, built, cached, verified, checked by fsck and collected by gc.

Also: every registered kind answers the protocol the layers above ask, and no module outside
`kinds/` tests a kind's name.
"""

from __future__ import annotations

import ast
import filecmp
import json
import shutil
from pathlib import Path

import pytest
from conftest import MICRO, run_bt

from buildtrain.kinds import KINDS, REGISTERED
from buildtrain.kinds.kind import StepKind
from buildtrain.plan import sources_digest

TOY = '''"""A toy kind: names the splits of the final stage's data step."""

from __future__ import annotations

import json

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.kinds.kind import StepKind
from buildtrain.plan.plan import Step


class ToyKind(StepKind):
    name = "toy"
    computes = "buildtrain.kinds.toy"  # its computation is in this module too

    def plan(self, planning, stage):
        data = planning.required("data", planning.config.final_stage.name)
        config = {"word": "splits"}
        toolchain = self.toolchain(config, planning.config.numerics)
        return Step.create(self.name, self.name, config, {"data": data.hash}, toolchain)


KIND = ToyKind()


def execute(ctx, out):
    index = json.loads((ctx.inputs["data"] / "data.json").read_bytes())
    body = {"splits": sorted(index["splits"])}
    (out / "toy.json").write_bytes(canonical_bytes(body))
    return {"toy": digest("toy", body)}
'''


@pytest.fixture(scope="module")
def with_toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package with the toy kind: one new module, one name in the registry."""
    root = tmp_path_factory.mktemp("toy")
    package = root / "buildtrain"
    shutil.copytree(sources_digest.PACKAGE_ROOT, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "kinds" / "toy.py").write_text(TOY, encoding="utf-8")
    registry = package / "kinds" / "__init__.py"
    text = registry.read_text(encoding="utf-8")
    assert text.count('"export")') == 1
    registry.write_text(text.replace('"export")', '"export", "toy")'), encoding="utf-8")
    return root


def test_the_toy_kind_changes_one_module_and_the_registry_only(with_toy: Path) -> None:
    comparison = filecmp.dircmp(sources_digest.PACKAGE_ROOT, with_toy / "buildtrain", ignore=["__pycache__"])
    changed: list[str] = []

    def walk(cmp: filecmp.dircmp, prefix: str) -> None:
        changed.extend(prefix + name for name in cmp.diff_files + cmp.left_only + cmp.right_only)
        for name, sub in cmp.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(comparison, "")
    assert sorted(changed) == ["kinds/__init__.py", "kinds/toy.py"]


def test_a_toy_kind_is_planned_built_cached_verified_checked_and_collected(
    with_toy: Path, tmp_path: Path
) -> None:
    store = tmp_path / ".bt"
    env = {"PYTHONPATH": str(with_toy)}

    def bt(*args: str) -> object:
        return run_bt(*args, store=store, env=env)

    planned = bt("plan", str(MICRO))
    assert planned.returncode == 0, planned.stderr
    plan = planned.stdout.strip()
    shown = json.loads(bt("show", plan, "--json").stdout)
    toy = next(step for step in shown["steps"] if step["kind"] == "toy")
    assert toy["hash"] in shown["targets"]  # nothing consumes it: the plan is built for it

    built = bt("run", plan)
    assert built.returncode == 0, built.stderr
    output = store / "steps" / toy["hash"]
    assert json.loads((output / "toy.json").read_bytes()) == {"splits": ["heldout", "train"]}
    again = bt("run", plan)
    assert again.returncode == 0 and "0 executed" in again.stderr, again.stderr

    verified = bt("verify", plan, "--threads", "1")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "toy" in verified.stderr and "reproduced" in verified.stderr

    assert bt("fsck").returncode == 0
    (output / "toy.json").write_bytes(b'{"splits":["train"]}')
    damaged = bt("fsck")
    assert damaged.returncode == 5 and f"steps/{toy['hash']}" in damaged.stdout + damaged.stderr

    collected = bt("gc", "--drop", plan)
    assert collected.returncode == 0, collected.stderr
    assert not (store / "steps").exists() or not any((store / "steps").iterdir())


@pytest.mark.parametrize("name", REGISTERED)
def test_every_registered_kind_says_where_it_computes(name: str) -> None:
    kind = KINDS[name]
    assert isinstance(kind, StepKind) and kind.name == name
    assert sources_digest.module_path(sources_digest.PACKAGE_ROOT, kind.computes) is not None
    assert type(kind).plan is not StepKind.plan  # every kind says how it enters a plan


def test_no_module_outside_the_kinds_tests_a_kind_by_name() -> None:
    """`step.kind == "train"`, `kind in ("data", ...)`: only `kinds/` may know kinds by name."""
    found = []
    for path in sorted(sources_digest.PACKAGE_ROOT.rglob("*.py")):
        if "kinds" in path.relative_to(sources_digest.PACKAGE_ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_bytes())):
            if not isinstance(node, ast.Compare):
                continue
            names = [node.left, *node.comparators]
            mentions_kind = any(
                (isinstance(n, ast.Attribute) and n.attr == "kind")
                or (isinstance(n, ast.Name) and n.id == "kind")
                for n in names
            )
            constants = [
                c.value
                for n in names
                for c in ([n] if isinstance(n, ast.Constant) else getattr(n, "elts", []))
                if isinstance(c, ast.Constant)
            ]
            if mentions_kind and any(value in KINDS for value in constants):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, f"kinds tested by name outside kinds/: {found}"
