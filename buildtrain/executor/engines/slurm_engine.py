"""The Slurm engine (`bt run --executor slurm`): each step is one Slurm job, submitted through
submitit, its ranks the job's tasks.

Where a job runs (partition, account, time limit, GPUs per node) comes from `--slurm-*` options or
`BT_SLURM_*` variables, never from the preset and never into a hash. The nodes must see the
run's store at the same path (a shared folder): the job's worker writes the output there, and the
job's own files (submitit's, the events, the outcome) live in the store's tmp/slurm/.

`bt run` follows a job through `scontrol show job` and the events file its worker appends to; a
job ends only in one of Slurm's final states, and its step's outcome counts only when rank 0
wrote it in the job's last run (a requeued job runs again under the same id): that is
`executor/engines/slurm_jobs.py`; this module submits, and turns a refused submission into one line
naming the fix. Nothing here imports submitit until a step is submitted, so a null build never
loads it or asks Slurm anything.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import EngineUnavailable, UsageError
from buildtrain.executor.engines.engine import (
    EngineOptions,
    OnEvent,
    Resources,
    Submission,
    environment_of,
    job_of,
    resources_of,
)
from buildtrain.executor.engines.slurm_jobs import SlurmHandle, check_controller, first_line
from buildtrain.executor.engines.slurm_task import StepTask, machine_of_node
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
# Numbers the job files this process writes (see `SlurmEngine.start`).
_SUBMITTED = itertools.count()
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
        line = first_line(said).removeprefix("sbatch: error: ")
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
                f"{first_line(str(exc))}; its log: {job.paths.stderr}"
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
