"""Evaluation beside training (`executor/loop/beside.py`): each kept checkpoint that `eval.checkpoints_every`
asks for is scored by an evaluation worker of its own as soon as the train step seals it; the
weights are those of a run without it, every kept checkpoint has its results, and a worker
killed midway (SIGKILL) leaves neither a duplicate nor a missing result once `bt run` runs again."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import MICRO, REPO, plan_hash, run_bt, step_digests
from hypothesis import given, settings
from hypothesis import strategies as st

ARITHMETIC = REPO / "tests" / "suites" / "arithmetic.jsonl"
SUITES = '[{ name = "arith", file = "arithmetic.jsonl" }, { name = "sums", file = "arithmetic.jsonl" }]'
# micro.toml keeps the checkpoints of updates 4, 8 and 12: 4 and 8 are scored beside training,
# 12 (the final weights) by the eval step, with the held-out loss.
BESIDE = {(suite, update) for suite in ("arith", "sums") for update in (4, 8)}
KILL_AFTER = "BT_TEST_KILL_EVAL_AFTER"


def preset(folder: Path, every: int) -> Path:
    """The micro preset with two suites (subset 0.5), scored at every kept checkpoint that is a
    multiple of `every` (0: the final weights only)."""
    shutil.copyfile(ARITHMETIC, folder / "arithmetic.jsonl")
    path = folder / f"every{every}.toml"
    path.write_text(
        f'extends = "{MICRO}"\n\n[eval]\nsuites = {SUITES}\nsubset = 0.5\ncheckpoints_every = {every}\n'
    )
    return path


def scored(experiments: Path) -> list[tuple[str, int, bool]]:
    """(suite, update, whether beside training) of every suite scored in every run record."""
    found = []
    for log in sorted(experiments.glob("*/train.log")):
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "eval_suite":
                found.append((event["suite"], event["step"], bool(event.get("beside"))))
    return found


def curves(store: Path, plan: str) -> dict[str, list[int]]:
    from buildtrain.plan.stored import load_plan
    from buildtrain.store.store import Store

    (step,) = [s for s in load_plan(Store(store), plan).steps if s.kind == "eval"]
    body = json.loads((Store(store).outputs.path(step.hash) / "eval.json").read_bytes())
    return {name: [point["update"] for point in points] for name, points in body["curves"].items()}


def test_each_kept_checkpoint_is_scored_beside_training_and_the_bits_do_not_change(tmp_path: Path) -> None:
    beside_store, flat_store, late_store = (tmp_path / name / ".bt" for name in ("beside", "flat", "late"))
    runs = {}
    for store, every, env in ((beside_store, 4, {}), (flat_store, 0, {}), (late_store, 4, {KILL_AFTER: "0"})):
        store.parent.mkdir()
        planned = plan_hash(run_bt("plan", str(preset(store.parent, every)), store=store))
        result = run_bt("run", planned, store=store, env=env)
        assert result.returncode == 0, result.stderr
        runs[store] = planned, result

    # Training is the same step, with the same bits, whether its checkpoints are scored or not.
    digests = {store: step_digests(store, planned) for store, (planned, _) in runs.items()}
    assert len({d["train:main"]["weights"] for d in digests.values()}) == 1
    beside = scored(beside_store.parent / "experiments")
    assert Counter((s, u) for s, u, by in beside if by) == Counter(BESIDE)  # each once, beside training
    assert {(s, u) for s, u, by in beside if not by} == {("arith", 12), ("sums", 12)}
    assert curves(beside_store, runs[beside_store][0]) == {"arith": [4, 8, 12], "sums": [4, 8, 12]}
    # A worker killed before it scored anything: the eval step scores the checkpoints, to the same bits.
    _, late = runs[late_store]
    assert "evaluation beside training stopped (killed by signal 9)" in late.stderr
    assert not [by for _, _, by in scored(late_store.parent / "experiments") if by]
    assert digests[late_store] == digests[beside_store]


@pytest.mark.parametrize(
    "training",
    [
        ("--set", 'train.lora={ rank = 4, alpha = 8.0, targets = ["q", "v"] }'),
        ("--set", "train.micro_batch_size=1", "--set", 'train.sharding="fsdp"'),
    ],
    ids=["lora", "fsdp"],
)
def test_lora_and_sharded_checkpoints_are_scored_beside_training_too(
    tmp_path: Path, training: tuple[str, ...]
) -> None:
    """A LoRA checkpoint (adapters over a frozen base) and an FSDP one (saved whole from its
    shards) are scored beside training like any other, with the weights of a run without it."""
    weights = {}
    for every in (4, 0):
        store = tmp_path / f"every{every}" / ".bt"
        store.parent.mkdir()
        planned = plan_hash(run_bt("plan", str(preset(store.parent, every)), *training, store=store))
        result = run_bt("run", planned, store=store)
        assert result.returncode == 0, result.stderr
        weights[every] = step_digests(store, planned)["train:main"]["weights"]
        if every:
            beside = scored(store.parent / "experiments")
            assert Counter((s, u) for s, u, by in beside if by) == Counter(BESIDE)
            assert curves(store, planned) == {"arith": [4, 8, 12], "sums": [4, 8, 12]}
    assert weights[4] == weights[0]


def test_a_killed_evaluation_worker_leaves_no_duplicate_and_no_missing_result(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(preset(tmp_path, 4)), store=store))
    # Training only, its evaluation worker SIGKILLed once it recorded one result.
    first = run_bt("run", planned, "--target", "train:main", store=store, env={KILL_AFTER: "1"})
    assert first.returncode == 0, first.stderr
    assert "evaluation beside training stopped (killed by signal 9)" in first.stderr
    assert len(list((store / "evals").iterdir())) == 1
    (done,) = scored(tmp_path / "experiments")

    again = run_bt("run", planned, store=store)
    assert again.returncode == 0, again.stderr
    every = scored(tmp_path / "experiments")
    # The eval step scored exactly what was missing: each checkpoint's suites once over both runs.
    assert Counter((s, u) for s, u, _ in every) == Counter(BESIDE | {("arith", 12), ("sums", 12)})
    assert done[:2] not in [(s, u) for s, u, by in every[1:]]
    assert curves(store, planned) == {"arith": [4, 8, 12], "sums": [4, 8, 12]}
    assert len(list((store / "evals").iterdir())) == 1 + 2 + len(BESIDE)  # held-out, final suites, curves

    null = run_bt("run", planned, store=store)
    assert null.returncode == 0 and "5 cached" in null.stderr, (
        null.stderr
    )  # data, train, ngrams, eval, export
    assert len(scored(tmp_path / "experiments")) == len(every)


def test_the_old_name_is_refused_with_the_new_one(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    old = tmp_path / "old.toml"
    old.write_text(f'extends = "{MICRO}"\n\n[eval]\neval_every = 4\n')
    for args in ((str(old),), (str(MICRO), "--set", "eval.eval_every=4")):
        refused = run_bt("plan", *args, store=store)
        assert refused.returncode == 2 and not refused.stdout
        (line,) = [line for line in refused.stderr.splitlines() if "eval_every" in line]
        assert line.endswith(
            "eval.eval_every: was renamed to eval.checkpoints_every; write checkpoints_every instead"
        )
        assert "Traceback" not in refused.stderr
    assert not (store / "plans").exists() or not list((store / "plans").iterdir())


@settings(max_examples=200, deadline=None)
@given(
    steps=st.integers(1, 400),
    checkpoint_every=st.integers(1, 60),
    keep=st.integers(1, 8),
    every=st.integers(0, 120),
    suites=st.booleans(),
)
def test_beside_training_are_exactly_the_curves_points_before_the_final_weights(
    steps: int, checkpoint_every: int, keep: int, every: int, suites: bool
) -> None:
    """The updates scored beside training are the kept checkpoints that are multiples of
    `checkpoints_every`, the final one left to the eval step, oldest first; none without suites."""
    from buildtrain.kinds import kind_of

    train = {"train": {"steps": steps, "checkpoint_every": checkpoint_every, "keep_checkpoints": keep}}
    kept = kind_of("train").kept_updates(train)
    config = {"checkpoints_every": every, **({"suites": [{"name": "arith"}]} if suites else {})}
    beside = kind_of("eval").checkpoints_evaluated(config, kept)
    assert beside == sorted(beside) and len(set(beside)) == len(beside)
    wanted = {u for u in kept if suites and every and u % every == 0 and u != steps}
    assert set(beside) == wanted
