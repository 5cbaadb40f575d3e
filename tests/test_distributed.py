"""Train steps on several processes through torchrun (gloo on CPU).

The `invariant` reduction gives the weights of one process at any world size that divides the
micro-batches, through kills and resumes at another world size; `allreduce` puts the world size
in the plan hash and reproduces at that world size.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MICRO, plan_hash, run_bt, step_digests
from test_resume import events, resume, start, train_hash, wait_for_step

from buildtrain.errors import ExitCode
from buildtrain.store.store import Store

# Four micro-batches of one sequence per update: world sizes 1, 2 and 4 all divide them.
FOUR_MICRO_BATCHES = ("--set", "train.micro_batch_size=1")
ALLREDUCE = ("--set", "train.reduction='allreduce'")


def build(store: Path, planned: str, *args: str) -> dict[str, str]:
    """Build the train step (and its data) of a plan; the train step's digests."""
    return resume(planned, store, store.parent / "experiments", *args)["train:main"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """The invariant plan built on one process: (plan hash, train step digests)."""
    store = tmp_path_factory.mktemp("one-process") / ".bt"
    planned = plan_hash(run_bt("plan", str(MICRO), *FOUR_MICRO_BATCHES, store=store))
    return planned, build(store, planned)


@pytest.mark.parametrize("nproc", [2, 4])
def test_invariant_weights_do_not_depend_on_the_world_size(
    tmp_path: Path, one_process: tuple[str, dict[str, str]], nproc: int
) -> None:
    planned, reference = one_process
    store = tmp_path / ".bt"
    assert (
        plan_hash(run_bt("plan", str(MICRO), *FOUR_MICRO_BATCHES, "--nproc", str(nproc), store=store))
        == planned
    )
    digests = build(store, planned, "--nproc", str(nproc))
    assert digests == reference  # weights, full state and the per-update trace (loss bits included)
    record = next((tmp_path / "experiments").glob("*/train.log")).read_text()
    assert f'"world_size": {nproc}' in record and f'"rank": {nproc - 1}' in record  # every rank logged


def kill_the_last_rank(store: Path, planned: str, nproc: int) -> None:
    """`bt run` the train step on `nproc` processes, the last of which SIGKILLs itself after
    update 6 (the micro presets checkpoint every 4): it fails, naming the rank and the signal."""
    last_rank = nproc - 1
    killed = run_bt(
        "run",
        planned,
        "--target",
        "train:main",
        "--nproc",
        str(nproc),
        store=store,
        env={"BT_TEST_KILL_RANK": f"{last_rank}:6"},
    )
    assert killed.returncode == ExitCode.FAILED, killed.stderr
    assert "SIGKILL" in killed.stderr and "resumes from the last checkpoint" in killed.stderr
    if nproc > 1:
        assert f"rank {last_rank} of {nproc} was killed by SIGKILL" in killed.stderr
    assert "Traceback" not in killed.stderr


@pytest.mark.parametrize(("killed_at", "resumed_at"), [(2, 1), (1, 2)])
def test_a_run_killed_at_one_world_size_resumes_at_another(
    tmp_path: Path, one_process: tuple[str, dict[str, str]], killed_at: int, resumed_at: int
) -> None:
    planned, reference = one_process
    store = tmp_path / ".bt"
    run_bt("plan", str(MICRO), *FOUR_MICRO_BATCHES, store=store)
    kill_the_last_rank(store, planned, killed_at)
    assert "train:main" not in step_digests(store, planned)  # nothing partial was published
    saved = sorted(
        p.name for p in (Store(store).outputs.work_dir(train_hash(store, planned)) / "checkpoints").iterdir()
    )
    assert saved == ["step-000004"]

    assert build(store, planned, "--nproc", str(resumed_at)) == reference


def test_sigterm_stops_every_rank_at_the_same_update(
    tmp_path: Path, one_process: tuple[str, dict[str, str]]
) -> None:
    planned, reference = one_process
    store, experiments = tmp_path / ".bt", tmp_path / "experiments"
    run_bt("plan", str(MICRO), *FOUR_MICRO_BATCHES, store=store)
    process = start(planned, store, experiments, "--nproc", "2", BT_TEST_STEP_DELAY="0.3")
    wait_for_step(process, experiments, 2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == ExitCode.INTERRUPTED, stderr
    assert f"resume with: bt run {planned}" in stderr
    stopped = {event["rank"]: event["message"] for event in events(experiments, "interrupted")}
    saved = events(experiments, "checkpoint_saved")[-1]["step"]
    assert set(stopped) == {0, 1}
    assert all(f"after step {saved};" in message for message in stopped.values()), stopped
    assert build(store, planned) == reference  # resumed on one process


def test_allreduce_puts_the_world_size_in_the_hash_and_reproduces_at_it(tmp_path: Path) -> None:
    first, second = tmp_path / "a" / ".bt", tmp_path / "b" / ".bt"
    first.parent.mkdir()
    second.parent.mkdir()
    plans = {
        nproc: plan_hash(
            run_bt("plan", str(MICRO), *FOUR_MICRO_BATCHES, *ALLREDUCE, "--nproc", str(nproc), store=first)
        )
        for nproc in (1, 2)
    }
    assert plans[1] != plans[2]
    wrong = run_bt("run", plans[2], "--nproc", "1", store=first)
    assert wrong.returncode == ExitCode.TOOLCHAIN_MISMATCH
    assert "world_size: plan has 2, this machine has 1" in wrong.stderr and "--nproc" in wrong.stderr

    run_bt("plan", str(MICRO), *FOUR_MICRO_BATCHES, *ALLREDUCE, "--nproc", "2", store=second)
    assert build(first, plans[2], "--nproc", "2") == build(second, plans[2], "--nproc", "2")


def test_a_world_size_that_does_not_divide_the_micro_batches_is_refused(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    planned = run_bt("plan", str(MICRO), *FOUR_MICRO_BATCHES, "--nproc", "3", store=store)
    assert planned.returncode == ExitCode.USAGE
    assert (
        "--set train.micro_batch_size=1: train.micro_batch_size: 4 // 1 = 4 micro-batches" in planned.stderr
    )
    assert "cannot be shared by 3 processes" in planned.stderr
    assert "[1, 2, 4]" in planned.stderr

    unsplit = run_bt("plan", str(MICRO), "--nproc", "4", store=store)  # micro.toml: 2 micro-batches
    assert unsplit.returncode == ExitCode.USAGE
    assert f"{MICRO.name}: train.micro_batch_size:" in unsplit.stderr

    planned_for_one = plan_hash(run_bt("plan", str(MICRO), *FOUR_MICRO_BATCHES, store=store))
    ran = run_bt("run", planned_for_one, "--nproc", "3", store=store)
    assert ran.returncode == ExitCode.USAGE
    assert "train:main: train.micro_batch_size:" in ran.stderr
    assert not (store / "steps").exists()


def test_verify_at_two_processes_with_a_kill_passes_on_a_plan_built_on_one(
    micro_built: tuple[Path, str, dict],
) -> None:
    store, planned, _ = micro_built
    result = run_bt("verify", planned, "--nproc", "2", "--resume-at", "5", store=store)
    assert result.returncode == ExitCode.OK, result.stderr
    assert "train steps on 2 processes" in result.stderr
    assert "✓ train:main" in result.stderr and "(killed and resumed at 5)" in result.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node(stores: list[Path], rank: int, planned: str, endpoint: str) -> subprocess.Popen:
    """`bt run` as node `rank` of two, each with its own store, meeting at `endpoint`."""
    argv = ["run", planned, "--target", "train:main", "--progress", "off", "--nproc", "1"]
    argv += ["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint]
    store = stores[rank]
    environment = {**os.environ, "BT_STORE": str(store), "BT_EXPERIMENTS": str(store.parent / "x")}
    return subprocess.Popen(
        [sys.executable, "-m", "buildtrain", *argv],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=store.parent,
    )


def test_two_nodes_with_their_own_stores_train_the_weights_of_one_process(
    tmp_path: Path, one_process: tuple[str, dict[str, str]]
) -> None:
    """Two `bt run`s on this machine stand in for two machines: node 0 writes the outputs, node 1
    builds its own data, trains with node 0 and remembers that it did."""
    planned, reference = one_process
    stores = [tmp_path / f"node{rank}" / ".bt" for rank in (0, 1)]
    for store in stores:
        store.parent.mkdir()
        assert plan_hash(run_bt("plan", str(MICRO), *FOUR_MICRO_BATCHES, store=store)) == planned
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [node(stores, 0, planned, endpoint), node(stores, 1, planned, endpoint)]
    outputs = [process.communicate(timeout=240) for process in nodes]
    for process, (_, stderr) in zip(nodes, outputs, strict=True):
        assert process.returncode == ExitCode.OK, stderr
    assert step_digests(stores[0], planned)["train:main"] == reference
    assert "train:main" not in step_digests(stores[1], planned)  # node 0 alone writes outputs
    assert "joined" in outputs[1][1] and "node 1 of 2" in outputs[1][1]

    again = run_bt(
        "run",
        planned,
        "--target",
        "train:main",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        endpoint,
        store=stores[1],
    )
    assert again.returncode == ExitCode.OK, again.stderr
    assert "cached (joined before)" in again.stderr


def test_nodes_building_different_steps_refuse_to_train_together(tmp_path: Path) -> None:
    stores = [tmp_path / f"node{rank}" / ".bt" for rank in (0, 1)]
    plans = []
    for rank, store in enumerate(stores):
        store.parent.mkdir()
        plans.append(plan_hash(run_bt("plan", str(MICRO), "--set", f"train.seed={rank}", store=store)))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [node(stores, rank, plans[rank], endpoint) for rank in (0, 1)]
    for process in nodes:
        _, stderr = process.communicate(timeout=240)
        assert process.returncode == ExitCode.FAILED, stderr
        assert "build another step; run the same plan on every node" in stderr
        assert "Traceback" not in stderr
    assert "train:main" not in step_digests(stores[0], plans[0])
