"""`bt verify`: reproduced plans pass, injected nondeterminism is caught and located."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import MICRO, plan_hash, run_bt

from buildtrain.errors import ExitCode
from buildtrain.plan.stored import load_plan
from buildtrain.steps.train.state import TRACE, TRAIN_STATE
from buildtrain.store import layout, objects
from buildtrain.store.store import Store
from buildtrain.verify.watch import Watcher


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


@pytest.mark.parametrize(
    ("at", "compared_at"),
    [(2, 4), (6, 8), (10, 12), (12, 12)],
    ids=["before-the-first-checkpoint", "between-checkpoints", "after-the-last-intermediate", "final"],
)
def test_a_divergence_anywhere_in_the_stage_is_not_reproduced(micro_built, tmp_path, at, compared_at):
    """Checkpoints at 4, 8 and 12 (the last update). A divergence after 8 used to stop training at
    12 before its checkpoint was written, and the re-execution then failed (exit 1) as a build
    whose final checkpoint is missing, instead of naming the update."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    tensor = "blocks.0.attention.wo.weight"
    result, report = verify(store, micro_built[1], env={"BT_TEST_PERTURB": f"{at}:{tensor}:1e-3"})
    assert result.returncode == ExitCode.NOT_REPRODUCED, result.stderr
    train = by_label(report)["train:main"]
    assert train["status"] == "diverged" and not report["reproduced"]
    divergence = train["divergence"]
    assert divergence["step"] == at and divergence["tensors"] == [f"model.{tensor}"]
    assert divergence["compared_at"] == compared_at
    assert divergence["differences"][0]["tensor"] == f"model.{tensor}"
    assert f"diverged at step {at}" in result.stderr and "NOT REPRODUCED" in result.stderr


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
    records = tmp_path / "records"  # not ./experiments: the first build honours BT_EXPERIMENTS
    planned = plan_hash(run_bt("plan", str(MICRO), "--set", "train.steps=6", store=store))
    result, report = verify(store, planned, "--threads", "1", env={"BT_EXPERIMENTS": str(records)})
    assert result.returncode == ExitCode.OK, result.stderr
    assert "is not built; building it once" in result.stderr
    assert report["reproduced"] and report["threads"] == 1
    assert not (tmp_path / "experiments").exists()
    (summary,) = list(records.glob("*/summary.json"))  # the first build's record
    log = [json.loads(line) for line in (summary.parent / "train.log").read_text().splitlines()]
    started = [e for e in log if e["event"] == "step_started"]
    assert started and {e["threads"] for e in started} == {1}  # built at the --threads it was given


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


PERTURB_AT_1 = {"BT_TEST_PERTURB": "1:blocks.1.ffn.w2.weight:1e-3"}


