"""`bt run --executor slurm` on a real single-node Slurm (tests/slurm.py): the same bits as a local
build, a null build that never asks Slurm anything, a requeued job that resumes, and one line
for each way the engine can be unavailable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurm
from conftest import (
    MICRO,
    Reference,
    actions,
    plan_hash,
    run_bt,
    signed_data_and_a_checkpoint,
    step_digests,
    summaries,
)

from buildtrain.errors import ExitCode, UsageError
from buildtrain.executor.engines.slurm_engine import SlurmSettings
from buildtrain.executor.engines.slurm_task import rendezvous

SWEEP = ("--sweep", "train.lr=3e-3,1e-2", "--sweep", "train.steps=8,12")
NO_SLURM = "/nonexistent/slurm.conf"  # any Slurm command reading it fails at once


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm.Slurm]:
    """munged, slurmctld and slurmd for the whole session, stopped by pid at its end; their
    configuration and logs stay under pytest's temporary folder (the last few sessions are kept)."""
    missing = slurm.missing_binaries()
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)}; apt-get install slurmctld slurmd munge): "
            "Slurm tests skipped"
        )
    cluster = slurm.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        slurm.stop(cluster)


def on_slurm(cluster: slurm.Slurm, **extra: str) -> dict[str, str]:
    return {**cluster.env(), "BT_EXECUTOR": "", **extra}


