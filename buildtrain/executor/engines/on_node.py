"""A step's process on a cluster node, whatever engine placed it there (a Ray task, a Slurm job).

`run_on_node` runs inside the engine's process on the node and starts the ordinary worker
(`python -m buildtrain.executor.process.worker`) as a fresh child, with the numerics environment set
before torch loads, exactly as `bt run` does locally. Before that it refuses a node whose toolchain
is not the one in the step's hash (never used silently). Where does the step read and write?

- With a remote (the team cache): in a store of the node's own (`BT_NODE_STORE`, default
  `<tmp>/bt-node-store`): the inputs are pulled from the remote (every byte checked), a train step
  starts from the newest checkpoint on the remote and pushes each new one while it runs (so a node
  that dies loses at most the updates since), and the output is pushed at the end.
- Without one: in the run's own store, which the node must see at the same path (a local Ray
  instance, or a shared file system); a node that does not is refused with the fix.

Everything crossing to the node is plain data (`NodeRequest`), and what comes back is too
(`NodeResult`): the worker's JSON events, its exit status, the node's name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import BuildtrainError, ExitCode
from buildtrain.executor.process.job import Job
from buildtrain.executor.process.launch import PARENT_PID
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.stored import load_plan
from buildtrain.plan.toolchain import differences
from buildtrain.store import objects
from buildtrain.store.store import Store

NODE_PUSHED = "node_pushed"  # the event naming the build (manifest digest) a node pushed
NODE_STORE = "BT_NODE_STORE"  # where a node keeps the steps it builds and the inputs it pulled
REFUSED = -1000  # NodeResult.status of a node that did not start the step (see `refused`)


@attrs.frozen(kw_only=True)
class NodeRequest:
    """What a node needs to build one step (or one rank of it): plain, picklable data."""

    plan_body: bytes  # the plan's canonical bytes (checked against its hash on the node)
    plan_hash: str
    step_hash: str
    job: str  # the job file's JSON, as `job_of` made it for the run's store
    env: Mapping[str, str]  # the numerics environment
    store: str  # the run's store (used where there is no remote)
    remote: str | None = None  # the team cache's URL
    # The run's requirement of trusted signers (`--min-attestations`): a node never resumes from
    # the remote's checkpoints under one, as a local run does not.
    min_attestations: int = 0
    # Each input's manifest digest in the run's store: a node pulls exactly the builds its run
    # holds (pulled under the run's requirement, or built by the run), and no other.
    inputs: Mapping[str, str] = attrs.field(factory=dict)
    rank: int = 0
    world_size: int = 1
    master: tuple[str, int] | None = None  # rank 0's address for torch.distributed


@attrs.frozen(kw_only=True)
class NodeResult:
    node: str
    status: int  # the worker's exit status; REFUSED: not started (`refused` says why)
    events: tuple[dict[str, Any], ...] = ()
    refused: str | None = None
    interrupted: bool = False
    rank: int = 0
    # The lead rank found the step already built in the node's store and only pushed it: no worker
    # started, so the other ranks wait for a partner that never comes (the engine stops them).
    reused: bool = False


def node_name() -> str:
    return os.environ.get("BT_MACHINE") or socket.gethostname()


def node_store_root() -> Path:
    return Path(os.environ.get(NODE_STORE) or Path(tempfile.gettempdir()) / "bt-node-store")


def run_on_node(request: NodeRequest, node: str | None = None) -> NodeResult:
    """Build the requested step (or rank) here; never raises for the step: the result says."""
    node = node or node_name()
    try:
        store, plan, step = _open(request, node)
        threads = int(json.loads(request.job)["numerics"]["threads"])
        problem = toolchain_problem(plan, step, threads, request.world_size, node)
        if problem is not None:
            return NodeResult(node=node, status=REFUSED, refused=problem, rank=request.rank)
        return _build(request, store, plan, step, node)
    except _Refused as exc:
        return NodeResult(node=node, status=REFUSED, refused=str(exc), rank=request.rank)
    except BuildtrainError as exc:
        event = {"event": "node_failed", "level": "error", "message": f"node {node}: {exc}"}
        return NodeResult(node=node, status=int(exc.exit_code), events=(event,), rank=request.rank)


class _Refused(Exception):
    """This node cannot build the step (it does not see the store)."""


def _open(request: NodeRequest, node: str) -> tuple[Store, Plan, Step]:
    if request.remote is None:
        store = Store(Path(request.store))
        if not store.plans.path(request.plan_hash).is_file():
            raise _Refused(
                f"node {node} does not see the store {request.store} (no remote was given): give "
                "bt run --remote URL (or BT_REMOTE), a team cache every node reaches"
            )
    else:
        store = Store(node_store_root())
        store.plans.save(request.plan_hash, request.plan_body)
    plan = load_plan(store, request.plan_hash)
    return store, plan, plan.step(request.step_hash)


def toolchain_problem(plan: Plan, step: Step, threads: int, world_size: int, node: str) -> str | None:
    """Why this node's toolchain is not the one the step's hash was planned for, if it is not."""
    here = kind_of(step.kind).toolchain(step.config, plan.numerics, world_size, threads)
    lines = differences(dict(step.toolchain), here)
    if not lines:
        return None
    return (
        f"node {node} has another toolchain than plan {plan.hash[:12]} was compiled for ({'; '.join(lines)}); "
        "plan for the workers with bt plan PRESET --executor ENGINE (it asks a worker), or run on nodes "
        "with the plan's toolchain"
    )


def _build(request: NodeRequest, store: Store, plan: Plan, step: Step, node: str) -> NodeResult:
    kind = kind_of(step.kind)
    lead = request.rank == 0
    events: list[dict[str, Any]] = []
    cache = _cache(request, events)
    if cache is not None:
        wanted = {n: h for n, h in step.upstream.items() if lead or n in kind.rank_inputs}
        for upstream in dict.fromkeys(wanted.values()):
            _pull_input(store, cache, plan.step(upstream), node, request.inputs.get(upstream))
    job = attrs.evolve(Job.from_json(request.job), store=str(store.root))
    env = {**os.environ, **request.env, **_rank_environment(request)}
    with contextlib.ExitStack() as held:
        lock_fd = -1
        if cache is not None and lead:  # in the run's own store the run holds the step's lock
            lock_fd = held.enter_context(store.locks.hold(step.hash))
            if store.outputs.has(step.hash) and not store.outputs.check(step.hash):
                return _push_built(store, cache, plan, step, node, events)  # built here before
            if kind.resumable:
                held.enter_context(cache.checkpoints(store, step))
        status, interrupted = _run_worker(store, job, env, lock_fd, events)
        if cache is not None and lead and kind.resumable:
            cache.push_newest_checkpoint(store, step)  # the one a stop (Ctrl-C) just wrote
    if status == ExitCode.OK and cache is not None and lead and job.options.commit:
        return _push_built(store, cache, plan, step, node, events, built_here=True)
    return NodeResult(
        node=node, status=status, events=tuple(events), interrupted=interrupted, rank=request.rank
    )


def _push_built(
    store: Store,
    cache: Any,
    plan: Plan,
    step: Step,
    node: str,
    events: list[dict[str, Any]],
    *,
    built_here: bool = False,
) -> NodeResult:
    """Push the step's output from the node's store (where it was just built, or had been)."""
    report = cache.push(store, plan, step, built_here=built_here)
    status = int(ExitCode.OK)
    manifest = objects.manifest_self((store.outputs.path(step.hash) / objects.MANIFEST).read_bytes())
    events.append({"event": NODE_PUSHED, "level": "info", "hash": step.hash, "manifest": manifest})
    if report.failed:
        message = f"node {node}: push to {cache.url}: {report.failed}"
        events.append({"event": "node_failed", "level": "error", "message": message})
        status = int(ExitCode.FAILED)
    elif report.conflict:
        events.append({"event": "remote_conflict", "level": "warning", "conflict": report.conflict})
    return NodeResult(node=node, status=status, events=tuple(events), reused=not built_here)


def _cache(request: NodeRequest, events: list[dict[str, Any]]) -> Any:
    """The node's side of the team cache (None without a remote); what it says becomes events."""
    if request.remote is None:
        return None
    from buildtrain.executor.remote.remote import RemoteCache
    from buildtrain.store.remote.url import parse_url

    def say(label: str, text: str) -> None:
        events.append({"event": "node_remote", "level": "info", "label": label, "message": text})

    return RemoteCache(parse_url(request.remote), say, request.min_attestations)


