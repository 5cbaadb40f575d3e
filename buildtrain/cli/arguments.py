"""Argument types and option groups shared by several `bt` commands: each bad value fails at parse
time with a message that names the option, not later inside a run."""

from __future__ import annotations

import argparse
from pathlib import PurePath

from buildtrain.executor.process.launch import DEFAULT_RDZV_TIMEOUT

# More processes per machine or machines than this is a typo, not a cluster.
MAX_PROCESSES = 1024


def add_world_size(sub: argparse.ArgumentParser, *, rendezvous: bool) -> None:
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
        type=process_count,
        default=1,
        metavar="N",
        help="training processes on this machine (default 1; a large train step of a portable plan "
        "uses its --threads cores as that many single-threaded processes, unless --threads 1)",
    )
    group.add_argument(
        "--nnodes", type=process_count, default=1, metavar="K", help="machines taking part (default 1)"
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
            type=endpoint,
            metavar="HOST:PORT",
            help="where node 0 hosts torchrun's rendezvous (needed with --nnodes > 1)",
        )
        group.add_argument(
            "--rdzv-timeout",
            type=positive,
            default=DEFAULT_RDZV_TIMEOUT,
            metavar="S",
            help=f"give up when the nodes have not all met after S seconds (default {DEFAULT_RDZV_TIMEOUT})",
        )


def positive(text: str, limit: int = 1 << 31) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    if value > limit:
        raise argparse.ArgumentTypeError(f"must be <= {limit}, got {value}")
    return value


def output_file(text: str) -> str:
    """A file to write: a name is needed ('' or '.' name a folder, and the page is written beside
    it under a temporary name)."""
    if PurePath(text).name in {"", ".", ".."} or text.endswith("/"):
        raise argparse.ArgumentTypeError(f"expected a file name, got {text!r}")
    return text


def thread_count(text: str) -> int:
    from buildtrain.config.schema import MAX_THREADS

    return positive(text, MAX_THREADS)


def process_count(text: str) -> int:
    return positive(text, MAX_PROCESSES)


def endpoint(text: str) -> str:
    """HOST:PORT (or [IPv6]:PORT), checked here so that a typo fails at once, not after a timeout."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 1..65535, got {text!r}")
    if any(c.isspace() or c in "/@?#" for c in host):
        raise argparse.ArgumentTypeError(f"{host!r} is not a host name or address")
    return text


def seed(text: str) -> int:
    """A seed torch's generator takes: a whole number in 0..2**64-1."""
    from buildtrain.executor.adhoc.deliver import MAX_SEED

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in 0..2**64-1, got {text}")
    return value


def temperature(text: str) -> float:
    """0 (greedy), or a temperature whose division keeps float32 logits finite."""
    from buildtrain.executor.adhoc.deliver import MAX_TEMPERATURE, MIN_TEMPERATURE

    value = non_negative(text)
    if not (value == 0.0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        raise argparse.ArgumentTypeError(
            f"must be 0 (greedy) or in {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}, got {text}"
        )
    return value


def fraction(text: str) -> float:
    """A share in (0, 1]: `--subset`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be > 0 and <= 1 (got {text})")
    return value


def non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_executor(sub: argparse.ArgumentParser, planning: bool = False) -> None:
    """--executor: where the steps' processes run; never part of any hash, though the toolchain
    of the workers it names is (a preset is planned for them)."""
    where = (
        "plan for the machines that will run the steps (default: $BT_EXECUTOR or local): this one, "
        "or a worker that Ray (RAY_ADDRESS, else a local Ray instance) or Slurm runs a probe on; "
        "their torch build, device and CPU enter the step hashes, the executor itself never does"
        if planning
        else "where steps run (default: $BT_EXECUTOR or local): local processes, Ray tasks "
        "(RAY_ADDRESS, else a local Ray instance) or Slurm jobs; a preset is planned for their "
        "workers' toolchain; the executor itself is never part of any hash"
    )
    sub.add_argument("--executor", choices=("local", "ray", "slurm"), help=where)
    slurm = sub.add_argument_group("Slurm (--executor slurm; never part of any hash)")
    for option, variable, what in SLURM_OPTIONS:
        slurm.add_argument(
            f"--slurm-{option}", metavar=option.split("-")[0].upper(), help=f"{what} (or {variable})"
        )


# --slurm-* options: (option, variable, help); their values reach the engine as strings and are
# checked there (buildtrain/executor/engines/slurm_engine.py), with the variables as fallback.
SLURM_OPTIONS = (
    ("partition", "BT_SLURM_PARTITION", "the partition each step's job is submitted to (default: Slurm's)"),
    ("account", "BT_SLURM_ACCOUNT", "the account the jobs are charged to"),
    (
        "time",
        "BT_SLURM_TIME",
        "each job's time limit in minutes (default 60); a job that reaches it is requeued and resumes",
    ),
    (
        "gpus-per-node",
        "BT_SLURM_GPUS_PER_NODE",
        "GPUs each job asks for (default: one per rank of a GPU step)",
    ),
)


def engine_settings(args: argparse.Namespace) -> dict[str, str]:
    """The engine-specific options given on the command line (`--slurm-time 30` -> time: "30")."""
    given = {
        option: getattr(args, f"slurm_{option.replace('-', '_')}", None) for option, _, _ in SLURM_OPTIONS
    }
    return {option.replace("-", "_"): value for option, value in given.items() if value is not None}
