"""What runs inside a step's Slurm job: one task per rank, each starting the step's worker fresh.

submitit starts `StepTask` in every task of the job (`srun`, one per rank). The task process has
not imported torch and never does: it starts `python -m buildtrain.executor.process.worker` under the
step's numerics environment, exactly as `spawn` does on this machine, with the rendezvous taken
from Slurm's environment (rank = SLURM_PROCID, world = SLURM_NTASKS, the job's first node hosts
it). The worker's JSON events go to a file per rank beside the job's files, where `bt run` reads
them as they are written; rank 0 writes how the step ended (`TaskOutcome`) last, atomically.

Requeue (a preempted or timed-out job, or `scontrol requeue`): Slurm sends SIGTERM to every
process of the job; the worker finishes its update, checkpoints and exits 3, and the job runs
again from the start with the same id, where the worker resumes from that newest checkpoint. The
timeout warning (submitit's `--signal USR2@N`) reaches `checkpoint` below, which stops the worker
the same way before submitit requeues the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from buildtrain.executor.engines.on_node import REFUSED, toolchain_problem
from buildtrain.executor.process.job import Job
from buildtrain.plan.stored import load_plan
from buildtrain.plan.toolchain import Machine
from buildtrain.store.store import Store

# The step's worker, while it runs in this task process (one per process).
RUNNING: list[subprocess.Popen[bytes]] = []
# A port for the job's rendezvous, the same on every rank without talking: from the job id.
RENDEZVOUS_PORT_BASE = 20000
RENDEZVOUS_PORT_SPAN = 20000


@attrs.frozen(kw_only=True)
class TaskOutcome:
    """How rank 0's worker ended in one run of the job (`restarts`: Slurm's count before it)."""

    status: int
    restarts: int
    node: str
    refused: str | None = None  # why the node did not start the step (status REFUSED)

    def write(self, path: Path) -> None:
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(attrs.asdict(self), sort_keys=True), encoding="utf-8")
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)

    @classmethod
    def read(cls, path: Path) -> TaskOutcome | None:
        """The outcome at `path`, or None where there is none or it is not one (never trusted)."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            refused = raw.get("refused")
            return cls(
                status=int(raw["status"]),
                restarts=int(raw["restarts"]),
                node=str(raw["node"]),
                refused=None if refused is None else str(refused),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


def events_path(folder: Path, job_id: str, rank: int) -> Path:
    return folder / f"{job_id}_{rank}_events.jsonl"


def outcome_path(folder: Path, job_id: str) -> Path:
    return folder / f"{job_id}_outcome.json"


def rendezvous(slurm: Mapping[str, str], first_node: str) -> dict[str, str]:
    """torch.distributed's variables for this task, from Slurm's."""
    ranks = int(slurm.get("SLURM_NTASKS", "1"))
    job = int(slurm.get("SLURM_JOB_ID", "0"))
    variables = {
        "RANK": slurm.get("SLURM_PROCID", "0"),
        "WORLD_SIZE": str(ranks),
        "LOCAL_RANK": slurm.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": slurm.get("SLURM_NTASKS_PER_NODE", str(ranks)).split("(")[0],
        "MASTER_ADDR": first_node,
        "MASTER_PORT": str(RENDEZVOUS_PORT_BASE + job % RENDEZVOUS_PORT_SPAN),
    }
    if int(slurm.get("SLURM_JOB_NUM_NODES", "1")) == 1:  # one node: the ranks meet over loopback
        variables["GLOO_SOCKET_IFNAME"] = "lo"
        variables["MASTER_ADDR"] = "127.0.0.1"
    return variables


def machine_of_node(device: str) -> Machine:
    """The toolchain probe's job (`bt plan --executor slurm`): this node's facts."""
    return Machine.here(cuda=device == "cuda")


def _ignore_timeout_warning() -> None:
    """In the worker, before exec: the job's USR2 (submitit's warning of the time limit) is for
    the task process, which stops the worker by SIGTERM; USR2's default would kill it outright."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


@attrs.frozen(kw_only=True)
class StepTask:
    """The callable submitit runs in each task: the worker for `job_file` under `environment`."""

    job_file: str  # the worker's job (buildtrain.executor.process.job.Job), in the store's tmp/
    environment: Mapping[str, str]  # the numerics environment, applied before torch is imported
    folder: str  # the job's files: submitit's, the events and the outcome

    def __call__(self) -> int:
        import submitit

        job = submitit.JobEnvironment()
        rank = job.global_rank
        env = {**os.environ, **self.environment}
        if job.num_tasks > 1:
            env.update(rendezvous(os.environ, job.hostnames[0]))
        folder = Path(self.folder)
        node = socket.gethostname()
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        refused = self._toolchain_problem(job.num_tasks, node)
        if refused is not None:  # never used silently: the step does not start here
            if rank == 0:
                outcome = TaskOutcome(status=REFUSED, restarts=restarts, node=node, refused=refused)
                outcome.write(outcome_path(folder, job.job_id))
            return REFUSED
        with open(events_path(folder, job.job_id, rank), "a", encoding="utf-8") as events:
            events.write(json.dumps({"event": "slurm_task_started", "node": node, "rank": rank}) + "\n")
            events.flush()
            command = [sys.executable, "-m", "buildtrain.executor.process.worker", "--job", self.job_file]
            process = subprocess.Popen(
                [*command, "--events-fd", str(events.fileno())],
                env=env,
                pass_fds=(events.fileno(),),
                preexec_fn=_ignore_timeout_warning,
            )
            RUNNING.append(process)
            status = process.wait()
        if rank == 0:
            TaskOutcome(status=status, restarts=restarts, node=node).write(outcome_path(folder, job.job_id))
        return status

    def _toolchain_problem(self, world_size: int, node: str) -> str | None:
        """The node's toolchain against the step's hash, as on any engine's node (`on_node`)."""
        job = Job.read(Path(self.job_file))
        store = Store(Path(job.store))
        plan = load_plan(store, job.plan)
        return toolchain_problem(plan, plan.step(job.step), job.numerics.threads, world_size, node)

    def checkpoint(self) -> Any:
        """submitit's hook on the job's USR2 (the time limit is near, or the job is preempted):
        stop the worker as an interruption (it checkpoints), then have the job requeued."""
        import submitit

        for process in RUNNING:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            # Not process.wait(): this handler runs on top of `__call__`'s wait, which holds the
            # Popen's lock (a wait here deadlocked). waitid with WNOWAIT sees the exit and leaves
            # the reaping to that wait.
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        return submitit.helpers.DelayedSubmission(self)
