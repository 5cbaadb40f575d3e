"""`bt`: a thin command line over buildtrain. Parse, call one function per command, print, map
errors to exit codes. Heavy modules (the executor, torch) are imported only by the commands
that need them, so `bt plan` and a null `bt run` stay instant.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from buildtrain.errors import BuildtrainError, ConfigError, ExitCode, UsageError
from buildtrain.executor.launch import DEFAULT_RDZV_TIMEOUT
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.executor.launch import Launch

# More processes per machine or machines than this is a typo, not a cluster.
MAX_PROCESSES = 1024
# Exit status after stdout was closed early (`bt show | head`): what a shell reports for SIGPIPE.
BROKEN_PIPE = 141

EPILOG = """\
exit codes:
  0  success                      4  not reproduced (bt verify found a difference)
  1  a step failed (NaN, OOM)     5  corrupt object in the store (bt fsck)
  2  usage or preset error        6  plan compiled for another toolchain or machine
  3  interrupted, resumable       7  step locked by another bt (with --no-wait)

examples:
  bt run $(bt plan presets/tiny.toml)
  bt plan presets/tiny.toml --set train.lr=3e-4 --set model.n_layers=6
  bt diff 3fa9c1 8e02d4
  bt verify 3fa9c1 --resume-at 50,120
  bt run 3fa9c1 --nproc 2                   (train on 2 processes through torchrun)
  bt verify 3fa9c1 --nproc 2                (re-execute at another world size and compare)
