"""`bt run --executor ray` on a real local Ray cluster of two logical nodes (started once per test
session, stopped at its end): the same bits as a local build, point by point; a null build that
never loads Ray; two ranks placed by Ray; a killed worker retried and resumed; the error lines."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import raycluster
from conftest import MICRO, plan_hash, run_bt, signed_data_and_a_checkpoint, step_digests
from seaweed import free_ports

from buildtrain.errors import ExitCode
from buildtrain.plan.stored import load_plan
from buildtrain.store.store import Store

pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")

SWEEP = ("--sweep", "train.lr=1e-3,3e-3", "--sweep", "train.steps=8,12")
ONE_THREAD = ("--threads", "1", "--progress", "off")
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}[platform.machine()]  # the syscall's number


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[raycluster.RayCluster]:
    cluster = raycluster.start(tmp_path_factory.mktemp("ray"))
    try:
        yield cluster
    finally:
        raycluster.stop(cluster)


def stores(tmp_path: Path) -> tuple[Path, Path]:
    """A store for the local build and one for the cluster's, each in a folder of its own."""
    for name in ("local", "cluster"):
        (tmp_path / name).mkdir()
    return tmp_path / "local" / ".bt", tmp_path / "cluster" / ".bt"


def on_ray(cluster: raycluster.RayCluster, remote: Path) -> dict[str, str]:
    remote.mkdir(exist_ok=True)
    return {**cluster.env(), "BT_EXECUTOR": "ray", "BT_REMOTE": remote.as_uri()}


def plans_of(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_a_sweep_on_ray_gives_the_local_bits_then_a_null_build(
    tmp_path: Path, ray_cluster: raycluster.RayCluster
) -> None:
    local, cluster = stores(tmp_path)
    plans = plans_of(run_bt("plan", str(MICRO), *SWEEP, store=local))
    assert plans == plans_of(run_bt("plan", str(MICRO), *SWEEP, store=cluster))  # no engine in a hash
    built = run_bt("run", *plans, *ONE_THREAD, store=local)
    assert built.returncode == 0, built.stderr
    env = on_ray(ray_cluster, tmp_path / "remote")
    first = run_bt("run", *plans, *ONE_THREAD, store=cluster, env=env)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("executed (on ") == 13, first.stderr  # 1 data, 4 x (train, eval, export)
    for plan in plans:
        assert step_digests(cluster, plan) == step_digests(local, plan), plan
    # A second run is a null build: every step a cache hit, and Ray is never even imported.
    argv = [sys.executable, "-X", "importtime", "-m", "buildtrain", "run", *plans, *ONE_THREAD]
    environment = {**os.environ, **env, "BT_STORE": str(cluster), "BT_EXPERIMENTS": str(tmp_path / "exp")}
    again = subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("0 executed, 4 cached") == 4, again.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in again.stderr.splitlines() if "|" in line}
    assert not {name for name in imported if name == "ray" or name.startswith("ray.")}
    # Four plans ran at once: each line of a plan's run says whose it is (announce, 4 steps, done).
    said = [line for line in again.stderr.splitlines() if "|" not in line]
    for plan in plans:
        assert sum(line.startswith(f"[{plan[:12]}] ") for line in said) == 6, said


