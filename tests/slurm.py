"""A real single-node Slurm for tests and benchmarks: munged, slurmctld and slurmd from Debian's
packages (`apt-get install slurmctld slurmd munge`; .ci/run installs them).

Everything lives under one folder: a fresh munge key and munged's socket, `slurm.conf`, the
controller's state and the node's spool, and one log per daemon. The daemons run in the foreground
as children of this process, found and stopped by their pids, never by name. The Slurm commands
(`sbatch`, `squeue`, `scontrol`) and the jobs themselves find this cluster through `SLURM_CONF`
(without it they read /etc/slurm/slurm.conf): `env()` gives it, and every caller passes it on.

The cluster is one node on 127.0.0.1 with as many CPUs as this machine has; the settings below
are the ones that work in a container without cgroups or accounting (linuxproc tracks a job's
processes by parentage; nothing records finished jobs, so `sacct` answers nothing here). Up and idle
in about 2 s here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
from daemons import stop_by_pid

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "mungekey")
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
# A requeued job may start again only once the credentials of its first run expired: Slurm's
# default of 120 s would stall every requeue test for two minutes. 5 s is the least it accepts
# (a smaller value is ignored for the default), and a step's launch needs far less.
CRED_EXPIRE_S = 5
# How long a job's processes have between SIGTERM and SIGKILL (a train step checkpoints in it).
KILL_WAIT_S = 15
PARTITION = "bt"


def missing_binaries() -> list[str]:
    """The Slurm and munge programs that are not installed (an empty list: all are)."""
    found = {name: shutil.which(name) or _sbin(name) for name in (*DAEMONS, *COMMANDS)}
    return [name for name, path in found.items() if path is None]


def _sbin(name: str) -> str | None:
    """Debian installs the daemons in /usr/sbin, which a non-login PATH may lack."""
    for folder in ("/usr/sbin", "/usr/local/sbin"):
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _binary(name: str) -> str:
    path = shutil.which(name) or _sbin(name)
    if path is None:
        raise FileNotFoundError(f"{name} is not installed (apt-get install slurmctld slurmd munge)")
    return path


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now."""
    chosen: list[int] = []
    while len(chosen) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in chosen:
            chosen.append(port)
    return chosen