"""


def _store(args: argparse.Namespace) -> Store:
    return Store.at(args.store)


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _is_preset(ref: str) -> bool:
    return ref.endswith(".toml") or os.path.sep in ref or Path(ref).is_file()


def cmd_plan(args: argparse.Namespace) -> int:
    from buildtrain.plan.planner import plan_preset
    from buildtrain.report import plan_summary

    store = _store(args)
    planned = plan_preset(args.preset, args.set, store, args.nproc * args.nnodes)
    print(planned.plan.hash, flush=True)
    if not args.quiet:
        _err(plan_summary(store, planned.plan))
    return ExitCode.OK


def cmd_show(args: argparse.Namespace) -> int:
    from buildtrain.report import show_json, show_text

    store = _store(args)
    plan = store.load_plan(args.plan)
    print(show_json(store, plan) if args.json else show_text(store, plan))
    return ExitCode.OK


def cmd_diff(args: argparse.Namespace) -> int:
    from buildtrain.plan.diff import diff_plans
    from buildtrain.report import diff_json, diff_text

    store = _store(args)
    a, b = store.load_plan(args.plan_a), store.load_plan(args.plan_b)
    changes, steps = diff_plans(a, b)
    print(diff_json(a, b, changes, steps) if args.json else diff_text(a, b, changes, steps))
    return ExitCode.OK


def cmd_ls(args: argparse.Namespace) -> int:
    import json

    from buildtrain.report import ls_rows, ls_text

    rows = ls_rows(_store(args))
    print(json.dumps(rows, indent=2) if args.json else ls_text(rows))
    return ExitCode.OK


def _experiments(args: argparse.Namespace) -> Path:
    return Path(args.experiments or os.environ.get("BT_EXPERIMENTS") or "experiments")


def cmd_run(args: argparse.Namespace) -> int:
    from buildtrain.executor.run import RunOptions, run_plan

    store = _store(args)
    threads = args.threads
    launch = _launch(args)
    if _is_preset(args.plan):
        from buildtrain.plan.planner import plan_preset

        planned = plan_preset(args.plan, args.set, store, launch.world_size)
        plan = planned.plan
        threads = threads or planned.threads or None
    else:
        if args.set:
            raise UsageError("--set applies to a preset; give a preset path, or plan first with bt plan")
        plan = store.load_plan(args.plan)
    options = RunOptions(
        threads=threads,
        experiments=_experiments(args),
        wait=not args.no_wait,
        progress=None if args.progress == "auto" else args.progress == "on",
        log_every=args.log_every,
        target=args.target,
        launch=launch,
    )
    return run_plan(store, plan, options)


def cmd_verify(args: argparse.Namespace) -> int:
    from buildtrain.verify.verify import VerifyOptions, verify_plan

    store = _store(args)
    plan = store.load_plan(args.plan)
    options = VerifyOptions(
        resume_at=_parse_steps(args.resume_at),
        threads=args.threads,
        steps=args.steps,
        json=args.json,
        keep=args.keep_scratch,
        experiments=_experiments(args),
        launch=_launch(args),
    )
    return verify_plan(store, plan, options)


def cmd_fsck(args: argparse.Namespace) -> int:
    import json

    from buildtrain.verify.fsck import fsck

    store = _store(args)
    report = fsck(store, fix=args.repair)
    if report is None:
        _err(f"bt fsck: no store at {store.root}")
        return ExitCode.OK
    if args.json:
        body = {
            "store": report.store,
            "checked": report.checked,
            "damaged": [item.to_json() for item in report.damaged],
            "repaired": report.repaired,
            "not_repaired": report.not_repaired,
        }
        print(json.dumps(body, indent=2))
    for item in report.damaged:
        _err(f"damaged {item.kind}: {item.object}")
        for problem in item.problems[:5]:
            _err(f"    {problem}")
        for referrer in item.referenced_by:
            _err(f"    used by {referrer}")
        if item.note:
            _err(f"    {item.note}")
    for line in report.repaired:
        _err(f"repaired {line}")
    for line in report.not_repaired:
        _err(f"not repaired {line}")
    verdict = f"{len(report.damaged)} damaged" if report.damaged else "all intact"
    _err(f"bt fsck: {report.checked} objects checked in {store.root}: {verdict}")
    if report.damaged and not args.repair:
        _err(
            "bt fsck --repair moves every damaged object to quarantine/; then bt run rebuilds what "
            "a plan needs (a damaged plan: bt plan PRESET again)"
        )
    elif report.damaged and not report.not_repaired:
        _err("repaired: bt run rebuilds what a plan needs; bt gc removes the quarantine")
        return ExitCode.OK
    return ExitCode.CORRUPT if report.damaged else ExitCode.OK


def cmd_gc(args: argparse.Namespace) -> int:
    from buildtrain.store.gc import collect

    store = _store(args)
    report = collect(store, drop=args.drop, dry_run=args.dry_run)
    for line in report.warnings:
        _err(f"warning: {line}")
    for plan_hash in report.dropped:
        _err(f"{'would drop' if args.dry_run else 'dropped'} plan {plan_hash[:12]}")
    for path in report.removed:
        _err(f"{'would remove' if args.dry_run else 'removed'} {path}")
    for line in report.left:
        _err(f"could not remove {line}")
    if report.busy:
        _err("note: a bt run holds a step lock; work and temporary folders were left alone")
    _err(
        f"bt gc: {'would free' if args.dry_run else 'freed'} {report.freed / 1e6:.1f} MB "
        f"in {len(report.removed)} item(s)"
    )
    return ExitCode.FAILED if report.left else ExitCode.OK


def cmd_export(args: argparse.Namespace) -> int:
    from buildtrain.steps.export import export_to

    store = _store(args)
    plan = store.load_plan(args.plan)
    destination = export_to(store, plan, Path(args.dest) if args.dest else None)
    print(destination)
    return ExitCode.OK


def cmd_sample(args: argparse.Namespace) -> int:
    from buildtrain.steps.sample import SampleOptions, sample

    store = _store(args)
    options = SampleOptions(
        prompt=args.prompt,
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k or 0,
        seed=args.seed,
    )
    print(args.prompt + sample(store, store.load_plan(args.plan), options))
    return ExitCode.OK


def _at_least_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _launch(args: argparse.Namespace) -> Launch:
    from buildtrain.executor.launch import Launch

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


def _add_world_size(sub: argparse.ArgumentParser, *, rendezvous: bool) -> None:
    """--nproc and friends: how many processes train (through torchrun when more than one)."""
    group = sub.add_argument_group(
        "distributed training",
        "Train steps run on NPROC x NNODES processes started by torchrun (gloo on CPU, NCCL on GPU); "
        "data, eval and export stay single-process. With train.reduction = 'invariant' (the default) "
        "the weights are the same at any world size that divides the micro-batches, and the world "
        "size is not part of the plan hash; with 'allreduce' it is. On several machines, run the same "
        "command on each with its own --node-rank.",
    )
    group.add_argument(
        "--nproc",
        type=_processes,
        default=1,
        metavar="N",
        help="training processes on this machine (default 1; a large train step of a portable plan "
        "uses its --threads cores as that many single-threaded processes, unless --threads 1)",
    )
    group.add_argument(
        "--nnodes", type=_processes, default=1, metavar="K", help="machines taking part (default 1)"
    )
    if rendezvous:
        group.add_argument(
            "--node-rank",
            type=int,
            default=0,
            metavar="R",
            help="this machine's index, 0..K-1 (node 0 writes outputs)",
        )
        group.add_argument(
            "--rdzv-endpoint",
            type=_endpoint,
            metavar="HOST:PORT",
            help="where node 0 hosts torchrun's rendezvous (needed with --nnodes > 1)",
        )
        group.add_argument(
            "--rdzv-timeout",
            type=_positive,
            default=DEFAULT_RDZV_TIMEOUT,
            metavar="S",
            help=f"give up when the nodes have not all met after S seconds (default {DEFAULT_RDZV_TIMEOUT})",
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


def _positive(text: str, limit: int = 1 << 31) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    if value > limit:
        raise argparse.ArgumentTypeError(f"must be <= {limit}, got {value}")
    return value


def _threads(text: str) -> int:
    from buildtrain.config.schema import MAX_THREADS

    return _positive(text, MAX_THREADS)


def _processes(text: str) -> int:
    return _positive(text, MAX_PROCESSES)


def _endpoint(text: str) -> str:
    """HOST:PORT (or [IPv6]:PORT), checked here so that a typo fails at once, not after a timeout."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 1..65535, got {text!r}")
    if any(c.isspace() or c in "/@?#" for c in host):
        raise argparse.ArgumentTypeError(f"{host!r} is not a host name or address")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line like every other error of bt (no usage block)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bt",
        description="buildtrain: compile training presets into content-hashed plans and run them "
        "reproducibly. Identical plan hashes reproduce identical weights, bit for bit.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--store", metavar="DIR", help="store directory (default: $BT_STORE or ./.bt)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=description,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument(
            "--store",
            metavar="DIR",
            default=argparse.SUPPRESS,
            help="store directory (default: $BT_STORE or ./.bt)",
        )
        return sub

    sub = command(
        "plan",
        "compile a preset into a stored plan; print its hash",
        "Compile PRESET (and any --set overrides) into a content-hashed plan and store it. stdout is "
        "the 64-hex plan hash and nothing else, so `bt run $(bt plan PRESET)` composes; a summary of "
        "the steps (cached or to run) goes to stderr. Problems in the preset are all listed, one per "
        "line, as FILE: KEY: MESSAGE, with exit code 2.",
    )
    sub.add_argument("preset", help="a preset TOML file")
    sub.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key with a TOML value, e.g. train.lr=3e-4 or stages.finetune.train.steps=50 (repeatable)",
    )
    sub.add_argument("-q", "--quiet", action="store_true", help="print only the hash")
    _add_world_size(sub, rendezvous=False)
    sub.set_defaults(func=cmd_plan)

    sub = command(
        "run",
        "execute a plan (or plan and execute a preset)",
        "Execute the steps of PLAN (a hash, a unique prefix, or a preset path) in order: data, train "
        "stage(s), eval, export. Steps already in the store are cache hits. An interrupted step "
        "resumes from its newest valid checkpoint, bit for bit. Ctrl-C finishes the current optimizer "
        "step, checkpoints and exits with code 3. Every run writes a record to experiments/.",
    )
    sub.add_argument("plan", help="plan hash or prefix, or a preset path")
    sub.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="overrides, when PLAN is a preset"
    )
    sub.add_argument(
        "--threads",
        type=_threads,
        help="cores to compute with (default: the preset's numerics.threads, or all, shared among "
        "--nproc processes); a portable plan computes with one thread per process and runs a large "
        "train step on several, a native plan runs the thread count its hash pins",
    )
    sub.add_argument(
        "--experiments",
        metavar="DIR",
        help="where run records go (default: $BT_EXPERIMENTS or ./experiments)",
    )
    sub.add_argument(
        "--no-wait",
        action="store_true",
        help="exit with code 7 instead of waiting when another bt builds a step",
    )
    sub.add_argument(
        "--target", metavar="LABEL", help="build only this step and what it needs, e.g. train:main"
    )
    sub.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="progress bar (default: on a terminal)",
    )
    sub.add_argument(
        "--log-every",
        type=_positive,
        default=10,
        metavar="N",
        help="log a training line every N steps (default 10)",
    )
    _add_world_size(sub, rendezvous=True)
    sub.set_defaults(func=cmd_run)

    sub = command(
        "verify",
        "re-execute a plan from scratch and compare bit for bit",
        "Re-execute every step of PLAN in a scratch store, each in a fresh process, and compare each "
        "output with the recorded one by canonical tensor digests. On a difference, name the first "
        "training step that diverged and the tensors that differ. An unbuilt plan is built, then "
        "checked against a second independent execution. Exit 0: reproduced; 4: not reproduced, or "
        "a comparison could not be made (verify fails closed); 5: a recorded output is damaged or "
        "belongs to another step.",
    )
    sub.add_argument("plan", help="plan hash or prefix")
    sub.add_argument(
        "--resume-at", metavar="N[,M]", help="hard-kill the re-execution after these steps and resume"
    )
    sub.add_argument(
        "--threads",
        type=_threads,
        help="re-execute with this many cores (portable plans; see bt run --help)",
    )
    sub.add_argument(
        "--steps", type=_positive, metavar="N", help="spot check: only the first N steps of each train stage"
    )
    sub.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    sub.add_argument("--keep-scratch", action="store_true", help="keep the scratch store for inspection")
    sub.add_argument(
        "--experiments",
        metavar="DIR",
        help="where the record of a first build goes (default: $BT_EXPERIMENTS or ./experiments)",
    )
    _add_world_size(sub, rendezvous=False)
    sub.set_defaults(func=cmd_verify)

    sub = command(
        "fsck",
        "re-hash every object in the store",
        "Re-hash every plan, step output, checkpoint and evaluation result in the store (and "
        "check its stamps, locks and stat cache) and report each damaged one with the plans and "
        "steps that reference it (exit 5). --repair moves them to quarantine/ (exit 0 when every "
        "one was moved); bt run then rebuilds what a plan needs.",
    )
    sub.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    sub.add_argument(
        "--repair", action="store_true", help="move every damaged object to quarantine/ (caches are removed)"
    )
    sub.set_defaults(func=cmd_fsck)

    sub = command(
        "show",
        "show a plan: config, steps, hashes, inputs",
        "Show the resolved config of PLAN and its steps with their hashes, inputs and status.",
    )
    sub.add_argument("plan", help="plan hash or prefix")
    sub.add_argument("--json", action="store_true", help="machine-readable")
    sub.set_defaults(func=cmd_show)

    sub = command(
        "diff",
        "which keys differ between two plans and which steps that invalidates",
        "Compare two plans: the config keys that differ, and for each step whether it is reused "
        "from the store or invalidated, and why.",
    )
    sub.add_argument("plan_a", help="plan hash or prefix")
    sub.add_argument("plan_b", help="plan hash or prefix")
    sub.add_argument("--json", action="store_true", help="machine-readable")
    sub.set_defaults(func=cmd_diff)

    sub = command(
        "ls", "list stored plans", "List stored plans with name, creation time, steps and build status."
    )
    sub.add_argument("--json", action="store_true", help="machine-readable")
    sub.set_defaults(func=cmd_ls)

    sub = command(
        "gc",
        "remove what no plan needs",
        "Remove step outputs no stored plan references, leftover temporary and work folders of "
        "completed steps, quarantined outputs and unreferenced evaluation results.",
    )
    sub.add_argument(
        "--drop", action="append", default=[], metavar="PLAN", help="forget this plan first (repeatable)"
    )
    sub.add_argument("--dry-run", action="store_true", help="list what would be removed")
    sub.set_defaults(func=cmd_gc)

    sub = command(
        "export",
        "copy a built plan's export package out of the store",
        "Copy the export package of a built PLAN (weights, config, tokenizer description, "
        "checksums) to DEST (default ./export/NAME-HASH), read-only.",
    )
    sub.add_argument("plan", help="plan hash or prefix")
    sub.add_argument("dest", nargs="?", help="destination directory (must not exist)")
    sub.set_defaults(func=cmd_export)

    sub = command(
        "sample",
        "generate text from a built plan's exported weights",
        "Generate text after PROMPT from the export of a built PLAN, with a key/value cache. The same "
        "--seed gives the same text; --temperature 0 is greedy.",
    )
    sub.add_argument("plan", help="plan hash or prefix")
    sub.add_argument("--prompt", default="", metavar="TEXT", help="text to continue (default: none)")
    sub.add_argument(
        "--tokens", type=_positive, default=64, metavar="N", help="tokens to generate (default 64)"
    )
    sub.add_argument(
        "--temperature", type=_at_least_zero, default=0.8, metavar="T", help="default 0.8; 0: greedy"
    )
    sub.add_argument(
        "--top-k",
        type=_positive,
        default=None,
        metavar="K",
        help="draw from the K likeliest tokens (default: all)",
    )
    sub.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the draws (default 0)")
    sub.set_defaults(func=cmd_sample)
    return parser


def _quiet_stdout() -> None:
    """stdout's reader went away: send the rest (and the final flush) nowhere, without a word."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `bt show | head`: the reader has all it wanted
        _quiet_stdout()
        return BROKEN_PIPE
    except ConfigError as exc:
        for line in exc.problems:
            _err(line)
        count = len(exc.problems)
        _err(f"bt {args.command}: {count} problem{'s' if count != 1 else ''} in the preset; nothing was run")
        return exc.exit_code
    except BuildtrainError as exc:
        _err(f"bt {args.command}: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        _err(f"bt {args.command}: interrupted")
        return ExitCode.INTERRUPTED
    except OSError as exc:  # the store or a record cannot be written: say where, not how
        where = f" {exc.filename}" if exc.filename else ""
        _err(f"bt {args.command}: cannot use{where}: {exc.strerror or exc}")
        return ExitCode.FAILED


if __name__ == "__main__":
    sys.exit(main())