def test_a_null_build_of_a_preset_on_ray_asks_no_worker_and_loads_no_ray(
    tmp_path: Path, ray_cluster: raycluster.RayCluster, micro_built: tuple
) -> None:
    """Issue 48: `bt run PRESET --executor ray` plans for the workers' toolchain. Once they have
    answered, a null build plans from the answer the store keeps: Ray is never imported, and it
    says what a local null build says. A kept answer that no longer holds is found out before a
    step is built: the workers are asked again and the preset planned again."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    local = run_bt("run", str(MICRO), "--progress", "off", store=store)
    assert local.returncode == 0, local.stderr
    env = {**ray_cluster.env(), "BT_EXECUTOR": "ray"}
    asked = run_bt("run", str(MICRO), "--progress", "off", store=store, env=env)
    assert asked.returncode == 0, asked.stderr
    assert "planning for the ray workers: torch " in asked.stderr and "answered before" not in asked.stderr

    def result(stderr: str) -> list[str]:  # the plan, its steps and its outcome, without times or paths
        lines = [line for line in stderr.splitlines() if "|" not in line and "planning for" not in line]
        return [re.sub(r"\S*experiments\S*|done in [0-9.]+s", "", line) for line in lines]

    argv = [sys.executable, "-X", "importtime", "-m", "buildtrain", "run", str(MICRO), "--progress", "off"]
    environment = {
        **os.environ,
        **env,
        "BT_STORE": str(store),
        "BT_EXPERIMENTS": str(tmp_path / "experiments"),
    }
    null = subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=120)
    assert null.returncode == 0, null.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in null.stderr.splitlines() if "|" in line}
    assert not {name for name in imported if name == "ray" or name.startswith("ray.")}
    assert "(as they answered before)" in null.stderr
    assert result(null.stderr) == result(local.stderr) and "0 executed, 4 cached" in local.stderr

    # A kept answer for another torch: the plan made from it is not built, so the workers are
    # asked again, answer with the real one, and the preset's plan is the built one again.
    (kept,) = (store / "cache" / "workers").iterdir()
    answer = json.loads(kept.read_text())
    kept.write_text(json.dumps({**answer, "torch": "0.0.0+other"}))
    again = run_bt("run", str(MICRO), "--progress", "off", store=store, env=env)
    assert again.returncode == 0, again.stderr
    assert "toolchain changed since asked before: planning again" in again.stderr
    assert result(again.stderr)[-6:] == result(local.stderr)[-6:]
    assert json.loads(kept.read_text()) == answer


def test_two_ranks_placed_by_ray_give_the_bits_of_two_local_ranks(
    tmp_path: Path, ray_cluster: raycluster.RayCluster
) -> None:
    local, cluster = stores(tmp_path)
    plan = plan_hash(run_bt("plan", str(MICRO), store=local))
    built = run_bt("run", plan, "--nproc", "2", "--progress", "off", store=local)
    assert built.returncode == 0, built.stderr
    assert plan_hash(run_bt("plan", str(MICRO), store=cluster)) == plan
    ranks = run_bt(
        "run",
        plan,
        "--nproc",
        "2",
        "--progress",
        "off",
        store=cluster,
        # No remote: the ranks build in the run's own store, which both nodes of this one-machine
        # cluster see.
        env={**ray_cluster.env(), "BT_EXECUTOR": "ray"},
        timeout=200,
    )
    assert ranks.returncode == 0, ranks.stderr
    assert step_digests(cluster, plan) == step_digests(local, plan)
    record = next((tmp_path / "cluster" / "experiments").iterdir()) / "train.log"
    assert '"world_size": 2' in record.read_text()  # both ranks reported: it ran on two

    # With a remote the ranks build in the nodes' own store and the output comes back through the
    # remote. Then again against an empty remote: the lead rank finds the step in its node's store
    # and pushes it, and the other rank, which would wait for it at the rendezvous, is stopped.
    for attempt in ("built", "found on the node"):
        folder = tmp_path / attempt.replace(" ", "-")
        folder.mkdir()
        again = run_bt(
            "run",
            str(MICRO),  # planned for the workers (the same machine here: the same hash)
            *("--nproc", "2", "--progress", "off"),
            store=folder / ".bt",
            env=on_ray(ray_cluster, folder / "remote"),
            timeout=200,
        )
        assert again.returncode == 0, (attempt, again.stderr)
        assert step_digests(folder / ".bt", plan) == step_digests(local, plan), attempt


def test_a_plan_for_the_ray_workers_asks_a_worker_for_its_toolchain(
    tmp_path: Path, ray_cluster: raycluster.RayCluster
) -> None:
    """`bt plan --executor ray` plans for the machine a Ray worker reports: here the same machine,
    so the same hash as a plan made for this one."""
    here = plan_hash(run_bt("plan", str(MICRO), store=tmp_path / ".bt"))
    planned = run_bt("plan", str(MICRO), "--executor", "ray", store=tmp_path / ".bt", env=ray_cluster.env())
    assert plan_hash(planned) == here
    assert "planning for the ray workers: torch " in planned.stderr, planned.stderr


def test_a_killed_ray_worker_is_retried_and_resumes(
    tmp_path: Path, ray_cluster: raycluster.RayCluster, micro_built: tuple
) -> None:
    """SIGKILL the Ray worker of a running train step once it has checkpointed: Ray retries the
    task, which resumes from the checkpoint (in the run's store: no remote here), and the
    weights are those of an uninterrupted build."""
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(MICRO), store=store))
    assert plan == micro_built[1]
    env = {
        **os.environ,
        **ray_cluster.env(),
        "BT_EXECUTOR": "ray",
        "BT_STORE": str(store),
        "BT_EXPERIMENTS": str(tmp_path / "exp"),
        "BT_TEST_STEP_DELAY": "0.7",  # 12 updates: time to kill it after its first checkpoint
    }
    argv = [sys.executable, "-m", "buildtrain", "run", plan, *ONE_THREAD]
    run = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        killed = _kill_the_train_task_after_a_checkpoint(store)
        _, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert killed, "no Ray worker was seen training after a checkpoint"
    assert run.returncode == 0, stderr
    assert step_digests(store, plan) == micro_built[2]
    log = next((tmp_path / "exp").iterdir()) / "train.log"
    assert '"event": "resumed"' in log.read_text()


def _start_slow_run(
    tmp_path: Path, plan: str, env: dict[str, str], delay: str = "0.7", blocked: frozenset[int] = frozenset()
) -> subprocess.Popen[str]:
    """`bt run PLAN` in the background, `delay` seconds an update (12 updates: time to act
    mid-step), started with the signals `blocked` (as a parent's mask would be inherited)."""
    argv = [sys.executable, "-m", "buildtrain", "run", plan, *ONE_THREAD]
    environment = {
        **os.environ,
        **env,
        "BT_STORE": str(tmp_path / ".bt"),
        "BT_EXPERIMENTS": str(tmp_path / "exp"),
        "BT_TEST_STEP_DELAY": delay,
    }
    return subprocess.Popen(
        argv,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: signal.pthread_sigmask(signal.SIG_BLOCK, blocked)) if blocked else None,
    )


def _finish(run: subprocess.Popen[str]) -> str:
    try:
        _, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return stderr


def _wait_for_a_pushed_checkpoint(remote: Path, nodes: Path, pattern: str = "*") -> list[Path]:
    """The train step's job files on the nodes (their stores are under `nodes`), once the remote
    holds one of its checkpoints (one named by `pattern`: `step-000004` is one with updates still
    to come). Only the nodes' jobs: the callers stop and kill these processes and their parents,
    and another pytest worker's torchrun is a train job's parent too (CI saw one killed)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if any(remote.glob(f"**/work/*/{pattern}.json")):
            jobs = _train_jobs(lambda job: job.is_relative_to(nodes))
            if jobs:
                return jobs
        time.sleep(0.2)
    return []


def test_a_node_that_dies_mid_step_resumes_from_the_checkpoint_it_pushed(
    tmp_path: Path, ray_cluster: raycluster.RayCluster, micro_built: tuple
) -> None:
    """Freeze the node's task and worker once a checkpoint is on the remote, wipe what the node
    kept of the step (a node lost with its disk), then kill both: Ray's retry finds nothing in its
    node's store and resumes from the remote's checkpoint, with the uninterrupted build's bits."""
    remote = tmp_path / "remote"
    plan = plan_hash(run_bt("plan", str(MICRO), store=tmp_path / ".bt"))
    ray_cluster.forget_node_stores()  # else the step is found built there by an earlier test
    run = _start_slow_run(tmp_path, plan, on_ray(ray_cluster, remote))
    try:
        jobs = _wait_for_a_pushed_checkpoint(remote, ray_cluster.root)
        assert jobs, "no train step was seen running with a checkpoint on the remote"
        processes = [pid for job in jobs for pid in _processes_of(job)]
        for pid in processes:
            os.kill(pid, signal.SIGSTOP)
        for job in jobs:  # the node's store: <store>/tmp/job-*.json
            shutil.rmtree(job.parent.parent / "work", ignore_errors=True)
        for pid in processes:
            os.kill(pid, signal.SIGKILL)
    finally:
        stderr = _finish(run)
    assert run.returncode == 0, stderr
    assert step_digests(tmp_path / ".bt", plan) == micro_built[2]
    log = next((tmp_path / "exp").iterdir()) / "train.log"
    assert '"event": "resumed"' in log.read_text()


def test_ctrl_c_cancels_the_ray_tasks_which_checkpoint_and_the_next_run_resumes(
    tmp_path: Path, ray_cluster: raycluster.RayCluster, micro_built: tuple
) -> None:
    remote = tmp_path / "remote"
    env = on_ray(ray_cluster, remote)
    plan = plan_hash(run_bt("plan", str(MICRO), store=tmp_path / ".bt"))
    ray_cluster.forget_node_stores()
    # 1.5 s an update: the signal lands well before the last of the 8 updates after the first
    # checkpoint, even on a loaded machine (or the step is built and nothing is left to resume).
    # The hard cases at once: the cluster's workers ignore SIGINT (raycluster.py starts it as
    # `nohup ray start &` leaves it; ray.cancel then did nothing and the step ran to its end),
    # bt starts with SIGINT blocked (an inherited mask), and the signal goes to a thread other
    # than the main one.
    run = _start_slow_run(tmp_path, plan, env, delay="1.5", blocked=frozenset({signal.SIGINT}))
    try:
        assert _wait_for_a_pushed_checkpoint(remote, ray_cluster.root, "step-000004"), (
            "no train step was seen training"
        )
        masks = _interrupt_through_another_thread(run.pid)
    finally:
        stderr = _finish(run)
    assert run.returncode == ExitCode.INTERRUPTED, stderr
    assert "Traceback" not in stderr
    train = next(
        step.hash for step in load_plan(Store(tmp_path / ".bt"), plan).steps if step.label == "train:main"
    )
    assert not (remote / "steps" / f"{train}.json").exists(), (
        f"the step ended before bt took the signal; {masks}"
    )
    # This run's step processes only: the nodes' stores and this test's own (another test file
    # may be training at this moment on another pytest worker).
    ours = (ray_cluster.root, tmp_path)
    outlived = _train_jobs(lambda job: any(job.is_relative_to(root) for root in ours))
    assert not outlived, "a worker outlived the cancelled run"
    again = run_bt("run", plan, *ONE_THREAD, store=tmp_path / ".bt", env=env)
    assert again.returncode == 0, again.stderr
    assert step_digests(tmp_path / ".bt", plan) == micro_built[2]
    logs = "".join(log.read_text() for log in (tmp_path / "experiments").glob("*/train.log"))
    assert '"event": "resumed"' in logs


def _interrupt_through_another_thread(pid: int) -> str:
    """SIGINT to `bt run`, handed to one of its threads that accepts it other than the main one
    (Ray's own, or a step's), as the kernel may do with a Ctrl-C; the threads' signal masks, for
    a failure's message. tgkill(2): Python's signal module sends only to its own threads."""
    masks = {int(task.name): _blocked_signals(task) for task in Path(f"/proc/{pid}/task").iterdir()}
    accepting = sorted(
        tid for tid, blocked in masks.items() if tid != pid and not blocked & 1 << signal.SIGINT - 1
    )
    assert accepting, f"no thread of bt run but its main one accepts SIGINT: {masks}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL, pid, accepting[-1], signal.SIGINT) != 0:
        raise OSError(ctypes.get_errno(), "tgkill failed")
    return f"blocked signals by thread: { {tid: hex(m) for tid, m in sorted(masks.items())} }"


def _blocked_signals(task: Path) -> int:
    """A thread's blocked signals (bit n - 1 for signal n), from /proc."""
    line = next(line for line in (task / "status").read_text().splitlines() if line.startswith("SigBlk:"))
    return int(line.split()[1], 16)


def _kill_the_train_task_after_a_checkpoint(store: Path) -> bool:
    """SIGKILL the Ray worker (the parent) of the step process training in `store`, once the
    step has a checkpoint."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if any(store.glob("work/*/checkpoints/step-*")):
            parents = _train_worker_parents(store)
            for pid in parents:
                os.kill(pid, signal.SIGKILL)
            if parents:
                return True
        time.sleep(0.2)
    return False


def _train_worker_parents(store: Path) -> list[int]:
    """The parents (Ray workers) of the step processes training a step of `store`."""
    return [_processes_of(job)[0] for job in _train_jobs(lambda job: job.is_relative_to(store))]


def _train_jobs(where: Callable[[Path], bool]) -> list[Path]:
    """The job files of the step processes now training, among those `where` accepts."""
    return [job for job in _worker_jobs() if where(job) and '"kind": "train"' in job.read_text()]


def _worker_jobs() -> dict[Path, tuple[int, int]]:
    """Each running step process's job file: (its parent's pid, its own)."""
    found: dict[Path, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if b"buildtrain.executor.process.worker" not in command or b"--job" not in command:
            continue
        job = Path(command[command.index(b"--job") + 1].decode())
        if job.is_file():
            found[job] = (int(stat.rsplit(")", 1)[1].split()[1]), int(entry.name))
    return found


def _processes_of(job: Path) -> tuple[int, int]:
    """(the Ray worker, the step process) running `job`."""
    return _worker_jobs()[job]


def test_engine_errors_are_one_line_with_exit_8(tmp_path: Path, ray_cluster: raycluster.RayCluster) -> None:
    store = tmp_path / ".bt"
    (port,) = free_ports(1)
    nobody = run_bt(
        "run",
        str(MICRO),
        *ONE_THREAD,
        store=store,
        env={"BT_EXECUTOR": "ray", "RAY_ADDRESS": f"127.0.0.1:{port}"},
    )
    assert nobody.returncode == 8, nobody.stderr
    assert error_line(nobody.stderr).startswith("bt run: RAY_ADDRESS=127.0.0.1:")
    # A native plan pinned at 4 threads: each node of the test cluster has 2 CPUs.
    big = run_bt(
        "run",
        str(MICRO),
        "--set",
        "numerics.profile='native'",
        "--set",
        "numerics.threads=4",
        "--progress",
        "off",
        store=store,
        env={**ray_cluster.env(), "BT_EXECUTOR": "ray"},
    )
    assert big.returncode == 8, big.stderr
    assert "no node of the Ray cluster has 4 CPU" in error_line(big.stderr)
    # Without the package (Python finds no module named ray): one line naming the extra.
    probe = (
        "import sys; sys.modules['ray'] = None; from buildtrain.cli import main; "
        f"sys.exit(main(['run', {str(MICRO)!r}, '--executor', 'ray', '--progress', 'off']))"
    )
    environment = {**os.environ, "BT_STORE": str(store), "BT_EXPERIMENTS": str(tmp_path / "exp")}
    missing = subprocess.run([sys.executable, "-c", probe], env=environment, capture_output=True, text=True)
    assert missing.returncode == 8, missing.stderr
    assert "pip install 'buildtrain[ray]'" in error_line(missing.stderr)


def error_line(stderr: str) -> str:
    """The one line `bt` ends a failed run with (after the run's own progress lines)."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("bt run: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_kept_checkpoints_are_scored_by_ray_tasks_beside_training(
    tmp_path: Path, ray_cluster: raycluster.RayCluster, micro_built: tuple[Path, str, dict]
) -> None:
    """Evaluation beside training under `--executor ray` (no remote: the local cluster shares the
    store): each kept checkpoint is scored by a Ray task of its own while the train step's task
    trains, to the weights of a local build; a task's worker SIGKILLed midway, and `bt run` again
    scores only what is missing."""
    from test_eval_beside import BESIDE, KILL_AFTER, curves, preset, scored

    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(preset(tmp_path, 4)), store=store))
    env = {**ray_cluster.env(), "BT_EXECUTOR": "ray"}
    first = run_bt(
        "run", planned, *ONE_THREAD, "--target", "train:main", store=store, env={**env, KILL_AFTER: "1"}
    )
    assert first.returncode == 0, first.stderr
    assert "evaluation beside training stopped (killed by signal 9)" in first.stderr
    assert step_digests(store, planned)["train:main"] == micro_built[2]["train:main"]
    beside = scored(tmp_path / "experiments")
    assert len(beside) == 2 and all(by for _, _, by in beside)  # one result per task (checkpoints 4, 8)

    again = run_bt("run", planned, *ONE_THREAD, store=store, env=env)
    assert again.returncode == 0, again.stderr
    every = Counter((s, u) for s, u, _ in scored(tmp_path / "experiments"))
    assert every == Counter(BESIDE | {("arith", 12), ("sums", 12)})  # each once over both runs
    assert curves(store, planned) == {"arith": [4, 8, 12], "sums": [4, 8, 12]}


def test_nodes_keep_the_runs_min_attestations(
    tmp_path: Path, ray_cluster: raycluster.RayCluster, micro_built: tuple
) -> None:
    """Under `--min-attestations`, a node builds a step whose remote output is missing from
    scratch: never from the remote's checkpoint (no one signs one), which a node resumed from
    without it. The run then takes the node's build (pinned by its manifest) although no key the
    reader trusts signed it, and the nodes take exactly the inputs the run holds."""
    _, plan, honest = micro_built
    env = on_ray(ray_cluster, tmp_path / "remote")
    reader = signed_data_and_a_checkpoint(micro_built, tmp_path / "remote", tmp_path / "reader")
    ray_cluster.forget_node_stores()
    store = stores(tmp_path)[1]
    run = run_bt("run", plan, *ONE_THREAD, store=store, env={**env, **reader})
    assert run.returncode == 0, run.stderr
    assert "1 pulled" in run.stderr and "3 executed" in run.stderr, run.stderr
    log = next((store.parent / "experiments").iterdir()) / "train.log"
    assert "not resuming from the remote's checkpoint (no one signs one)" in log.read_text()
    assert '"event": "resumed"' not in log.read_text()
    assert step_digests(store, plan) == honest
