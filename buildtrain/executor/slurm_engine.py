"""The Slurm engine (`bt run --executor slurm`): each step is one Slurm job, submitted through
submitit, its ranks the job's tasks.

Where a job runs (partition, account, time limit, GPUs per node) comes from `--slurm-*` options or
`BT_SLURM_*` variables, never from the preset and never into a hash. The nodes must see the
run's store at the same path (a shared folder): the job's worker writes the output there, and the
job's own files (submitit's, the events, the outcome) live in the store's tmp/slurm/.

`bt run` follows a job through `scontrol show job` and the events file its worker appends to; a
job ends only in one of Slurm's final states, and its step's outcome counts only when rank 0
wrote it in the job's last run (a requeued job runs again under the same id). Nothing here
imports submitit until a step is submitted, so a null build never loads it or asks Slurm
anything.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import EngineUnavailable, ExitCode, ToolchainMismatch, UsageError
from buildtrain.executor.engine import (
    EngineOptions,
    OnEvent,
    Resources,
    Submission,
    environment_of,
    job_of,
    resources_of,
)
from buildtrain.executor.on_node import REFUSED
from buildtrain.executor.outcome import Outcome
from buildtrain.executor.slurm_task import StepTask, TaskOutcome, events_path, machine_of_node, outcome_path
from buildtrain.plan.toolchain import Machine
from buildtrain.store.store import Store

# `--slurm-*` option (as the CLI names it in EngineOptions.settings) -> its variable.
VARIABLES: Mapping[str, str] = {
    "partition": "BT_SLURM_PARTITION",
    "account": "BT_SLURM_ACCOUNT",
    "time": "BT_SLURM_TIME",
    "gpus_per_node": "BT_SLURM_GPUS_PER_NODE",
}
DEFAULT_TIME_MIN = 60
# Seconds between two looks at a job (one `scontrol` call each); a step takes seconds at least.
POLL_S = 0.5
# Numbers the job files this process writes (see `SlurmEngine.start`).
_SUBMITTED = itertools.count()
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
INSTALL_HINT = "pip install 'buildtrain[slurm]'"


def _optional_count(text: str | None, option: str, minimum: int) -> int | None:
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise UsageError(f"{option}: must be a whole number >= {minimum} (got {text!r})")
    return value


@attrs.frozen(kw_only=True)
class SlurmSettings:
    """Where the jobs go; none of it is part of any hash."""

    partition: str | None = None
    account: str | None = None
    time_min: int = attrs.field(default=DEFAULT_TIME_MIN, validator=attrs.validators.ge(1))
    gpus_per_node: int | None = None

    @classmethod
    def from_options(cls, settings: Mapping[str, str], environ: Mapping[str, str]) -> SlurmSettings:
        """`--slurm-*` first, then `BT_SLURM_*`; a bad value names the option and the variable."""
        given = {
            key: settings.get(key) or environ.get(variable) or None for key, variable in VARIABLES.items()
        }

        def where(key: str) -> str:
            return f"--slurm-{key.replace('_', '-')} / {VARIABLES[key]}"

        time_min = _optional_count(given["time"], f"{where('time')} (minutes)", 1)
        return cls(
            partition=given["partition"],
            account=given["account"],
            time_min=DEFAULT_TIME_MIN if time_min is None else time_min,
            gpus_per_node=_optional_count(given["gpus_per_node"], where("gpus_per_node"), 0),
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


def _first_line(text: str) -> str:
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
        said = _first_line(done.stdout + "\n" + done.stderr)
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


class QuietThread:
    """Stands in for sys.stderr while one thread submits: submitit prints a refused sbatch's
    message there before it raises, and that message is said once, in the error. Every other
    thread's writes pass through, also later on: a run that took this object for its stderr while
    it stood in (a sweep's plans start at once) keeps printing."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.quiet: int | None = threading.get_ident()

    def write(self, text: str) -> int:
        if threading.get_ident() == self.quiet:
            return len(text)
        return int(self.stream.write(text))

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding: the stream's
        return getattr(self.stream, name)


# One submission at a time: sys.stderr is the process's.
SUBMITTING = threading.Lock()


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    with SUBMITTING:
        stand_in = QuietThread(sys.stderr)
        sys.stderr = stand_in
        try:
            yield
        finally:
            stand_in.quiet = None
            sys.stderr = stand_in.stream


@attrs.define
class SlurmEngine:
    """Submits each step as a Slurm job; see the module's docstring."""

    settings: SlurmSettings
    name: str = "slurm"
    concurrent: bool = True
    pushes_outputs: bool = False
    checked: bool = False

    def start(self, submission: Submission, on_event: OnEvent) -> SlurmHandle:
        submitit = self._submitit()
        step = submission.step
        resources = resources_of(submission)
        folder = submission.store.tmp / "slurm"
        folder.mkdir(parents=True, exist_ok=True)
        # One file per submission: one thread submits several jobs of one step at once (evaluation
        # beside training, a job per checkpoint), and a shared name handed each the last one's job.
        job_file = (
            folder / f"{step.hash[:16]}-{os.getpid()}-{threading.get_ident()}-{next(_SUBMITTED)}.job.json"
        )
        job_of(submission, on_event).write(job_file)
        executor = submitit.SlurmExecutor(folder=folder)
        executor.update_parameters(**self.parameters(step.label, resources))
        task = StepTask(job_file=str(job_file), environment=environment_of(submission), folder=str(folder))
        with quiet_stderr():
            try:
                job = executor.submit(task)
            except submitit.core.utils.FailedJobError as exc:
                job_file.unlink(missing_ok=True)
                raise self._refused(step.label, resources, str(exc)) from None
        on_event({"event": "slurm_job_submitted", "label": step.label, "job": job.job_id})
        files = [job_file, *_submission_links(folder, job)]
        return SlurmHandle(job.job_id, step.label, folder, resources.ranks, on_event, files)

    def parameters(self, label: str, resources: Resources) -> dict[str, Any]:
        """submitit's sbatch settings for one step: its ranks as tasks of one job on one node."""
        gpus = self.settings.gpus_per_node
        if gpus is None and resources.gpus_per_rank:
            gpus = resources.gpus_per_rank * resources.ranks
        chosen: dict[str, Any] = {
            "job_name": f"bt-{label}".replace(":", "-"),
            "partition": self.settings.partition,
            "account": self.settings.account,
            "time": self.settings.time_min,
            "nodes": 1,
            "ntasks_per_node": resources.ranks,
            "cpus_per_task": resources.cpus_per_rank,
            "gpus_per_node": gpus or None,
            # A preempted, timed-out or `scontrol requeue`d job goes back to the queue.
            "additional_parameters": {"requeue": True},
        }
        return {key: value for key, value in chosen.items() if value is not None}

    def _refused(self, label: str, resources: Resources, said: str) -> EngineUnavailable:
        line = _first_line(said).removeprefix("sbatch: error: ")
        asked = f"{resources.ranks} task(s) x {resources.cpus_per_rank} CPU(s)"
        if resources.gpus_per_rank or self.settings.gpus_per_node:
            asked += f", {self.settings.gpus_per_node or resources.gpus_per_rank * resources.ranks} GPU(s)"
        partition = self.settings.partition or "the default partition"
        return EngineUnavailable(
            f"--executor slurm: Slurm refused {label} ({asked} on one node of {partition}): {line}; "
            "choose another partition (--slurm-partition), fewer ranks (--nproc) or fewer threads (--threads)"
        )

    def worker_machine(self, device: str, store: Store) -> Machine:
        """Asked of a node in a job of its own, with what a step of `device` asks for (a GPU for
        a CUDA plan); its files are removed once it answered, kept (and named) where it failed."""
        submitit = self._submitit()
        folder = store.folder(store.tmp / "slurm")  # a new store is marked as one first
        executor = submitit.SlurmExecutor(folder=folder)
        resources = Resources(gpus_per_rank=1 if device == "cuda" else 0)
        executor.update_parameters(**self.parameters("probe", resources))
        with quiet_stderr():
            try:
                job = executor.submit(machine_of_node, device)
            except submitit.core.utils.FailedJobError as exc:
                raise self._refused("the toolchain probe", resources, str(exc)) from None
        handle = SlurmHandle(job.job_id, "the toolchain probe", folder, 1, lambda _: None, [])
        answered = job.paths.result_pickle.exists
        handle.follow(answered)
        try:
            # Only once the answer is there: submitit's own wait asks sacct, which a cluster
            # without accounting never answers.
            if not answered():
                raise RuntimeError(f"it ended {handle.seen.state} without an answer")
            machine: Machine = job.result()
        except Exception as exc:  # submitit re-raises whatever failed in the job
            raise EngineUnavailable(
                f"--executor slurm: the job that asks a node for its toolchain ({job.job_id}) failed: "
                f"{_first_line(str(exc))}; its log: {job.paths.stderr}"
            ) from None
        for path in [*_submission_links(folder, job), *folder.glob(f"{job.job_id}_*")]:
            path.unlink(missing_ok=True)
        return machine

    def _submitit(self) -> Any:
        """submitit, once the controller is known to answer."""
        submitit = _import_submitit()
        if not self.checked:
            check_controller()
            self.checked = True
        return submitit

    def cluster(self) -> str:
        """The controller's configuration and where the jobs go (a partition's nodes differ)."""
        where = os.environ.get("SLURM_CONF", "")
        return f"slurm {where} {json.dumps(attrs.asdict(self.settings), sort_keys=True)}"

    def close(self) -> None:
        """Nothing held: each step's job is followed, and ended, by its handle."""


def _submission_links(folder: Path, job: Any) -> list[Path]:
    """The links submitit leaves to the job's sbatch script, outside the job id's own names."""
    submitted = job.paths.submission_file
    return [p for p in folder.glob(".submission_file_*") if p.is_symlink() and p.readlink() == submitted]


def _import_submitit() -> Any:
    try:
        import submitit
    except ModuleNotFoundError:
        raise EngineUnavailable(
            f"--executor slurm needs submitit, which is not installed: {INSTALL_HINT}"
        ) from None
    return submitit


def open_engine(options: EngineOptions) -> SlurmEngine:
    return SlurmEngine(SlurmSettings.from_options(options.settings, os.environ))
