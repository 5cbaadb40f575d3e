"""One function per `bt` command that builds (`bt plan`, `bt run`, `bt verify`): parse nothing,
call the library, print its result, return an exit code; the store's upkeep is in `upkeep.py`,
the uses of built weights in `delivery.py`, the queries in `queries.py`. Heavy modules (the
executor, torch) are imported only by the commands that need them, so `bt plan` and a null
`bt run` stay instant."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.cli.common import err, store_of
from buildtrain.errors import ExitCode, Interrupted, UsageError
from buildtrain.executor.process.launch import DEFAULT_RDZV_TIMEOUT
from buildtrain.plan.stored import load_plan
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.executor.engines.engine import Engine
    from buildtrain.executor.engines.probes import WorkerProbes
    from buildtrain.executor.loop.run import RunOptions
    from buildtrain.executor.process.launch import Launch
    from buildtrain.plan.plan import Plan
    from buildtrain.plan.refs import Target


def experiments(args: argparse.Namespace) -> Path:
    return Path(args.experiments or os.environ.get("BT_EXPERIMENTS") or "experiments")


def _launch(args: argparse.Namespace) -> Launch:
    from buildtrain.executor.process.launch import Launch

    endpoint = getattr(args, "rdzv_endpoint", None)
    if endpoint and args.nnodes > 1:
        _check_resolves(endpoint)
    return Launch(
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=getattr(args, "node_rank", 0),
        rdzv_endpoint=getattr(args, "rdzv_endpoint", None),
        rdzv_timeout=getattr(args, "rdzv_timeout", DEFAULT_RDZV_TIMEOUT),
    )


def _check_resolves(endpoint: str) -> None:
    """A host name that does not resolve would only surface as torchrun's timeout, minutes later."""
    import socket

    host, _, port = endpoint.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UsageError(
            f"--rdzv-endpoint {endpoint}: cannot resolve {host!r} ({exc}); give node 0's address"
        ) from None