@pytest.mark.parametrize(
    "options", [("--steps", "1"), ("--steps", "2"), ("--steps", "5", "--resume-at", "3")], ids=str
)
def test_a_divergence_at_the_first_update_fails_every_spot_check(micro_built, tmp_path, options):
    """Fail closed: the divergence is reported where it happens, not at the next kept checkpoint
    (which a short spot check never reaches), and a kill-and-resume does not paper over it."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    result, report = verify(store, micro_built[1], *options, env=PERTURB_AT_1)
    assert result.returncode == ExitCode.NOT_REPRODUCED, result.stderr
    train = by_label(report)["train:main"]
    assert train["status"] == "diverged" and train["divergence"]["step"] == 1
    assert train["divergence"]["tensors"] == ["model.blocks.1.ffn.w2.weight"]
    assert "match" not in result.stderr and "NOT REPRODUCED" in result.stderr


def test_a_spot_check_longer_than_the_plan_is_clamped_and_says_so(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    result, report = verify(store, micro_built[1], "--steps", "100")
    assert result.returncode == ExitCode.OK, result.stderr
    train = by_label(report)["train:main"]
    assert train["status"] == "reproduced" and "first 100" not in result.stderr
    assert "all 12 steps match" in train["detail"] and "clamped to the stage's 12" in train["detail"]
    assert train["reexecuted"]["weights"] == micro_built[2]["train:main"]["weights"]  # a full check


def _flip_trace(store: Path, step_hash: str, _: Path) -> None:
    trace = store / "steps" / step_hash / "trace.jsonl"
    data = bytearray(trace.read_bytes())
    data[10] ^= 1
    trace.write_bytes(bytes(data))


def _swap_in_another_plans_output(store: Path, step_hash: str, other: Path) -> None:
    shutil.rmtree(store / "steps" / step_hash)
    shutil.copytree(other, store / "steps" / step_hash)


@pytest.mark.parametrize("damage", [_flip_trace, _swap_in_another_plans_output], ids=["flipped", "swapped"])
def test_a_damaged_or_foreign_recorded_output_fails_as_a_damaged_store(
    micro_built, stages_built, tmp_path, damage
):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    train = load_plan(Store(store), micro_built[1]).by_label("train:main")
    other = load_plan(Store(stages_built[0]), stages_built[1]).by_label("train:pretrain")
    damage(store, train.hash, stages_built[0] / "steps" / other.hash)
    for options in ((), ("--steps", "3")):
        result, report = verify(store, micro_built[1], *options)
        assert result.returncode == ExitCode.CORRUPT, result.stderr
        assert by_label(report)["train:main"]["status"] == "damaged" and not report["reproduced"]
        assert "DAMAGED STORE" in result.stderr and "reproduced:" not in result.stderr


class _Log:
    def warning(self, *_: object, **__: object) -> None:
        pass


def _watcher(tmp_path: Path, recorded: list[dict], stop_after: int | None = None) -> Watcher:
    folder = tmp_path / "recorded"
    folder.mkdir(exist_ok=True)
    (folder / "trace.jsonl").write_text("".join(json.dumps(e) + "\n" for e in recorded))
    return Watcher(folder, tmp_path / "report.json", [4], stop_after, _Log())


def _entry(step: int, **fields: object) -> dict:
    return {"step": step, "loss": "3f80", "grad_norm": "3f00", "lr": 0.1, "cursor": step * 4, **fields}


@pytest.mark.parametrize(
    ("recorded", "reexecuted", "fields"),
    [
        ([_entry(1)], _entry(1, weights="ab"), ["weights"]),  # a digest only one side has
        ([_entry(1, weights="ab")], _entry(1), ["weights"]),
        ([_entry(1, loss="3f81")], _entry(1), ["loss"]),
        ([], _entry(1), ["missing from the record"]),  # an update the record lacks
    ],
    ids=["extra-field", "missing-field", "loss", "missing-update"],
)
def test_the_watcher_counts_an_uncomparable_update_as_a_divergence(tmp_path, recorded, reexecuted, fields):
    watcher = _watcher(tmp_path, recorded, stop_after=1)
    assert watcher.recorded(reexecuted, {})  # a spot check of 1 stops at once: no checkpoint in reach
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["diverged"] and report["step"] == 1 and report["fields"] == fields


def test_the_watcher_reports_each_update_it_compared_across_a_resume(tmp_path):
    recorded = [_entry(1), _entry(2), _entry(3)]
    first = _watcher(tmp_path, recorded)
    assert not first.recorded(_entry(1), {}) and not first.recorded(_entry(2), {})
    resumed = _watcher(tmp_path, recorded)  # a new process after a kill goes on with the list
    assert not resumed.recorded(_entry(3), {})
    report = json.loads((tmp_path / "report.json").read_text())
    assert report == {"diverged": False, "steps_compared": 3, "compared": [1, 2, 3]}
    assert layout.TRAIN_STATE == TRAIN_STATE  # the torch-free name the kinds and fsck read


def test_the_verify_worker_watches_only_a_job_that_asks(tmp_path):
    from buildtrain.executor.process.job import Job, JobNumerics, JobOptions
    from buildtrain.verify.worker import watcher_for

    def job_with(watch):
        numerics = JobNumerics(profile="portable", device="cpu", dtype="float32", threads=1)
        return Job(
            store="", plan="", step="", kind="train", numerics=numerics, options=JobOptions(watch=watch)
        )

    assert watcher_for(job_with(None), _Log()) is None
    folder = tmp_path / "recorded"
    folder.mkdir()
    (folder / "result.json").write_text(json.dumps({"checkpoints": ["step-000004", "damaged-x"]}))
    (folder / TRACE).write_bytes(b"")
    job = job_with({"recorded": str(folder), "findings": str(tmp_path / "findings.json"), "stop_after": None})
    watcher = watcher_for(job, _Log())
    assert watcher is not None and watcher.retained == [4]


def _edit_and_reseal(output: Path, name: str, edit: Callable[[bytes], bytes]) -> None:
    """What a forger with write access does: edit a file, then seal the output again with the
    store's own seal, keeping the digests it declared (so fsck finds every file as sealed)."""
    declared = objects.sealed_digests(output)
    path = output / name
    path.chmod(0o644)
    path.write_bytes(edit(path.read_bytes()))
    (output / objects.MANIFEST).unlink()
    objects.seal(output, declared, name=output.name)


def _last_byte_flipped(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])  # the last weight's last byte: still a valid file


