"""A real local Ray cluster with two logical nodes for tests and benchmarks: `ray start --head`
and `ray start --address`, each with --block in a process group of its own, with small CPU counts
and object stores. The second node starts as soon as the head's port answers, and one probe (a
process that imports ray) then waits for both. Stopped by process group (each `ray start --block`
and what it started), SIGTERM first, then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
from seaweed import free_ports

# Ray 2.60 turns token authentication on for every later cluster of a user once a local
# `ray.init()` has written ~/.ray/auth_token; a test cluster on one machine goes without.
NO_TOKEN = {"RAY_AUTH_MODE": "disabled"}
READY_TIMEOUT_S = 90.0
STOP_GRACE_S = 5.0
CPUS_PER_NODE = 2
OBJECT_STORE_BYTES = 80 * 1024 * 1024


@attrs.frozen
class RayCluster:
    address: str
    temp: Path
    processes: tuple[subprocess.Popen[bytes], ...]
    root: Path  # logs, and each node's own store

    def env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": self.address, **NO_TOKEN}

    def forget_node_stores(self) -> None:
        """Empty what the nodes built and pulled, as fresh nodes would start."""
        for store in self.root.glob("store-*"):
            shutil.rmtree(store)


def _ray_start(temp: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    command = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--block",
        "--num-cpus",
        str(CPUS_PER_NODE),
        "--object-store-memory",
        str(OBJECT_STORE_BYTES),
        "--disable-usage-stats",
        *args,
    ]
    with open(log, "ab") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # As `nohup ray start ... &` from a script leaves it: SIGINT ignored in every Ray
            # process, which the workers inherit (ray.cancel must still stop a step).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
            # Each node keeps its own store (with a remote), as separate machines would, and not in
            # the machine's default folder.
            env={**os.environ, **NO_TOKEN, "BT_NODE_STORE": str(log.parent / f"store-{log.stem}")},
        )


def alive_nodes(address: str) -> int:
    """How many nodes the cluster at `address` reports alive (0 when it does not answer yet)."""
    probe = (
        f"import ray; ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    environment = {**os.environ, **NO_TOKEN}
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=environment
    )
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def port_answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
        return True
    return False


def start(root: Path) -> RayCluster:
    # A short folder: Ray's Unix socket paths must fit in 107 bytes.
    temp = Path(tempfile.mkdtemp(prefix="bt-ray-", dir="/tmp"))
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    head = _ray_start(
        temp,
        root / "ray-head.log",
        "--head",
        "--port",
        str(port),
        "--include-dashboard=false",
        "--temp-dir",
        str(temp),
    )
    processes = [head]
    cluster = RayCluster(address, temp, tuple(processes), root)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        # The head's GCS port answering is enough for a node to join (`ray start --address`
        # waits for the GCS itself); only the last check needs a process that imports ray.
        while not port_answers(address):
            if time.monotonic() > deadline or head.poll() is not None:
                raise RuntimeError(f"the Ray head did not start; see {root / 'ray-head.log'}")
            time.sleep(0.2)
        processes.append(_ray_start(temp, root / "ray-worker.log", "--address", address))
        cluster = RayCluster(address, temp, tuple(processes), root)
        while alive_nodes(address) < 2:
            if time.monotonic() > deadline or head.poll() is not None or processes[1].poll() is not None:
                raise RuntimeError(
                    f"the Ray cluster did not start; see {root / 'ray-head.log'} and {root / 'ray-worker.log'}"
                )
            time.sleep(1)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def stop(cluster: RayCluster) -> None:
    """Each node's process group: SIGTERM, a short grace, then SIGKILL (by group id only)."""
    for process in reversed(cluster.processes):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in cluster.processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
    for process in cluster.processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    shutil.rmtree(cluster.temp, ignore_errors=True)  # its sessions' sockets and logs
