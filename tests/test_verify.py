"""`bt verify`: reproduced plans pass, injected nondeterminism is caught and located."""

from __future__ import annotations

import json
import shutil

from conftest import MICRO, plan_hash, run_bt

from buildtrain.errors import ExitCode


def verify(store, planned, *options, env=None):
    result = run_bt("verify", planned, "--json", *options, store=store, env=env)
    report = json.loads(result.stdout) if result.stdout.strip() else None
    return result, report


def by_label(report: dict) -> dict[str, dict]:
    return {step["label"]: step for step in report["steps"]}


def test_built_plan_verifies_with_two_resume_points_at_one_thread(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    result, report = verify(store, micro_built[1], "--resume-at", "3,9", "--threads", "1")
    assert result.returncode == ExitCode.OK, result.stderr
    assert report["reproduced"] and report["threads"] == 1 and report["resume_at"] == [3, 9]
    steps = by_label(report)
    assert {s["status"] for s in steps.values()} == {"reproduced"}
    assert "killed and resumed at 3,9" in steps["train:main"]["detail"]
    assert steps["train:main"]["reexecuted"]["weights"] == micro_built[2]["train:main"]["weights"]
    assert "✓ train:main" in result.stderr and "reproduced: 4 of 4" in result.stderr


def test_built_plan_verifies_at_two_threads(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    result, report = verify(store, micro_built[1], "--threads", "2")
    assert result.returncode == ExitCode.OK, result.stderr
    assert report["threads"] == 2 and report["reproduced"]


def test_injected_perturbation_is_caught_at_its_step_naming_the_tensor(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    tensor = "blocks.1.ffn.w2.weight"
    result, report = verify(store, micro_built[1], env={"BT_TEST_PERTURB": f"7:{tensor}:1e-3"})
    assert result.returncode == ExitCode.NOT_REPRODUCED, result.stderr
    train = by_label(report)["train:main"]
    assert train["status"] == "diverged"
    divergence = train["divergence"]
    assert divergence["step"] == 7
    assert divergence["tensors"] == [f"model.{tensor}"]
    assert divergence["compared_at"] == 8  # the first checkpoint the record kept after step 7
    assert divergence["differences"][0]["tensor"] == f"model.{tensor}"
    assert 0.5e-3 < divergence["differences"][0]["max_abs_diff"] < 2e-3
    assert by_label(report)["eval"]["status"] == "skipped"
    assert "diverged at step 7" in result.stderr and "NOT REPRODUCED" in result.stderr


def test_resume_without_the_data_cursor_is_caught_by_resume_at(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    result, report = verify(
        store, micro_built[1], "--resume-at", "5", env={"BT_TEST_SKIP_CURSOR_RESTORE": "1"}
    )
    assert result.returncode == ExitCode.NOT_REPRODUCED, result.stderr
    divergence = by_label(report)["train:main"]["divergence"]
    assert divergence["step"] == 6  # the first update after the resume
    assert "cursor" in divergence["fields"]


def test_spot_check_compares_the_first_steps_only(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    result, report = verify(store, micro_built[1], "--steps", "3")
    assert result.returncode == ExitCode.OK, result.stderr
    steps = by_label(report)
    assert steps["train:main"]["status"] == "reproduced"
    assert "first 3 steps" in steps["train:main"]["detail"]
    assert steps["eval"]["status"] == "skipped" and steps["export"]["status"] == "skipped"


def test_unbuilt_plan_is_built_then_checked_against_a_second_execution(tmp_path):
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(MICRO), "--set", "train.steps=6", store=store))
    result, report = verify(store, planned)
    assert result.returncode == ExitCode.OK, result.stderr
    assert "is not built; building it once" in result.stderr
    assert report["reproduced"]
    assert len(list((tmp_path / "experiments").glob("*/summary.json"))) == 1  # the first build's record


def test_native_plan_refuses_another_thread_count(tmp_path):
    store = tmp_path / ".bt"
    planned = plan_hash(
        run_bt(
            "plan", str(MICRO), "--set", "numerics.profile=native", "--set", "numerics.threads=2", store=store
        )
    )
    result = run_bt("verify", planned, "--threads", "1", store=store)
    assert result.returncode == ExitCode.USAGE
    assert "pins 2 threads" in result.stderr and "portable" in result.stderr