def _parse_steps(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        steps = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise UsageError(f"--resume-at expects step numbers like 50,120 (got {text!r})") from None
    if any(step < 1 for step in steps):
        raise UsageError("--resume-at steps must be >= 1")
    return steps


def cmd_plan(args: argparse.Namespace) -> int:
    from buildtrain.plan.sweep import SweepPlans, plan_sweep
    from buildtrain.views.text import plan_summary

    store = store_of(args)
    with engine_of(args) as engine:
        workers = worker_probe(engine, store, fresh=True)
        planned = plan_sweep(args.preset, args.set, args.sweep, store, args.nproc * args.nnodes, workers)
    if isinstance(planned, SweepPlans):  # one hash per point on stdout; what they share on stderr
        from buildtrain.views.sweep import sweep_summary

        print("\n".join(point.planned.plan.hash for point in planned.points), flush=True)
        if not args.quiet:
            err(sweep_summary(store, planned))
        return ExitCode.OK
    print(planned.plan.hash, flush=True)
    if not args.quiet:
        err(plan_summary(store, planned.plan))
    return ExitCode.OK


def cmd_run(args: argparse.Namespace) -> int:
    from buildtrain.executor.loop.run import run_plan
    from buildtrain.plan.refs import resolve_targets
    from buildtrain.views.results import suites_text

    store = store_of(args)
    launch = _launch(args)
    warn_threads(args)
    from buildtrain.cli.team import fetch_plans, remote_hint, remote_of

    url = remote_of(args)
    if url is not None:  # a plan hash planned elsewhere comes with its steps
        fetch_plans(args.plan, store, url)

    def options_for(threads: int) -> RunOptions:
        return _run_options(args, args.threads or threads or None, launch)

    with engine_of(args) as engine:  # one engine plans (a preset, for its workers) and runs
        workers = worker_probe(engine, store, quiet=args.quiet)
        with remote_hint(url):
            targets = resolve_targets(
                args.plan, store, args.set, args.sweep, launch.world_size, workers=workers
            )
            # Planned from the workers' kept answer: good for a null build; before a step is
            # built they are asked again, and plans made for what they answer now.
            if workers is not None and workers.kept and not _built(store, targets) and workers.confirm():
                targets = resolve_targets(
                    args.plan, store, args.set, args.sweep, launch.world_size, workers=workers
                )
        if len(targets) == 1:
            code = run_plan(store, targets[0].plan, options_for(targets[0].threads), engine=engine)
            if text := suites_text(store, targets[0].plan):  # scores where a person looks
                err(text)
            return code
        from buildtrain.executor.loop.batch import run_plans
        from buildtrain.views.sweep import batch_text

        summary = run_plans(store, [(t.plan, options_for(t.threads)) for t in targets], engine=engine)
    err(batch_text(summary))
    return summary.code


@contextlib.contextmanager
def engine_of(args: argparse.Namespace) -> Iterator[Engine | None]:
    """The engine `--executor` (or BT_EXECUTOR) names, opened for this command and closed after it;
    None for the local executor, which each run opens itself. Opening connects to nothing: an
    engine reaches its cluster on the first step it must build, or the first probe."""
    given = getattr(args, "executor", None)
    if not (given or os.environ.get("BT_EXECUTOR")):  # `bt plan` loads nothing of the executor
        yield None
        return
    from buildtrain.cli.arguments import engine_settings
    from buildtrain.executor.engines.engine import DEFAULT_ENGINE, EngineOptions, engine_name, open_engine

    name = engine_name(given)
    if name == DEFAULT_ENGINE:
        yield None
        return
    engine = open_engine(EngineOptions(name=name, settings=engine_settings(args)))
    try:
        yield engine
    finally:
        engine.close()


def worker_probe(
    engine: Engine | None, store: Store, *, fresh: bool = False, quiet: bool = False
) -> WorkerProbes | None:
    """What a preset is planned for: the machine of `engine`'s workers (asked once per device,
    only when a preset is planned; kept in the store unless `fresh`), else this machine (None)."""
    if engine is None:
        return None
    from buildtrain.executor.engines.probes import WorkerProbes

    return WorkerProbes(engine=engine, store=store, say=(lambda _: None) if quiet else err, fresh=fresh)


def _built(store: Store, targets: list[Target]) -> bool:
    """Whether every step of every target is in the store (a null build, but for damage)."""
    return all(store.outputs.has(step.hash) for target in targets for step in target.plan.steps)


def _run_options(args: argparse.Namespace, threads: int | None, launch: Launch) -> RunOptions:
    from buildtrain.cli.arguments import engine_settings
    from buildtrain.cli.team import min_attestations, remote_of
    from buildtrain.executor.engines.engine import EngineOptions, engine_name
    from buildtrain.executor.loop.run import RunOptions

    return RunOptions(
        threads=threads,
        experiments=experiments(args),
        wait=not args.no_wait,
        progress=None if args.progress == "auto" else args.progress == "on",
        log_every=args.log_every,
        quiet=args.quiet,
        target=args.target,
        launch=launch,
        remote=remote_of(args),
        min_attestations=min_attestations(args),
        executor=EngineOptions(
            name=engine_name(getattr(args, "executor", None)), settings=engine_settings(args)
        ),
    )


def warn_threads(args: argparse.Namespace) -> None:
    """More threads than cores is allowed (a plan may be checked at a thread count), but rarely meant."""
    cores = os.cpu_count() or 1
    if args.threads and args.threads > cores:
        err(
            f"bt {args.command}: warning: --threads {args.threads} is more than this machine's {cores} "
            "cores; the threads will take turns on them (slower, not faster)"
        )


def cmd_verify(args: argparse.Namespace) -> int:
    import json

    from buildtrain.verify.verify import VerifyOptions, verify_plan
    from buildtrain.views.text import verdict_line, verification_summary

    store = store_of(args)
    warn_threads(args)
    plan = one_plan(args, store)
    options = VerifyOptions(
        resume_at=_parse_steps(args.resume_at),
        threads=args.threads,
        steps=args.steps,
        keep=args.keep_scratch,
        experiments=experiments(args),
        launch=_launch(args),
    )
    built = all(store.outputs.has(step.hash) for step in plan.steps)
    if args.push:  # a bad or missing remote is refused before the re-execution, not after it
        from buildtrain.cli.team import remote_of

        remote_of(args, required=True)
    try:
        verification = verify_plan(
            store, plan, options, notify=err, on_verdict=lambda verdict: err(verdict_line(verdict))
        )
    except Interrupted:
        if not built:  # it was building the plan first: bt run resumes that build
            raise
        # Only the scratch re-execution stopped: `bt run` has nothing to do for a built plan.
        raise Interrupted(
            f"interrupted; the recorded build of {plan.hash[:12]} is untouched; "
            f"check it again with: bt verify {plan.hash[:12]}"
        ) from None
    for line in verification_summary(verification):
        err(line)
    if args.push:
        _attest(args, store, plan, verification)
    if args.json:
        print(json.dumps(verification.as_json(), indent=2))
    return verification.exit_code


def _attest(args: argparse.Namespace, store: Store, plan: Plan, verification: Any) -> None:
    """`bt verify --push`: attest on the remote each step this verification reproduced."""
    from buildtrain.cli.team import remote_of
    from buildtrain.executor.remote.transfer import attest_plan

    url = remote_of(args, required=True)
    assert url is not None
    reproduced = [verdict.label for verdict in verification.with_status("reproduced")]
    for line in attest_plan(store, plan, url, reproduced):
        err(line)


def one_plan(args: argparse.Namespace, store: Store) -> Plan:
    """The one plan `args.plan` names: a hash or prefix, or a preset path (planned, as `bt run` does)."""
    return plan_named(store, args.plan, getattr(args, "nproc", 1) * getattr(args, "nnodes", 1))


def plan_named(store: Store, ref: str, world_size: int = 1) -> Plan:
    """The one plan `ref` names: a hash or prefix, or a preset path (planned, as `bt run` does)."""
    from buildtrain.plan.refs import is_preset, resolve_targets

    if not is_preset(ref):
        return load_plan(store, ref)
    targets = resolve_targets([ref], store, world_size=world_size)
    if len(targets) != 1:
        raise UsageError(
            f"{ref} is a sweep of {len(targets)} plans; give one of their hashes (bt plan {ref})"
        )
    return targets[0].plan
