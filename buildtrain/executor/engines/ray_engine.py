"""`bt run --executor ray`: each step a Ray task (a train step on N ranks: N tasks in a placement
group of N bundles), its process started on the node by `on_node.run_on_node`.

The cluster is the one `RAY_ADDRESS` names, as Ray itself reads it; with no address Ray starts a
local instance for this run (about 5 s here). Ray is imported, and the cluster contacted, only when
a step must be built: a null build never does. A task that dies with its worker (a node lost, a
killed process) is retried by Ray; with a remote the new attempt resumes from the newest
checkpoint the lost one pushed. Ranks meet at an address that a first task in the placement
group's bundle 0 picks (rank 0's node, a free port): the rendezvous goes through Ray. Finding
the cluster (the address checked, or a local instance) is `executor/engines/ray_cluster.py`'s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import threading
from typing import Any

import attrs

from buildtrain.errors import EngineUnavailable, ToolchainMismatch
from buildtrain.executor.engines.engine import (
    EngineOptions,
    OnEvent,
    Resources,
    Submission,
    environment_of,
    job_of,
    resources_of,
)
from buildtrain.executor.engines.on_node import REFUSED, NodeRequest, NodeResult, node_name, run_on_node
from buildtrain.executor.engines.ray_cluster import LocalInstance, probe
from buildtrain.executor.process.launch import RankFailure
from buildtrain.executor.process.outcome import Outcome
from buildtrain.plan.toolchain import Machine
from buildtrain.store.store import Store

# Attempts Ray makes after a task's worker died (a step on one rank; ranks fail together and
# `bt run` again resumes them). Each attempt resumes from the newest pushed checkpoint.
RETRIES = 2
# Seconds to wait for a placement group's bundles, and for a cancelled task to checkpoint and end.
PLACEMENT_TIMEOUT_S = 120
CANCEL_GRACE_S = 60


def _task(request: NodeRequest) -> NodeResult:
    """The body of a step's Ray task, on whichever node Ray placed it."""
    import ray

    return run_on_node(request, f"{node_name()}/{ray.get_runtime_context().get_node_id()[:8]}")


def _machine(device: str) -> Machine:
    """The body of the probe `bt plan --executor ray` sends: the worker's own toolchain facts."""
    return Machine.here(cuda=device == "cuda")


def _rendezvous() -> tuple[str, int]:
    """Rank 0's address: this node's IP and a port free on it (bundle 0 of the group)."""
    import ray

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return ray.util.get_node_ip_address(), port


