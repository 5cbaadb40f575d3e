"""A benchmark-suite kind is one module and one registry entry (`config/suites/`), as a step kind
is: a toy suite kind added to a copy of the package, and nothing else changed, is validated,
checked at plan time, scored, cached and shown.

Also: every registered suite kind answers the protocol its callers ask, and no module outside the
suite kinds (their modules and the scoring modules they name) tests a suite kind by its name.
"""

from __future__ import annotations

import ast
import filecmp
import json
import shutil
from pathlib import Path

import pytest
from conftest import MICRO, run_bt

from buildtrain.config.suites import REGISTERED, SUITE_KINDS, accuracy
from buildtrain.config.suites.kind import SOURCE_KEYS, SuiteKind
from buildtrain.plan import sources_digest

PACKAGE = sources_digest.PACKAGE_ROOT
SUITES = PACKAGE / "config" / "suites"

TOY = '''"""A toy suite kind: each line of its file is a word; a model is right about a word of even length."""

from __future__ import annotations

from pathlib import Path

from buildtrain.config.suites.kind import SuiteKind
from buildtrain.errors import StepFailed


class Toy(SuiteKind):
    name = "toy"
    scores = "buildtrain.config.suites.toy"  # its scoring is in this module too
    scoring = 1
    accuracy_keys = ("even",)

    def check(self, files, context):
        if not Path(files["file"]).read_bytes().strip():
            raise StepFailed(f"{files['file']}: the toy suite has no words")


KIND = Toy()


def score_suite(loaded, config, suite, files, inputs, work):
    words = (files[0].path.read_bytes()).split()
    return {"kind": suite.kind, "questions": len(words), "even": sum(len(w) % 2 == 0 for w in words) / len(words)}
'''


