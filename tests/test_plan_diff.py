"""Locality: a change reaches exactly the steps that read it, and `bt diff` says which and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import PRETRAIN_FINETUNE, TINY, BtRunner

from buildtrain.plan.diff import Change, changed_keys, diff_plans, flatten
from buildtrain.plan.plan import Plan
from buildtrain.plan.planner import plan_preset
from buildtrain.store.store import Store

FINETUNE_LR = "stages.finetune.train.lr=5e-4"
LABELS = ["data:pretrain", "train:pretrain", "data:finetune", "train:finetune", "eval", "export"]
# What FINETUNE_LR does to each step: the pretrain stage and the finetune data are reused.
FINETUNE_LR_STATUS = dict.fromkeys(LABELS[:3], "reused") | dict.fromkeys(LABELS[3:], "invalidated")


def hashes(plan: Plan) -> dict[str, str]:
    return {step.label: step.hash for step in plan.steps}


def plans(store: Path, *overrides: list[str]) -> list[Plan]:
    return [plan_preset(PRETRAIN_FINETUNE, list(o), Store(store)).plan for o in overrides]


def changed_steps(before: Plan, after: Plan) -> set[str]:
    old, new = hashes(before), hashes(after)
    return {label for label in old if old[label] != new.get(label)}


def test_finetune_lr_invalidates_only_what_follows_it(tmp_path: Path) -> None:
    before, after = plans(tmp_path / ".bt", [], [FINETUNE_LR])
    assert list(hashes(before)) == LABELS
    assert changed_steps(before, after) == {"train:finetune", "eval", "export"}
    assert after.by_label("train:finetune").inputs["init"] == before.by_label("train:pretrain").hash


@pytest.mark.parametrize(
    ("override", "invalidated"),
    [
        ("stages.pretrain.train.lr=1e-3", {"train:pretrain", "train:finetune", "eval", "export"}),
        ("stages.pretrain.data.synthetic.seed=5", set(LABELS) - {"data:finetune"}),
        ("stages.finetune.data.split_seed=5", {"data:finetune", "train:finetune", "eval", "export"}),
        ("model.n_layers=3", set(LABELS) - {"data:pretrain", "data:finetune"}),
        ("eval.max_batches=2", {"eval", "export"}),
        ("eval.every=10", {"train:pretrain", "train:finetune", "eval", "export"}),
        ("export.dtype=bfloat16", {"export"}),
        ("numerics.dtype=bfloat16", {"train:pretrain", "train:finetune", "eval", "export"}),
        ("name=renamed", set()),
    ],
)
def test_each_change_reaches_exactly_its_steps(tmp_path: Path, override: str, invalidated: set[str]) -> None:
    before, after = plans(tmp_path / ".bt", [], [override])
    assert changed_steps(before, after) == invalidated
    assert after.hash != before.hash


def test_changed_data_file_invalidates_its_stage_only(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("one")
    files = f'stages.finetune.data.files=["{corpus}/*.txt"]'
    before = plans(tmp_path / ".bt", [files])[0]
    (corpus / "a.txt").write_text("two")
    after = plans(tmp_path / ".bt", [files])[0]
    assert changed_steps(before, after) == {"data:finetune", "train:finetune", "eval", "export"}
    _, steps = diff_plans(before, after)
    reasons = {s.label: s.reasons for s in steps}
    assert reasons["data:finetune"] == ("source files changed",)


def test_diff_plans_names_keys_and_reasons(tmp_path: Path) -> None:
    before, after = plans(tmp_path / ".bt", [], [FINETUNE_LR])
    changes, steps = diff_plans(before, after)
    assert changes == [Change("stages[1].train.lr", 1e-3, 5e-4)]
    status = {s.label: s.status for s in steps}
    assert status == FINETUNE_LR_STATUS
    reasons = {s.label: s.reasons for s in steps}
    assert reasons["train:finetune"] == ("config train.lr",)
    assert reasons["eval"] == ("input weights (train:finetune) changed",)
    assert "config train.lr" in reasons["export"]


def test_diff_of_a_plan_with_itself_is_empty(tmp_path: Path) -> None:
    (plan,) = plans(tmp_path / ".bt", [])
    changes, steps = diff_plans(plan, plan)
    assert changes == [] and {s.status for s in steps} == {"reused"}


def test_added_and_removed_steps(tmp_path: Path) -> None:
    before, after = plans(tmp_path / ".bt", [], ["export.enabled=false"])
    _, steps = diff_plans(before, after)
    assert [(s.label, s.status) for s in steps if s.status != "reused"] == [("export", "removed")]
    _, steps = diff_plans(after, before)
    assert [(s.label, s.status) for s in steps if s.status != "reused"] == [("export", "added")]


def test_flatten_and_changed_keys() -> None:
    assert flatten({"stages": [{"train": {"lr": 1}}, {"train": {"lr": 2}}], "betas": (0.9, 0.95)}) == {
        "stages[0].train.lr": 1,
        "stages[1].train.lr": 2,
        "betas": [0.9, 0.95],
    }
    assert changed_keys({"a": 1, "b": None}, {"a": 1, "c": 2}) == [
        Change("b", None, None),
        Change("c", None, 2),
    ]


def test_bt_diff_says_what_changed_and_what_is_reused(tmp_path: Path, store: Path, bt: BtRunner) -> None:
    before, after = plans(store, [], [FINETUNE_LR])
    result = bt("diff", before.hash[:10], after.hash[:10])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"plan {before.hash[:12]} -> {after.hash[:12]}"
    assert "  stages[1].train.lr: 0.001 -> 0.0005" in lines
    status = {line.split()[0]: line.split()[1].rstrip(":") for line in lines if line.split()[0] in LABELS}
    assert status == FINETUNE_LR_STATUS
    assert any(line.split()[0] == "train:finetune" and "config train.lr" in line for line in lines)
    assert lines[-2:] == [
        "3 step(s) to rebuild, 3 reused",
        "metrics: neither plan has been run (bt run builds them)",
    ]

    as_json = bt("diff", before.hash, after.hash, "--json")
    body = json.loads(as_json.stdout)
    assert body["config"] == [{"key": "stages[1].train.lr", "before": 0.001, "after": 0.0005}]
    assert [s["status"] for s in body["steps"]] == ["reused"] * 3 + ["invalidated"] * 3


def test_bt_diff_takes_presets_as_run_verify_and_export_do(tmp_path: Path, bt: BtRunner) -> None:
    """Issue 48: `bt diff A.toml B.toml` plans both (as `bt run` would) and compares them."""
    same = bt("diff", str(PRETRAIN_FINETUNE), str(PRETRAIN_FINETUNE))
    assert same.returncode == 0, same.stderr
    first = same.stdout.splitlines()[0].split()  # plan A -> B
    assert first[1] == first[3] and "0 step(s) to rebuild" in same.stdout
    other = bt("diff", str(TINY), str(PRETRAIN_FINETUNE))
    assert other.returncode == 0 and "name: 'tiny' -> 'pretrain-finetune'" in other.stdout, other.stderr
    missing = bt("diff", str(PRETRAIN_FINETUNE), str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "nope.toml: file not found" in missing.stderr
    assert "Traceback" not in missing.stderr
