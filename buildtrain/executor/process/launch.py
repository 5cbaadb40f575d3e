"""How many processes train a step, and how torchrun starts them.

A train step on one process is an ordinary worker. On several, torchrun (torch.distributed.run)
starts the workers: `--standalone` on one machine, its static rendezvous across machines (node 0
hosts it at `--rdzv-endpoint`). torchrun closes inherited file descriptors, so the workers report
their JSON events on stdout, which every rank shares with torchrun; torchrun's own log goes to
stderr, which the executor keeps aside and reads when a rank fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys

import attrs

from buildtrain.errors import UsageError

PR_SET_PDEATHSIG = 1
PARENT_PID = "BT_PARENT_PID"  # the pid of the bt process that started a worker
# Seconds torchrun waits for every node to join before it gives up (its own default is 600).
DEFAULT_RDZV_TIMEOUT = 120
# A test hook: a command that every step process started here runs under, e.g. `qemu-x86_64 -cpu
# Haswell`, so that a step computes on an emulated CPU of another vendor (tests/test_vendors.py).
# torchrun's ranks are its children and start natively: the hook is for single-process steps.
EMULATOR_HOOK = "BT_TEST_STEP_EMULATOR"


def python() -> list[str]:
    """The command that starts a Python step process: this interpreter (under the test hook's
    emulator, when set)."""
    return [*os.environ.get(EMULATOR_HOOK, "").split(), sys.executable]


def die_with_parent(parent: int | None = None) -> None:
    """Linux: if the parent is killed outright, take this process down with it, so no orphan
    keeps training (and writing) behind a new `bt run`'s back. Both torchrun and every worker
    call it, so the chain bt -> torchrun -> ranks falls together. A parent that died before this
    call (it cannot signal any more) is noticed by `parent`, its pid as it was at the start."""
    import ctypes  # here: `bt plan` and a null build never need it

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


@attrs.frozen(kw_only=True)
class Launch:
    """Processes per machine, machines, and this machine's place among them."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT

    def __attrs_post_init__(self) -> None:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UsageError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT, an address of node 0 that every node can reach"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def follower(self) -> bool:
        """A machine other than node 0: its ranks train, node 0's rank 0 writes every output."""
        return self.node_rank > 0

    def command(self) -> list[str]:
        """torchrun's command line, up to (not including) the program it starts."""
        command = [*python(), "-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc)]
        if self.nnodes == 1:
            return [*command, "--standalone"]
        assert self.rdzv_endpoint is not None
        return [
            *command,
            "--nnodes",
            str(self.nnodes),
            "--node-rank",
            str(self.node_rank),
            "--rdzv-endpoint",
            self.rdzv_endpoint,
            "--rdzv-conf",
            f"timeout={self.rdzv_timeout}",
        ]


SINGLE_PROCESS = Launch()


@attrs.frozen
class RankFailure:
    """The first rank torchrun saw fail: its global rank and exit status (negative: a signal)."""

    rank: int
    status: int

    def describe(self, world_size: int) -> str:
        how = (
            f"was killed by {signal.Signals(-self.status).name}"
            if self.status < 0
            else f"exited with {self.status}"
        )
        return f"rank {self.rank} of {world_size} {how}"


FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def root_cause(torchrun_log: str) -> RankFailure | None:
    """The rank whose failure brought the others down, from torchrun's error summary.

    A rank killed by a signal is the cause: its peers then fail their next collective, and one of
    them may well be the failure torchrun happened to observe first.
    """
    failures = [RankFailure(int(rank), int(status)) for rank, status in FAILURE.findall(torchrun_log)]
    killed = [failure for failure in failures if failure.status < 0 and failure.status != -signal.SIGTERM]
    return (killed or failures or [None])[0]