@attrs.define
class RayHandle:
    """The tasks of one step (one per rank) and the placement group that holds them."""

    refs: list[Any]
    submission: Submission
    on_event: OnEvent
    group: Any = None
    node: str = ""
    cancelled: bool = False

    def state(self) -> str:
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return "finished" if len(done) == len(self.refs) else "running"

    def cancel(self) -> None:
        import ray

        self.cancelled = True
        for ref in self.refs:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        # The tasks stop their workers as an interruption: wait while they checkpoint.
        ray.wait(self.refs, num_returns=len(self.refs), timeout=CANCEL_GRACE_S)

    def wait(self) -> Outcome:
        """Each rank's result as it comes; a rank that failed (or was refused), or a lead rank that
        found the step built in its node's store, stops the others, which would otherwise wait for
        it at their first collective."""
        import ray

        results: list[NodeResult] = []
        pending = list(self.refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    result: NodeResult = ray.get(done[0])
                except (ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError):
                    if not self.cancelled:
                        raise
                    continue
                results.append(result)
                if (result.status != 0 or result.reused) and pending:
                    for ref in pending:
                        ray.cancel(ref, force=True)
                    ray.wait(pending, num_returns=len(pending), timeout=CANCEL_GRACE_S)
                    pending = []
        finally:
            if self.group is not None:
                ray.util.remove_placement_group(self.group)
        return self._outcome(results)

    def _outcome(self, results: list[NodeResult]) -> Outcome:
        world = len(self.refs)
        self.node = ", ".join(dict.fromkeys(r.node for r in results)) or "ray"
        for result in results:
            if result.status == REFUSED:
                raise ToolchainMismatch(f"{self.submission.step.label}: {result.refused}")
        errors: list[dict[str, Any]] = []
        for result in sorted(results, key=lambda r: r.rank):
            for line in result.events:
                if line.get("level") in ("error", "critical"):
                    errors.append(line)
                self.on_event(line)
        failed = [r for r in results if r.status != 0]
        reused = any(r.reused and r.status == 0 for r in results)
        if self.cancelled or (len(results) < world and not failed and not reused):
            return Outcome(3, errors, True, None, world)
        if not failed:
            return Outcome(0, errors, False, None, world)
        first = min(failed, key=lambda r: (r.status >= 0, r.rank))
        failure = RankFailure(first.rank, first.status) if world > 1 else None
        return Outcome(first.status, errors, any(r.interrupted for r in results), failure, world)


@attrs.define
class RayEngine:
    """A Ray cluster, connected to on the first step that must be built."""

    address: str | None = None
    name: str = "ray"
    concurrent: bool = True
    pushes_outputs: bool = True
    _connected: bool = False
    _instance: LocalInstance | None = None  # the Ray instance this run started (no RAY_ADDRESS)
    _lock: threading.Lock = attrs.Factory(threading.Lock)
    # Made once: steps start from several threads, and Ray 2.60's driver aborted ("Tried to
    # complete task that was not pending") when each made its own remote function of `_task`.
    _remote_functions: dict[str, Any] = attrs.Factory(dict)

    def start(self, submission: Submission, on_event: OnEvent) -> RayHandle:
        self._ray()  # connected on the first step that must be built: never for a null build
        resources = resources_of(submission)
        self._check_fits(resources, submission.step.label)
        job = job_of(submission, on_event).to_json()
        plan = submission.plan
        request = NodeRequest(
            plan_body=plan.canonical(),
            plan_hash=plan.hash,
            step_hash=submission.step.hash,
            job=job,
            env=environment_of(submission),
            store=str(submission.store.root),
            remote=str(submission.remote) if submission.remote is not None else None,
            min_attestations=submission.min_attestations,
            inputs=dict(submission.inputs),
            world_size=resources.ranks,
        )
        options = {"num_cpus": resources.cpus_per_rank, "num_gpus": resources.gpus_per_rank}
        task = self._remote_functions["task"]
        if resources.ranks == 1:
            return RayHandle(
                [task.options(**options, max_retries=RETRIES).remote(request)], submission, on_event
            )
        return self._start_ranks(task, request, resources, submission, on_event)

    def _start_ranks(
        self, task: Any, request: NodeRequest, resources: Resources, submission: Submission, on_event: OnEvent
    ) -> RayHandle:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {
            "CPU": resources.cpus_per_rank,
            **({"GPU": resources.gpus_per_rank} if resources.gpus_per_rank else {}),
        }
        group = placement_group([bundle] * resources.ranks, strategy="PACK")
        if not group.wait(PLACEMENT_TIMEOUT_S):
            ray.util.remove_placement_group(group)
            raise EngineUnavailable(
                f"{submission.step.label}: Ray could not place {resources.ranks} ranks of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S} s; free the cluster's resources or run with fewer ranks"
            )

        def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)

        rendezvous = self._remote_functions["rendezvous"].options(
            num_cpus=0, scheduling_strategy=in_bundle(0)
        )
        master = ray.get(rendezvous.remote())
        refs = [
            task.options(
                num_cpus=resources.cpus_per_rank,
                num_gpus=resources.gpus_per_rank,
                max_retries=0,
                scheduling_strategy=in_bundle(rank),
            ).remote(attrs.evolve(request, rank=rank, master=master))
            for rank in range(resources.ranks)
        ]
        return RayHandle(refs, submission, on_event, group=group)

    def _ray(self) -> Any:
        with self._lock:
            # Ray's driver otherwise answers SIGTERM itself (a stack dump, then death), before
            # this run can cancel its tasks and let them checkpoint.
            os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
            import ray

            if not self._connected:
                self._connect(ray)
            return ray

    def _connect(self, ray: Any) -> None:
        address = self.address
        if address in (None, "", "local"):
            self._instance = LocalInstance.start()
            address = self._instance.address
        elif address != "auto":
            probe(address)
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError) as exc:
            raise EngineUnavailable(
                f"RAY_ADDRESS={address}: Ray could not connect ({exc}); start the cluster or fix RAY_ADDRESS"
            ) from None
        self._connected = True
        self._remote_functions.update(
            task=ray.remote(_task), rendezvous=ray.remote(_rendezvous), machine=ray.remote(_machine)
        )

    def _check_fits(self, resources: Resources, label: str) -> None:
        """Refuse a step no node can hold, rather than leave it pending for ever."""
        import ray

        wanted = {"CPU": resources.cpus_per_rank, "GPU": resources.gpus_per_rank}
        room = 0
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            have = node.get("Resources", {})
            fits = (
                min(int(have.get(k, 0) // v) for k, v in wanted.items() if v) if any(wanted.values()) else 1
            )
            room += fits
        if room < resources.ranks:
            gpus = f" and {resources.gpus_per_rank} GPU" if resources.gpus_per_rank else ""
            raise EngineUnavailable(
                f"{label}: no node of the Ray cluster has {resources.cpus_per_rank} CPU{gpus} for each of "
                f"its {resources.ranks} rank(s) (room for {room}); add nodes, or run with fewer --threads or --nproc"
            )

    def worker_machine(self, device: str, store: Store) -> Machine:
        """Asked of one worker, in a task with what a step of `device` asks for: a cluster whose
        nodes differ is caught later, where a node refuses a step planned for another toolchain."""
        ray = self._ray()
        gpus = 1 if device == "cuda" else 0
        probe = self._remote_functions["machine"].options(num_cpus=1, num_gpus=gpus)
        ref = probe.remote(device)
        ready, _ = ray.wait([ref], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.cancel(ref, force=True)
            what = "a CPU and a GPU" if gpus else "a CPU"
            raise EngineUnavailable(
                f"--executor ray: no worker with {what} free answered within {PLACEMENT_TIMEOUT_S} s, to "
                "say what toolchain it plans for; free the cluster's resources, or add nodes"
            )
        machine: Machine = ray.get(ref)
        return machine

    def cluster(self) -> str:
        # Without RAY_ADDRESS the workers are a local instance's: this machine, whose toolchain
        # is part of the probe's key too.
        return f"ray {self.address or 'local instance'}"

    def close(self) -> None:
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False
        if self._instance is not None:
            self._instance.stop()
            self._instance = None


def open_engine(options: EngineOptions) -> RayEngine:
    try:
        found = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        raise EngineUnavailable(
            "--executor ray: the ray package is not installed; pip install 'buildtrain[ray]'"
        )
    return RayEngine(address=os.environ.get("RAY_ADDRESS") or None)