def _pull_input(store: Store, cache: Any, upstream: Step, node: str, pinned: str | None) -> None:
    """An input in the node's store: the build the run holds (`pinned`), kept from before or
    pulled; a build of it the node kept that the run does not hold is set aside."""
    with store.locks.hold(upstream.hash):
        if store.outputs.has(upstream.hash) and not store.outputs.check(upstream.hash):
            held = objects.manifest_self((store.outputs.path(upstream.hash) / objects.MANIFEST).read_bytes())
            if pinned is None or held == pinned:
                return
            store.outputs.quarantine(upstream.hash)
        if not cache.pull(store, upstream, pinned=pinned):
            raise _Refused(
                f"node {node}: input {upstream.label} is neither in its store nor on {cache.url}; "
                "the run pushes each step it builds there: run again"
            )


def _rank_environment(request: NodeRequest) -> dict[str, str]:
    """torch.distributed's rendezvous, as torchrun would set it, at the address the engine chose."""
    if request.world_size == 1:
        return {}
    assert request.master is not None
    address, port = request.master
    env = {
        "RANK": str(request.rank),
        "WORLD_SIZE": str(request.world_size),
        "LOCAL_RANK": "0",  # the engine gives each rank its own devices (CUDA_VISIBLE_DEVICES)
        "MASTER_ADDR": address,
        "MASTER_PORT": str(port),
    }
    if address in ("127.0.0.1", "localhost"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _run_worker(
    store: Store, job: Job, env: dict[str, str], lock_fd: int, events: list[dict[str, Any]]
) -> tuple[int, bool]:
    """The worker as a child of this process; (exit status, whether it was asked to stop). An
    interruption of this process (the engine cancelling it) reaches the worker as SIGTERM: it
    finishes its update, checkpoints and exits 3."""
    store.tmp.mkdir(parents=True, exist_ok=True)
    path = store.tmp / f"job-{job.step[:16]}-{os.getpid()}.json"
    job.write(path)
    read_fd, write_fd = os.pipe()
    env = {**env, PARENT_PID: str(os.getpid())}
    command = [
        sys.executable,
        "-m",
        "buildtrain.executor.process.worker",
        "--job",
        str(path),
        "--events-fd",
        str(write_fd),
    ]
    passed = (write_fd,) if lock_fd < 0 else (write_fd, lock_fd)
    process = subprocess.Popen(command, env=env, pass_fds=passed)
    os.close(write_fd)
    interrupted = False
    stream = os.fdopen(read_fd, encoding="utf-8", errors="replace")
    try:
        with _cancellable():
            while True:
                try:
                    events.extend(_lines(stream))
                    break
                except KeyboardInterrupt:  # the engine cancelled this task: stop the step as an
                    interrupted = True  # interruption, and keep reading what it says as it checkpoints
                    if process.poll() is None:
                        process.send_signal(signal.SIGTERM)
        status = process.wait()
    finally:
        stream.close()
        path.unlink(missing_ok=True)
    return status, interrupted or status == ExitCode.INTERRUPTED


@contextlib.contextmanager
def _cancellable() -> Iterator[None]:
    """While a step runs, SIGINT raises KeyboardInterrupt in this (the task's) thread. Ray cancels
    a running task through `_thread.interrupt_main`, which does nothing where SIGINT is ignored,
    and it is in every worker of a cluster started as `nohup ray start ... &` is: there, Ctrl-C
    of `bt run` waited for the step to end (seen in CI), and nothing was left to resume."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread takes signals; Ray runs tasks there
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _lines(stream: Any) -> Iterator[dict[str, Any]]:
    for raw in stream:
        try:
            yield json.loads(raw)
        except ValueError:
            continue