def bt_without_submitit(*args: str, store: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`bt ARGS` in a process where `import submitit` fails (None in sys.modules is Python's own
    way of saying that a module cannot be imported), as where it is not installed."""
    program = "import sys; sys.modules['submitit'] = None; from buildtrain.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", program, *args],
        env={
            **os.environ,
            "BT_STORE": str(store),
            "BT_EXPERIMENTS": str(store.parent / "experiments"),
            **env,
        },
        cwd=store.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# -- settings and rendezvous (no cluster) ------------------------------------------------------


def test_settings_come_from_options_then_variables_and_bad_ones_name_both() -> None:
    environ = {"BT_SLURM_PARTITION": "gpu", "BT_SLURM_TIME": "30", "BT_SLURM_ACCOUNT": "lab"}
    chosen = SlurmSettings.from_options({"partition": "debug"}, environ)
    assert (chosen.partition, chosen.account, chosen.time_min, chosen.gpus_per_node) == (
        "debug",
        "lab",
        30,
        None,
    )
    assert SlurmSettings.from_options({}, {}).time_min == 60
    with pytest.raises(
        UsageError, match=r"--slurm-time / BT_SLURM_TIME \(minutes\): must be a whole number >= 1"
    ):
        SlurmSettings.from_options({}, {"BT_SLURM_TIME": "1h"})
    with pytest.raises(UsageError, match="--slurm-gpus-per-node / BT_SLURM_GPUS_PER_NODE"):
        SlurmSettings.from_options({"gpus_per_node": "-1"}, {})


def test_the_rendezvous_comes_from_slurms_environment() -> None:
    one_node = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "41"}
    variables = rendezvous({**one_node, "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": "2"}, "node7")
    assert variables["RANK"] == "1" and variables["WORLD_SIZE"] == "2" and variables["LOCAL_RANK"] == "1"
    assert variables["MASTER_ADDR"] == "127.0.0.1" and variables["GLOO_SOCKET_IFNAME"] == "lo"
    two_nodes = rendezvous(
        {**one_node, "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "1(x2)"}, "node7"
    )
    assert two_nodes["MASTER_ADDR"] == "node7" and two_nodes["LOCAL_WORLD_SIZE"] == "1"
    assert "GLOO_SOCKET_IFNAME" not in two_nodes
    # Every rank of one job derives the same port, and two jobs in a row get different ones.
    assert two_nodes["MASTER_PORT"] == variables["MASTER_PORT"]
    assert rendezvous({**one_node, "SLURM_JOB_ID": "42"}, "n")["MASTER_PORT"] != variables["MASTER_PORT"]


# -- on the cluster --------------------------------------------------------------------------


def test_the_cluster_runs_a_batch_job(slurm_cluster: slurm.Slurm, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    done = subprocess.run(
        ["sbatch", "--wait", "--output", str(out), "--wrap", "echo $SLURM_JOB_ID on $SLURMD_NODENAME"],
        env={**os.environ, **slurm_cluster.env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text().split()[-1] == slurm_cluster.node


def test_a_sweep_on_slurm_gives_the_local_bits_and_then_a_null_build(
    slurm_cluster: slurm.Slurm, tmp_path: Path
) -> None:
    local, remote = tmp_path / "local" / ".bt", tmp_path / "slurm" / ".bt"
    for folder in (local.parent, remote.parent):
        folder.mkdir()
    planned = run_bt("plan", str(MICRO), *SWEEP, store=local)
    assert planned.returncode == 0, planned.stderr
    plans = planned.stdout.split()
    assert len(plans) == 4
    built_here = run_bt("run", *plans, "--progress", "off", store=local)
    assert built_here.returncode == 0, built_here.stderr

    env = on_slurm(slurm_cluster)
    first = run_bt(
        "run", str(MICRO), *SWEEP, "--executor", "slurm", "--progress", "off", store=remote, env=env
    )
    assert first.returncode == 0, first.stderr
    for plan in plans:  # planned for the node's toolchain: here the same as this machine's
        assert step_digests(remote, plan) == step_digests(local, plan)
    log = "".join(p.read_text() for p in (tmp_path / "slurm" / "experiments").glob("*/train.log"))
    running = [json.loads(line) for line in log.splitlines() if '"slurm_job_running"' in line]
    assert running and {line["node"] for line in running} == {slurm_cluster.node}
    assert not list((remote / "tmp" / "slurm").glob("*_outcome.json"))  # a built step leaves no job files

    # Nothing to build: neither submitit nor any Slurm command is needed (neither would work here).
    again = bt_without_submitit(
        "run", *plans, "--executor", "slurm", "--progress", "off", store=remote, env={"SLURM_CONF": NO_SLURM}
    )
    assert again.returncode == 0, again.stderr
    records = summaries(tmp_path / "slurm" / "experiments")[-len(plans) :]
    assert all(set(actions(summary).values()) == {"cached"} for summary in records)
    # The preset too (issue 48): planned from the toolchain the first run's probe job reported,
    # which the store keeps, so no probe job is submitted (without submitit none could be).
    preset = bt_without_submitit(
        "run", str(MICRO), *SWEEP, "--executor", "slurm", "--progress", "off", store=remote, env=env
    )
    assert preset.returncode == 0, preset.stderr
    assert (
        "planning for the slurm workers: " in preset.stderr and "(as they answered before)" in preset.stderr
    )
    records = summaries(tmp_path / "slurm" / "experiments")[-len(plans) :]
    assert all(set(actions(summary).values()) == {"cached"} for summary in records)
    assert {summary["plan"] for summary in records} == set(plans)


def test_a_two_rank_train_step_is_one_job_of_two_tasks_with_the_local_bits(
    slurm_cluster: slurm.Slurm, tmp_path: Path
) -> None:
    local, remote = tmp_path / "local" / ".bt", tmp_path / "slurm" / ".bt"
    for folder in (local.parent, remote.parent):
        folder.mkdir()
    here = run_bt("run", str(MICRO), "--nproc", "2", "--progress", "off", store=local)
    assert here.returncode == 0, here.stderr
    there = run_bt(
        "run", str(MICRO), "--nproc", "2", "--executor", "slurm", "--progress", "off", store=remote,
        env=on_slurm(slurm_cluster),
    )  # fmt: skip
    assert there.returncode == 0, there.stderr
    planned = plan_hash(run_bt("plan", str(MICRO), "--nproc", "2", store=remote))
    assert step_digests(remote, planned) == step_digests(local, planned)
    log = "".join(p.read_text() for p in (tmp_path / "slurm" / "experiments").glob("*/train.log"))
    applied = [
        json.loads(line) for line in log.splitlines() if '"numerics_applied"' in line and '"train:' in line
    ]
    assert sorted(line["rank"] for line in applied) == [0, 1]  # both tasks trained, each its own process


def slow_micro_run_on_slurm(cluster: slurm.Slurm, tmp_path: Path) -> subprocess.Popen:
    """`bt run MICRO --executor slurm` in the background, its train step slowed so that a test can
    act on its running job (12 updates: about 5 s of training); the store is tmp_path/.bt."""
    env = {
        **os.environ,
        "BT_STORE": str(tmp_path / ".bt"),
        "BT_EXPERIMENTS": str(tmp_path / "experiments"),
        **on_slurm(cluster, BT_TEST_STEP_DELAY="0.4"),
    }
    command = [
        sys.executable,
        "-m",
        "buildtrain",
        "run",
        str(MICRO),
        "--executor",
        "slurm",
        "--progress",
        "off",
    ]
    return subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)


def _running_train_job(folder: Path, deadline: float) -> str:
    """The id of the train step's job once its worker saved a checkpoint (so there is one to
    resume from), from the events the job appends."""
    while time.monotonic() < deadline:
        for events in folder.glob("*_0_events.jsonl"):
            text = events.read_text(encoding="utf-8", errors="replace")
            if '"checkpoint_saved"' in text and '"train:' in text:
                return events.name.split("_")[0]
        time.sleep(0.2)
    raise AssertionError(f"no train step saved a checkpoint in a Slurm job ({sorted(os.listdir(folder))})")


# How a running job is made to go back to the queue: by hand, and by the warning submitit asks
# Slurm to send before the time limit (`--signal USR2@90`), here sent at once.
REQUEUES = {
    "scontrol_requeue": lambda job: ["scontrol", "requeue", job],
    "time_limit_warning": lambda job: ["scancel", "--signal=USR2", job],
}


@pytest.mark.parametrize("how", sorted(REQUEUES))
def test_a_requeued_train_job_resumes_and_gives_the_uninterrupted_bits(
    how: str, slurm_cluster: slurm.Slurm, micro_built: Reference, tmp_path: Path
) -> None:
    _, planned, reference = micro_built
    store = tmp_path / ".bt"
    with slow_micro_run_on_slurm(slurm_cluster, tmp_path) as bt:
        try:
            job = _running_train_job(store / "tmp" / "slurm", time.monotonic() + 180)
            requeued = subprocess.run(
                REQUEUES[how](job), env={**os.environ, **slurm_cluster.env()}, capture_output=True, text=True
            )
            assert requeued.returncode == 0, requeued.stderr
            _, stderr = bt.communicate(timeout=300)
        finally:
            if bt.poll() is None:
                bt.kill()
    assert bt.returncode == 0, stderr
    assert plan_hash(run_bt("plan", str(MICRO), store=store)) == planned
    assert step_digests(store, planned) == reference
    log = "".join(p.read_text() for p in (tmp_path / "experiments").glob("*/train.log"))
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    names = [event.get("event") for event in events]
    assert "slurm_job_requeued" in names
    assert "resumed" in names[names.index("slurm_job_requeued") :]


def test_ctrl_c_cancels_the_job_which_checkpoints_and_the_next_run_resumes(
    slurm_cluster: slurm.Slurm, micro_built: Reference, tmp_path: Path
) -> None:
    _, planned, reference = micro_built
    store = tmp_path / ".bt"
    with slow_micro_run_on_slurm(slurm_cluster, tmp_path) as bt:
        try:
            job = _running_train_job(store / "tmp" / "slurm", time.monotonic() + 180)
            bt.send_signal(signal.SIGINT)
            _, stderr = bt.communicate(timeout=120)
        finally:
            if bt.poll() is None:
                bt.kill()
    assert bt.returncode == ExitCode.INTERRUPTED, stderr
    state = slurm_job_state(slurm_cluster, job)
    assert state in ("CANCELLED", "GONE"), state  # nothing of the step runs on behind bt's back
    again = run_bt(
        "run",
        str(MICRO),
        "--executor",
        "slurm",
        "--progress",
        "off",
        store=store,
        env=on_slurm(slurm_cluster),
    )
    assert again.returncode == 0, again.stderr
    assert "resuming from checkpoint" in again.stderr
    assert step_digests(store, planned) == reference


def slurm_job_state(cluster: slurm.Slurm, job: str) -> str:
    shown = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job],
        env={**os.environ, **cluster.env()},
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        return "GONE"
    return shown.stdout.split("JobState=", 1)[1].split()[0]


# -- one line each when the engine cannot run a step -----------------------------------------


def test_without_submitit_the_run_says_how_to_install_it(tmp_path: Path, slurm_cluster: slurm.Slurm) -> None:
    done = bt_without_submitit(
        "run",
        str(MICRO),
        "--executor",
        "slurm",
        "--progress",
        "off",
        store=tmp_path / ".bt",
        env=on_slurm(slurm_cluster),
    )
    assert done.returncode == ExitCode.ENGINE_UNAVAILABLE, done.stderr
    said = error_lines(done.stderr)
    assert said[-1].endswith(
        "--executor slurm needs submitit, which is not installed: pip install 'buildtrain[slurm]'"
    )
    assert "Traceback" not in done.stderr


def test_no_controller_is_one_line_naming_slurm_conf(tmp_path: Path, slurm_cluster: slurm.Slurm) -> None:
    conf = tmp_path / "slurm.conf"  # the cluster's configuration, its controller on a port nobody serves
    port = slurm.free_ports(1)[0]
    text = slurm_cluster.conf.read_text()
    conf.write_text(
        "\n".join(
            f"SlurmctldPort={port}" if line.startswith("SlurmctldPort=") else line
            for line in text.splitlines()
        )
    )
    done = run_bt(
        "run",
        str(MICRO),
        "--executor",
        "slurm",
        "--progress",
        "off",
        store=tmp_path / ".bt",
        env={"SLURM_CONF": str(conf)},
    )
    assert done.returncode == ExitCode.ENGINE_UNAVAILABLE, done.stderr
    last = error_lines(done.stderr)[-1]
    assert (
        "no Slurm controller answers" in last
        and f"SLURM_CONF at the cluster's slurm.conf (now {conf})" in last
    )
    assert "Traceback" not in done.stderr


def test_a_step_no_node_can_hold_is_refused_in_one_line(tmp_path: Path, slurm_cluster: slurm.Slurm) -> None:
    plan = plan_hash(run_bt("plan", str(MICRO), store=tmp_path / ".bt"))  # a preset would ask a probe job
    done = run_bt(
        "run",
        plan,
        "--executor",
        "slurm",
        "--slurm-gpus-per-node",
        "2",
        "--progress",
        "off",
        store=tmp_path / ".bt",
        env=on_slurm(slurm_cluster),
    )
    assert done.returncode == ExitCode.ENGINE_UNAVAILABLE, done.stderr
    last = error_lines(done.stderr)[-1]
    assert "Slurm refused data:main" in last and "2 GPU(s)" in last and "--slurm-partition" in last
    assert not [line for line in error_lines(done.stderr) if line.startswith("sbatch:")]  # said once
    assert "Traceback" not in done.stderr
    assert not list((tmp_path / ".bt" / "tmp" / "slurm").glob("*.job.json"))  # nothing left behind


def test_a_job_that_can_never_start_is_cancelled_in_one_line(
    tmp_path: Path, slurm_cluster: slurm.Slurm
) -> None:
    # One rank more than the node has CPUs, one CPU each: sbatch accepts the job, which would then
    # wait for ever (PartitionConfig) unless bt cancels it.
    ranks = str(slurm_cluster.cpus + 1)
    sets = ("--set", f"train.batch_size={ranks}", "--set", "train.micro_batch_size=1")
    done = run_bt(
        "run", str(MICRO), *sets, "--nproc", ranks, "--executor", "slurm", "--progress", "off",
        store=tmp_path / ".bt", env=on_slurm(slurm_cluster),
    )  # fmt: skip
    assert done.returncode == ExitCode.ENGINE_UNAVAILABLE, done.stderr
    last = error_lines(done.stderr)[-1]
    assert "of train:main can never start (PartitionConfig)" in last and "--slurm-partition" in last
    job = last.split("job ", 1)[1].split()[0]
    assert slurm_job_state(slurm_cluster, job) in ("CANCELLED", "GONE")
    assert "Traceback" not in done.stderr


def test_a_plan_for_the_slurm_workers_names_their_toolchain_and_nodes_refuse_another(
    tmp_path: Path, slurm_cluster: slurm.Slurm
) -> None:
    """The jobs inherit bt's environment, so the test hook that makes a process report another
    torch build makes the node differ from this machine, as a GPU node differs from a laptop."""
    store = tmp_path / ".bt"
    here = plan_hash(run_bt("plan", str(MICRO), store=store))
    other = on_slurm(slurm_cluster, BT_TEST_TORCH_BUILD="2.99.0+test")
    planned = run_bt("plan", str(MICRO), "--executor", "slurm", store=store, env=other)
    there = plan_hash(planned)
    assert there != here, "the workers' torch build is part of the train step's hash"
    assert "planning for the slurm workers: torch 2.99.0+test" in planned.stderr, planned.stderr
    assert not list((store / "tmp" / "slurm").iterdir())  # the probe's job files are gone

    # This machine is not one of those workers: a local run of their plan is refused.
    local = run_bt("run", there, "--progress", "off", store=store)
    assert local.returncode == ExitCode.TOOLCHAIN_MISMATCH, local.stderr
    assert "torch: plan has '2.99.0+test'" in local.stderr

    # A node whose toolchain is not the plan's refuses the step (never used silently).
    refused = run_bt(
        "run",
        here,
        "--executor",
        "slurm",
        "--target",
        "train:main",
        "--progress",
        "off",
        store=store,
        env=other,
    )
    assert refused.returncode == ExitCode.TOOLCHAIN_MISMATCH, refused.stderr
    last = error_lines(refused.stderr)[-1]
    assert "train:main: node " in last and "torch: plan has" in last and "'2.99.0+test'" in last, last
    assert "bt plan PRESET --executor ENGINE" in last
    assert "Traceback" not in refused.stderr


def test_kept_checkpoints_are_scored_by_slurm_jobs_beside_training(
    slurm_cluster: slurm.Slurm, tmp_path: Path, micro_built: Reference
) -> None:
    """Evaluation beside training under `--executor slurm`: each kept checkpoint is scored by a
    Slurm job of its own while the train step's job trains, to the weights of a local build; a
    job's worker SIGKILLed midway, and `bt run` again scores only what is missing."""
    from collections import Counter

    from test_eval_beside import BESIDE, KILL_AFTER, curves, preset, scored

    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(preset(tmp_path, 4)), store=store))
    env = on_slurm(slurm_cluster)
    args = ("--executor", "slurm", "--threads", "1", "--progress", "off")
    first = run_bt("run", planned, *args, "--target", "train:main", store=store, env={**env, KILL_AFTER: "1"})
    assert first.returncode == 0, first.stderr
    assert "evaluation beside training stopped (killed by signal 9)" in first.stderr
    assert step_digests(store, planned)["train:main"] == micro_built[2]["train:main"]
    beside = scored(tmp_path / "experiments")
    assert len(beside) == 2 and all(by for _, _, by in beside)  # one result per job (checkpoints 4, 8)

    again = run_bt("run", planned, *args, store=store, env=env)
    assert again.returncode == 0, again.stderr
    every = Counter((s, u) for s, u, _ in scored(tmp_path / "experiments"))
    assert every == Counter(BESIDE | {("arith", 12), ("sums", 12)})  # each once over both runs
    assert curves(store, planned) == {"arith": [4, 8, 12], "sums": [4, 8, 12]}


def test_a_slurm_run_keeps_its_min_attestations(
    slurm_cluster: slurm.Slurm, tmp_path: Path, micro_built: tuple
) -> None:
    """Slurm's nodes build in the run's store and never ask the remote: the run itself applies
    `--min-attestations`, so a step whose remote output is missing is built from scratch, never
    from the remote's unsigned checkpoint."""
    _, plan, honest = micro_built
    reader = signed_data_and_a_checkpoint(micro_built, tmp_path / "remote", tmp_path / "reader")
    store = tmp_path / "slurm" / ".bt"
    store.parent.mkdir()
    env = on_slurm(slurm_cluster, BT_REMOTE=(tmp_path / "remote").as_uri(), **reader)
    run = run_bt("run", plan, "--executor", "slurm", "--progress", "off", store=store, env=env)
    assert run.returncode == 0, run.stderr
    assert "not resuming from the remote's checkpoint (no one signs one)" in run.stderr, run.stderr
    assert "resuming from step-" not in run.stderr and "1 pulled" in run.stderr
    assert step_digests(store, plan) == honest
