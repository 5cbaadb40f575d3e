"""`bt run --executor ray` on a real local Ray cluster of two logical nodes (started once per test
session, stopped at its end): the same bits as a local build, point by point; a null build that
never loads Ray; two ranks placed by Ray; a killed worker retried and resumed; the error lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import raycluster
from conftest import MICRO, plan_hash, run_bt, step_digests
from seaweed import free_ports

pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")

SWEEP = ("--sweep", "train.lr=1e-3,3e-3", "--sweep", "train.steps=8,12")
ONE_THREAD = ("--threads", "1", "--progress", "off")


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
    parents = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if b"buildtrain.executor.worker" not in command or b"--job" not in command:
            continue
        job = Path(command[command.index(b"--job") + 1].decode())
        if job.is_relative_to(store) and job.is_file() and '"kind": "train"' in job.read_text():
            parents.append(int(stat.rsplit(")", 1)[1].split()[1]))
    return parents


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