@pytest.mark.parametrize(
    ("label", "name", "edit"),
    [
        ("export", "model.safetensors", _last_byte_flipped),
        ("eval", "eval.json", lambda data: data.replace(b'"loss":', b'"loss":1', 1)),
    ],
    ids=["export-weights", "eval-result"],
)
def test_a_recorded_output_edited_and_resealed_does_not_reproduce(micro_built, tmp_path, label, name, edit):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    step = load_plan(Store(store), micro_built[1]).by_label(label)
    output = store / "steps" / step.hash
    _edit_and_reseal(output, name, edit)
    shutil.rmtree(store / "cache" / "verified", ignore_errors=True)
    assert not objects.verify(output)  # the seal holds: only a re-execution can tell
    result, report = verify(store, micro_built[1])
    assert result.returncode == ExitCode.NOT_REPRODUCED, result.stderr
    verdict = by_label(report)[label]
    assert verdict["status"] == "diverged" and name in verdict["detail"]
    assert name in result.stderr and "reproduced:" not in result.stderr


def _header_laid_out_otherwise(data: bytes) -> bytes:
    """The same tensors, their header written in another layout (as another safetensors release may)."""
    size = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + size]), indent=1).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + size :]


def test_a_recorded_output_with_the_same_tensors_in_other_bytes_is_told_from_an_edit(micro_built, tmp_path):
    """A kept checkpoint's weights file laid out otherwise, its checkpoint and the output sealed again:
    still no reproduction (the bytes differ), but the report says what differs, not "edited"."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    output = store / "steps" / load_plan(Store(store), micro_built[1]).by_label("train:main").hash
    kept = output / "checkpoints" / "step-000012"
    for path in (kept / "model.safetensors", kept / objects.MANIFEST):
        path.chmod(0o644)
    _edit_and_reseal(kept, "model.safetensors", _header_laid_out_otherwise)
    _edit_and_reseal(output, "result.json", lambda data: data)
    shutil.rmtree(store / "cache" / "verified", ignore_errors=True)
    assert not objects.verify(output) and not objects.verify(kept)
    result, report = verify(store, micro_built[1])
    assert result.returncode == ExitCode.NOT_REPRODUCED, result.stderr
    detail = by_label(report)["train:main"]["detail"]
    assert detail.startswith("files hold the same tensors") and "re-sealed" not in detail
    assert "checkpoints/step-000012/MANIFEST.json, checkpoints/step-000012/model.safetensors" in detail


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            ("--resume-at", "500"),
            "--resume-at 500: plan {h} would never be killed there (its longest train stage has 12 "
            "updates); choose points from 1 to 11",
        ),
        (
            ("--resume-at", "3,12"),
            "--resume-at 12: plan {h} would never be killed there (its longest train stage has 12 "
            "updates); choose points from 1 to 11",
        ),
        (
            ("--steps", "5", "--resume-at", "3,7"),
            "--resume-at 7: plan {h} would never be killed there (--steps 5 "
            "re-executes 5 updates); choose points from 1 to 4",
        ),
    ],
    ids=["past-the-plan", "at-the-end", "past-steps"],
)
def test_a_resume_point_the_plan_never_reaches_is_refused(micro_built, tmp_path, options, said):
    """It said "killed and resumed at 500" of a plan of 12 updates."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    result = run_bt("verify", micro_built[1], *options, store=store)
    assert result.returncode == ExitCode.USAGE
    assert result.stderr.strip() == f"bt verify: {said.format(h=micro_built[1][:12])}"


def test_lines_written_in_batches_by_bt_run_verify_update_by_update(tmp_path):
    """`bt run` writes the trace's lines between checkpoints in batches of RECORD_EVERY (their
    fingerprints wait on the device); the re-execution compares every update as it happens, so a
    line put under the wrong update would fail the plain verify, and a perturbation after the
    first batch is still named at its own update."""
    from buildtrain.steps.train.record import RECORD_EVERY

    steps = RECORD_EVERY + 6  # lines written at RECORD_EVERY, at the checkpoint 4 later, at the end
    store = tmp_path / ".bt"
    cadence = ("--set", f"train.steps={steps}", "--set", f"train.checkpoint_every={RECORD_EVERY + 4}")
    planned = plan_hash(run_bt("plan", str(MICRO), *cadence, store=store))
    env = {"BT_EXPERIMENTS": str(tmp_path / "records")}
    assert run_bt("run", planned, "--target", "train:main", store=store, env=env).returncode == 0
    result, report = verify(store, planned, "--threads", "1", env=env)
    assert result.returncode == ExitCode.OK, result.stderr
    assert f"all {steps} steps match the recorded trace" in by_label(report)["train:main"]["detail"]
    tensor, at = "blocks.0.attention.wo.weight", RECORD_EVERY + 2
    perturbed = {**env, "BT_TEST_PERTURB": f"{at}:{tensor}:1e-3"}
    result, report = verify(store, planned, "--threads", "1", env=perturbed)
    assert result.returncode == ExitCode.NOT_REPRODUCED, result.stderr
    divergence = by_label(report)["train:main"]["divergence"]
    assert divergence["step"] == at and divergence["tensors"] == [f"model.{tensor}"]
    assert divergence["compared_at"] == RECORD_EVERY + 4
