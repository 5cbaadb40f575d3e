"""A submitted Slurm job, followed (`bt run --executor slurm`): the controller asked through
`scontrol`, the events the job's ranks append to forwarded line by line, requeues noted, and the
step's outcome read from rank 0's file of the job's last run. Submitting is
`executor/engines/slurm_engine.py`'s; nothing here imports submitit, so following a job never loads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import EngineUnavailable, ExitCode, ToolchainMismatch
from buildtrain.executor.engines.engine import OnEvent
from buildtrain.executor.engines.on_node import REFUSED
from buildtrain.executor.engines.slurm_task import TaskOutcome, events_path, outcome_path
from buildtrain.executor.process.outcome import Outcome

# Seconds between two looks at a job (one `scontrol` call each); a step takes seconds at least.
POLL_S = 0.5
# How long `bt run` keeps asking a controller that stopped answering before it gives up.
CONTROLLER_GRACE_S = 60.0
PING_TIMEOUT_S = 30.0
# Why a job waits that no wait will cure: the partition, an association or a QOS cannot hold it.
NEVER_RUNS = frozenset(
    {
        "PartitionConfig",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "BadConstraints",
        "InvalidAccount",
        "InvalidQOS",
    }
)
# Slurm's states after which a job does not run again (a requeued one is PENDING once more).
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }
)


@attrs.frozen
class JobInfo:
    """One look at a job through `scontrol show job`."""

    state: str  # Slurm's JobState; "GONE" once the controller forgot the job
    restarts: int
    node: str
    reason: str

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES or self.state == "GONE"


def _slurm(command: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def job_info(job_id: str) -> JobInfo | None:
    """The job as the controller sees it; None where the controller did not answer."""
    try:
        done = _slurm(["scontrol", "show", "job", "--oneliner", job_id], timeout=PING_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return JobInfo("GONE", -1, "", "the controller no longer knows the job")
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    node = fields.get("NodeList", "")
    return JobInfo(
        state=fields.get("JobState", "UNKNOWN"),
        restarts=int(fields.get("Restarts", "0") or 0),
        node="" if node == "(null)" else node,
        reason=fields.get("Reason", ""),
    )


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else "no message"


def check_controller() -> None:
    """One line naming the fix where Slurm's commands are missing or no controller answers."""
    missing = [name for name in ("sbatch", "srun", "scontrol", "scancel") if shutil.which(name) is None]
    if missing:
        raise EngineUnavailable(
            f"--executor slurm: Slurm's commands are not on PATH ({', '.join(missing)}); run bt on a "
            "Slurm login node, or install Slurm's client commands"
        )
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():  # Slurm's commands would retry it for 60 s first
        raise EngineUnavailable(
            f"--executor slurm: SLURM_CONF names {conf}, which is not a file; point it at the cluster's slurm.conf"
        )
    try:
        done = _slurm(["scontrol", "ping"], timeout=PING_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess([], 1, "", f"no answer in {PING_TIMEOUT_S:.0f} s")
    if done.returncode != 0 or "UP" not in done.stdout:
        said = first_line(done.stdout + "\n" + done.stderr)
        where = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
        raise EngineUnavailable(
            f"--executor slurm: no Slurm controller answers ({said}); start slurmctld, or point "
            f"SLURM_CONF at the cluster's slurm.conf (now {where})"
        )


@attrs.define
class EventFiles:
    """The events the job's ranks append to, read as they grow, each line forwarded once."""

    paths: list[Path]
    offsets: dict[Path, int] = attrs.Factory(dict)
    partial: dict[Path, str] = attrs.Factory(dict)

    def forward(self, on_event: OnEvent, errors: list[dict[str, Any]]) -> None:
        for path in self.paths:
            try:
                with open(path, "rb") as handle:
                    handle.seek(self.offsets.get(path, 0))
                    chunk = handle.read()
            except FileNotFoundError:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(chunk)
            text = self.partial.pop(path, "") + chunk.decode("utf-8", errors="replace")
            *lines, rest = text.split("\n")
            if rest:  # a line still being written: completed by the next read
                self.partial[path] = rest
            for raw in lines:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if not isinstance(line, dict):
                    continue
                if line.get("level") in ("error", "critical"):
                    errors.append(line)
                on_event(line)


@attrs.define
class SlurmHandle:
    """A submitted step: its job, followed until Slurm says the job will not run again."""

    job_id: str
    label: str
    folder: Path
    ranks: int
    on_event: OnEvent
    files: list[Path]  # files of the job outside its id's names, removed with them on success
    seen: JobInfo = JobInfo("PENDING", 0, "", "")
    cancelled: bool = False

    @property
    def node(self) -> str:
        return self.seen.node

    def state(self) -> str:
        if self.seen.final:
            return "finished"
        return "running" if self.seen.state in ("RUNNING", "COMPLETING") else "pending"

    def wait(self) -> Outcome:
        events = EventFiles([events_path(self.folder, self.job_id, rank) for rank in range(self.ranks)])
        errors: list[dict[str, Any]] = []
        self.follow(lambda: events.forward(self.on_event, errors))
        events.forward(self.on_event, errors)
        return self._outcome(errors)

    def follow(self, between: Callable[[], object]) -> None:
        """Until Slurm says the job will not run again, calling `between` before each look (a
        true answer ends the wait early: the job left what was wanted of it)."""
        unanswered_since: float | None = None
        while True:
            if between():
                return
            info = job_info(self.job_id)
            if info is None:  # the controller did not answer: ask again, for a while
                unanswered_since = unanswered_since or time.monotonic()
                if time.monotonic() - unanswered_since > CONTROLLER_GRACE_S:
                    raise EngineUnavailable(
                        f"--executor slurm: the Slurm controller stopped answering while {self.label} "
                        f"ran as job {self.job_id}; check slurmctld, then bt run again (it resumes)"
                    )
            else:
                unanswered_since = None
                self._note(info)
                if info.final:
                    return
                if info.state == "PENDING" and (
                    info.reason in NEVER_RUNS or info.reason.endswith("PerJobLimit")
                ):
                    self.cancel()
                    raise EngineUnavailable(
                        f"--executor slurm: job {self.job_id} of {self.label} can never start ({info.reason}): no "
                        "node of the partition has what it asks for; choose another partition "
                        "(--slurm-partition), fewer ranks (--nproc) or fewer threads (--threads)"
                    )
            time.sleep(POLL_S)

    def _note(self, info: JobInfo) -> None:
        """Tell the terminal and the run record where the step runs, and of every requeue."""
        before = self.seen
        self.seen = info
        if info.restarts > before.restarts and info.state != "GONE":
            self.on_event(
                {
                    "event": "slurm_job_requeued",
                    "label": self.label,
                    "job": self.job_id,
                    "restarts": info.restarts,
                }
            )
        if info.state == "RUNNING" and (before.state != "RUNNING" or info.node != before.node):
            self.on_event(
                {"event": "slurm_job_running", "label": self.label, "job": self.job_id, "node": info.node}
            )

    def _outcome(self, errors: list[dict[str, Any]]) -> Outcome:
        """Rank 0's outcome from the job's last run; a job that ended without one failed."""
        written = TaskOutcome.read(outcome_path(self.folder, self.job_id))
        last_run = self.seen.restarts if self.seen.state != "GONE" else None
        if written is None or (last_run is not None and written.restarts != last_run):
            message = (
                f"Slurm job {self.job_id} ended {self.seen.state} ({self.seen.reason or 'no reason given'}) "
                f"before {self.label} finished; its log: {self.folder / f'{self.job_id}_0_log.err'}"
            )
            errors = [*errors, {"event": "slurm_job_failed", "level": "error", "message": message}]
            status = ExitCode.INTERRUPTED if self.cancelled else ExitCode.FAILED
            return Outcome(int(status), errors, self.cancelled, None, self.ranks)
        if written.status == REFUSED:
            raise ToolchainMismatch(f"{self.label}: {written.refused}")
        if written.status == ExitCode.OK:  # a failed job's files stay: its logs say why
            for path in [*self.files, *self.folder.glob(f"{self.job_id}_*")]:
                path.unlink(missing_ok=True)
        return Outcome(written.status, errors, self.cancelled, None, self.ranks)

    def cancel(self) -> None:
        """scancel: Slurm sends the job SIGTERM (the worker checkpoints), SIGKILL after KillWait."""
        self.cancelled = True
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _slurm(["scancel", self.job_id], timeout=30)