@pytest.fixture(scope="module")
def with_toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package with the toy suite kind: one new module, one name in the registry."""
    root = tmp_path_factory.mktemp("toy")
    package = root / "buildtrain"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "config" / "suites" / "toy.py").write_text(TOY, encoding="utf-8")
    registry = package / "config" / "suites" / "__init__.py"
    text = registry.read_text(encoding="utf-8")
    assert text.count('"harness")') == 1
    registry.write_text(text.replace('"harness")', '"harness", "toy")'), encoding="utf-8")
    return root


def test_the_toy_suite_kind_changes_one_module_and_the_registry_only(with_toy: Path) -> None:
    comparison = filecmp.dircmp(PACKAGE, with_toy / "buildtrain", ignore=["__pycache__"])
    changed: list[str] = []

    def walk(cmp: filecmp.dircmp, prefix: str) -> None:
        changed.extend(prefix + name for name in cmp.diff_files + cmp.left_only + cmp.right_only)
        for name, sub in cmp.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(comparison, "")
    assert sorted(changed) == ["config/suites/__init__.py", "config/suites/toy.py"]


def test_a_toy_suite_is_checked_scored_cached_and_shown(with_toy: Path, tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    env = {"PYTHONPATH": str(with_toy)}

    def bt(*args: str) -> object:
        return run_bt(*args, store=store, env=env)

    (tmp_path / "words.txt").write_text("ab\nabc\nabcd\nxy\n")
    preset = tmp_path / "toy.toml"
    suite = '{ name = "words", kind = "toy", file = "words.txt" }'
    preset.write_text(f'extends = "{MICRO}"\n\n[eval]\nsuites = [{suite}]\n')

    (tmp_path / "empty.txt").write_text("\n")
    empty = tmp_path / "empty.toml"
    empty.write_text(preset.read_text().replace("words.txt", "empty.txt"))
    refused = bt("plan", str(empty))  # the kind's own check, at plan time
    assert refused.returncode != 0 and "the toy suite has no words" in refused.stderr, refused.stderr

    built = bt("run", str(preset))
    assert built.returncode == 0, built.stderr
    assert "words  accuracy 0.7500" in built.stderr, built.stderr  # its accuracy_keys, in the view
    listed = json.loads(bt("ls", "--metrics", "--json").stdout)
    assert listed[0]["suites"]["words"]["accuracy"] == 0.75 and listed[0]["suites"]["words"]["questions"] == 4
    again = bt("run", str(preset))
    assert again.returncode == 0 and "0 executed" in again.stderr, again.stderr

    task = preset.read_text().replace('file = "words.txt"', 'file = "words.txt", task = "t.yaml"')
    preset.write_text(task)
    wrong = bt("plan", str(preset))  # the config keys its sources name, and no others
    assert wrong.returncode != 0 and "only an lm_eval suite runs a harness task" in wrong.stderr


@pytest.mark.parametrize("module", REGISTERED)
def test_every_registered_suite_kind_says_how_it_is_read_and_scored(module: str) -> None:
    kinds = [kind for kind in SUITE_KINDS.values() if type(kind).__module__.endswith(f".{module}")]
    assert len(kinds) == 1
    kind = kinds[0]
    assert isinstance(kind, SuiteKind) and SUITE_KINDS[kind.name] is kind
    assert sources_digest.module_path(PACKAGE, kind.scores) is not None
    assert kind.scores.startswith("buildtrain.steps.eval.")  # torch-side scoring stays in steps/eval/
    assert "score_suite" in (PACKAGE.parent / Path(*kind.scores.split("."))).with_suffix(".py").read_text()
    assert type(kind).check is not SuiteKind.check
    assert kind.sources and kind.sources[0] == "data" and set(kind.sources) <= set(SOURCE_KEYS)
    assert kind.accuracy_keys and isinstance(kind.scoring, int)


def test_the_eval_kind_hashes_every_suite_kind_and_its_scoring() -> None:
    from buildtrain.kinds import KINDS

    closure = set(sources_digest.computing_modules(KINDS["eval"].computes, also=KINDS["eval"].also_computes))
    for kind in SUITE_KINDS.values():
        assert {type(kind).__module__, kind.scores} <= closure


def test_a_result_is_summarised_by_its_kind() -> None:
    assert accuracy({"kind": "multiple_choice", "acc": 0.5, "exact_match": 0.25}) == 0.5
    assert accuracy({"kind": "exact_match", "exact_match": 0.25}) == 0.25
    assert accuracy({"kind": "lm_eval", "exact_match": 1}) == 1.0  # a generate_until task
    assert accuracy({"kind": "multiple_choice", "refused": "3 questions"}) is None
    assert accuracy({"kind": "unknown", "acc": 0.5}) is None


def _exempt() -> set[Path]:
    """The suite kinds' own modules and the scoring modules they name."""
    scoring = {sources_digest.module_path(PACKAGE, kind.scores) for kind in SUITE_KINDS.values()}
    return {*SUITES.glob("*.py"), *(path for path in scoring if path is not None)}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def name_switches(source: bytes) -> list[int]:
    """The lines of comparisons, `match` cases and dict keys that name a suite kind in `source`.
    The harness's own output type `multiple_choice` (`output_type == ...`) is not a suite kind."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if "output_type" in set().union(*map(_names, operands)):
                continue
            values = [c for n in operands for c in [n, *getattr(n, "elts", [])]]
        elif isinstance(node, ast.MatchValue):
            values = [node.value]
        elif isinstance(node, ast.Dict):
            values = [key for key in node.keys if key is not None]
        else:
            continue
        if any(isinstance(v, ast.Constant) and v.value in SUITE_KINDS for v in values):
            found.append(node.lineno)
    return sorted(found)


def test_no_module_outside_the_suite_kinds_tests_a_suite_kind_by_name() -> None:
    """`suite.kind == "lm_eval"`, `{"exact_match": ...}[kind]`, `case "multiple_choice":`: only the
    suite kinds may know suite kinds by name."""
    exempt = _exempt()
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in exempt
        for line in name_switches(path.read_bytes())
    ]
    assert not found, "suite kinds tested by name (ask the kind, config/suites/):\n" + "\n".join(found)


def test_the_rule_catches_a_name_switch() -> None:
    probe = (
        'def f(suite, kind, output_type):\n    if suite.kind == "lm_eval":\n        pass\n'
        '    read = {"exact_match": 1}[kind]\n    match kind:\n        case "multiple_choice":\n            pass\n'
        '    return output_type == "multiple_choice"\n'
    )
    assert name_switches(probe.encode()) == [2, 4, 6]
