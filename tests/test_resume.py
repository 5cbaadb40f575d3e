"""Resume equals uninterrupted, bit for bit, however the run was stopped; and a resume that
forgets part of the state is caught (the negative control shows these tests can fail)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import MICRO, MICRO_STAGES, plan_hash, run_bt, step_digests

from buildtrain.errors import ExitCode
from buildtrain.plan.stored import load_plan
from buildtrain.store.store import Store


def start(planned: str, store: Path, experiments: Path, *args: str, **env: str) -> subprocess.Popen:
    """`bt run` in its own session (so a test can kill the whole process group)."""
    environment = {**os.environ, "BT_STORE": str(store), "BT_EXPERIMENTS": str(experiments), **env}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "buildtrain",
            "run",
            planned,
            "--target",
            "train:main",
            "--progress",
            "off",
            *args,
        ],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=store.parent,
    )


def wait_for_step(process: subprocess.Popen, experiments: Path, step: int, timeout: float = 120) -> None:
    """Block until the running record's train.log shows update `step`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"bt run ended early ({process.returncode}): {process.communicate()[1]}")
        for log in experiments.glob("*/train.log"):
            for line in log.read_text().splitlines():
                event = json.loads(line)
                if event.get("event") == "train_step" and event["step"] >= step:
                    return
        time.sleep(0.05)
    raise TimeoutError(f"no train_step {step} within {timeout}s")


def train_hash(store: Path, planned: str, label: str = "train:main") -> str:
    return load_plan(Store(store), planned).by_label(label).hash


def resume(
    planned: str, store: Path, experiments: Path, *args: str, target: str = "train:main", **env: str
) -> dict:
    """`bt run PLAN --target TARGET ARGS` to completion; the digests of every built step."""
    result = run_bt(
        "run",
        planned,
        "--target",
        target,
        *args,
        store=store,
        env={"BT_EXPERIMENTS": str(experiments), **env},
    )
    assert result.returncode == 0, result.stderr
    return step_digests(store, planned)


def killed_in_checkpoint(planned: str, store: Path, experiments: Path, step: int, *target: str) -> str:
    """Plan, then run until the step process SIGKILLs itself while writing checkpoint `step`."""
    killed = run_bt(
        "run",
        planned,
        *target,
        store=store,
        env={"BT_EXPERIMENTS": str(experiments), "BT_TEST_KILL_IN_CHECKPOINT": str(step)},
    )
    assert killed.returncode == ExitCode.FAILED and "SIGKILL" in killed.stderr, killed.stderr
    return killed.stderr


def events(experiments: Path, name: str) -> list[dict]:
    found = []
    for log in sorted(experiments.glob("*/train.log")):
        found += [e for e in map(json.loads, log.read_text().splitlines()) if e.get("event") == name]
    return found


def test_sigterm_checkpoints_exits_3_and_resumes_identically(micro_built, tmp_path):
    _, planned, reference = micro_built
    store, experiments = tmp_path / ".bt", tmp_path / "experiments"
    assert plan_hash(run_bt("plan", str(MICRO), store=store)) == planned
    process = start(planned, store, experiments, BT_TEST_STEP_DELAY="0.3")
    wait_for_step(process, experiments, 5)
    os.kill(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)

    assert process.returncode == ExitCode.INTERRUPTED, stderr
    assert f"resume with: bt run {planned}" in stderr
    interrupted_at = events(experiments, "checkpoint_saved")[-1]["step"]
    assert 5 <= interrupted_at < 12
    assert resume(planned, store, experiments)["train:main"] == reference["train:main"]
    assert events(experiments, "resumed")[-1]["step"] == interrupted_at


def test_sigkill_at_a_random_point_resumes_identically(micro_built, tmp_path):
    _, planned, reference = micro_built
    store, experiments = tmp_path / ".bt", tmp_path / "experiments"
    assert plan_hash(run_bt("plan", str(MICRO), store=store)) == planned
    process = start(planned, store, experiments, BT_TEST_STEP_DELAY="0.15")
    wait_for_step(process, experiments, 1)
    time.sleep(random.Random(os.getpid()).uniform(0.2, 1.4))
    os.killpg(process.pid, signal.SIGKILL)  # the executor and its step process, without warning
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not Store(store).outputs.has(train_hash(store, planned))
    assert resume(planned, store, experiments)["train:main"] == reference["train:main"]


def test_sigkill_while_writing_a_checkpoint_resumes_identically(micro_built, tmp_path):
    _, planned, reference = micro_built
    store, experiments = tmp_path / ".bt", tmp_path / "experiments"
    assert plan_hash(run_bt("plan", str(MICRO), store=store)) == planned
    killed_in_checkpoint(planned, store, experiments, 8, "--target", "train:main")
    checkpoints = Store(store).outputs.work_dir(train_hash(store, planned)) / "checkpoints"
    assert (checkpoints / ".step-000008.tmp").is_dir()  # the half-written checkpoint is on disk
    assert not (checkpoints / "step-000008").exists()

    assert resume(planned, store, experiments)["train:main"] == reference["train:main"]
    assert events(experiments, "resumed")[-1]["step"] == 4


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(micro_built, tmp_path):
    _, planned, reference = micro_built
    store, experiments = tmp_path / ".bt", tmp_path / "experiments"
    assert plan_hash(run_bt("plan", str(MICRO), store=store)) == planned
    killed_in_checkpoint(planned, store, experiments, 12, "--target", "train:main")
    newest = (
        Store(store).outputs.work_dir(train_hash(store, planned))
        / "checkpoints"
        / "step-000008"
        / "model.safetensors"
    )
    damaged = bytearray(newest.read_bytes())
    damaged[-3] ^= 0x10
    newest.write_bytes(bytes(damaged))

    assert resume(planned, store, experiments)["train:main"] == reference["train:main"]
    (skipped,) = events(experiments, "checkpoint_skipped")
    assert skipped["checkpoint"] == "step-000008" and "blake3" in skipped["reason"]
    assert events(experiments, "resumed")[-1]["step"] == 4


def test_multi_stage_plan_killed_during_finetune_resumes_identically(stages_built, tmp_path):
    _, planned, reference = stages_built
    store, experiments = tmp_path / ".bt", tmp_path / "experiments"
    assert plan_hash(run_bt("plan", str(MICRO_STAGES), store=store)) == planned
    # finetune checkpoints every 3 updates: killed while writing the one at update 6
    stderr = killed_in_checkpoint(planned, store, experiments, 6)
    assert "train:finetune" in stderr
    assert Store(store).outputs.has(train_hash(store, planned, "train:pretrain"))

    result = run_bt("run", planned, store=store, env={"BT_EXPERIMENTS": str(experiments)})
    assert result.returncode == 0, result.stderr
    assert step_digests(store, planned) == reference


def test_negative_control_a_resume_that_forgets_the_data_cursor_differs(micro_built, tmp_path):
    _, planned, reference = micro_built
    store, experiments = tmp_path / ".bt", tmp_path / "experiments"
    assert plan_hash(run_bt("plan", str(MICRO), store=store)) == planned
    killed_in_checkpoint(planned, store, experiments, 8, "--target", "train:main")
    wrong = resume(planned, store, experiments, BT_TEST_SKIP_CURSOR_RESTORE="1")
    assert wrong["train:main"]["weights"] != reference["train:main"]["weights"]