@attrs.frozen(kw_only=True)
class Slurm:
    """A running single-node cluster: its configuration, node, partition and daemons."""

    root: Path
    conf: Path
    node: str
    partition: str
    cpus: int
    processes: tuple[subprocess.Popen[bytes], ...] = attrs.field(repr=False)

    def env(self) -> dict[str, str]:
        """The variables a Slurm command (and a job it submits) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def logs(self) -> list[Path]:
        return sorted((self.root / "log").glob("*.log"))


def _conf_text(root: Path, node: str, cpus: int, ports: list[int]) -> str:
    controller, daemon = ports
    return "\n".join(
        [
            "ClusterName=buildtrain-test",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={controller}",
            f"SlurmdPort={daemon}",
            "SlurmUser=root" if os.geteuid() == 0 else f"SlurmUser={_user()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'},cred_expire={CRED_EXPIRE_S}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            f"KillWait={KILL_WAIT_S}",
            "SchedulerType=sched/backfill",
            # A job whose begin time passes (a requeued one) waits for the scheduler's next pass:
            # by default 60 s (30 s for backfill), most of a requeue test's time.
            "SchedulerParameters=sched_interval=2,bf_interval=1",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _start_munge(root: Path, logs: Path) -> subprocess.Popen[bytes]:
    """A fresh key (munged insists it is private) and munged on a socket of its own."""
    keys = root / "munge-key"
    keys.mkdir(mode=0o700)
    key = keys / "munge.key"
    subprocess.run([_binary("mungekey"), "--create", "--keyfile", str(key)], check=True, capture_output=True)
    sockets = root / "munge"
    sockets.mkdir(mode=0o755)  # clients need to reach the socket through it
    command = [
        _binary("munged"),
        "--foreground",
        "--force",  # it would refuse to run as root, or with a key outside /etc/munge
        f"--socket={sockets / 'munge.socket'}",
        f"--key-file={key}",
        f"--pid-file={sockets / 'munged.pid'}",
        f"--seed-file={keys / 'seed'}",
        f"--log-file={logs / 'munged.log'}",
    ]
    return _popen(command, logs / "munged.out", root)


def _popen(
    command: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "wb") as handle:
        return subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )


def _wait_idle(cluster: Slurm, deadline: float) -> None:
    """Until `sinfo` reports the node idle (slurmd registered with the controller)."""
    last = "no answer"
    while time.monotonic() < deadline:
        for process in cluster.processes:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{Path(str(process.args[0])).name} exited with {process.returncode}; logs: {cluster.root / 'log'}"
                )
        done = subprocess.run(
            ["sinfo", "--noheader", "--nodes", cluster.node, "--format", "%T"],
            env={**os.environ, **cluster.env()},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        last = (done.stdout + done.stderr).strip() or "no answer"
        if done.returncode == 0 and last == "idle":
            return
        time.sleep(0.3)
    raise RuntimeError(
        f"Slurm node not idle after {READY_TIMEOUT_S:.0f} s ({last}); logs: {cluster.root / 'log'}"
    )


def start(root: Path) -> Slurm:
    """munged, slurmctld and slurmd with everything under `root`; returns once the node is idle."""
    missing = missing_binaries()
    if missing:
        raise FileNotFoundError(
            f"not installed: {', '.join(missing)} (apt-get install slurmctld slurmd munge)"
        )
    logs = root / "log"
    for folder in (logs, root / "state", root / "spool"):
        folder.mkdir(parents=True)
    node = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    conf = root / "slurm.conf"
    conf.write_text(_conf_text(root, node, cpus, free_ports(2)), encoding="utf-8")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    processes: list[subprocess.Popen[bytes]] = []
    cluster = Slurm(root=root, conf=conf, node=node, partition=PARTITION, cpus=cpus, processes=())
    try:
        processes.append(_start_munge(root, logs))
        _wait_for(root / "munge" / "munge.socket", processes[0], logs)
        # -D: in the foreground, so the pid is the daemon's; -i: no state from an earlier run.
        processes.append(_popen([_binary("slurmctld"), "-D", "-i"], logs / "slurmctld.log", root, env))
        processes.append(_popen([_binary("slurmd"), "-D", "-N", node], logs / "slurmd.log", root, env))
        cluster = attrs.evolve(cluster, processes=tuple(processes))
        _wait_idle(cluster, time.monotonic() + READY_TIMEOUT_S)
    except BaseException:
        stop(attrs.evolve(cluster, processes=tuple(processes)))
        raise
    return cluster


def _wait_for(path: Path, process: subprocess.Popen[bytes], logs: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"munged did not create {path}; logs: {logs}")
        time.sleep(0.05)


def _cancel_jobs(cluster: Slurm) -> None:
    """Cancel whatever jobs remain and wait until none runs: their processes (slurmstepd and its
    tasks) are not the daemons' children, so stopping the daemons would leave them behind."""
    env = {**os.environ, **cluster.env()}
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        subprocess.run(
            ["scancel", "--full", "--partition", cluster.partition], env=env, timeout=30, check=False
        )
        deadline = time.monotonic() + KILL_WAIT_S + STOP_GRACE_S
        while time.monotonic() < deadline:
            queued = subprocess.run(
                ["squeue", "--noheader", "--format", "%i"],
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
            )
            if queued.returncode != 0 or not queued.stdout.strip():
                return
            time.sleep(0.3)


def stop(cluster: Slurm) -> None:
    """Cancel the remaining jobs, then stop slurmd, slurmctld and munged (in that order), each by
    its pid: SIGTERM, a grace, then SIGKILL."""
    if all(process.poll() is None for process in cluster.processes) and len(cluster.processes) == len(
        DAEMONS
    ):
        _cancel_jobs(cluster)
    for process in reversed(cluster.processes):
        stop_by_pid(process, STOP_GRACE_S)


@contextlib.contextmanager
def running(root: Path) -> Iterator[Slurm]:
    """A Slurm cluster for the duration of the block, always stopped by pid at its end."""
    cluster = start(root)
    try:
        yield cluster
    finally:
        stop(cluster)
