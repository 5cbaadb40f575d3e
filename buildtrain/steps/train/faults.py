"""Deliberate faults and limits, so the test suite and `bt verify` can prove that resume, verify
and the checkpoint protocol detect what they claim to detect. Never set in normal use.

`FaultPlan` is what a job asks for (the job's `hooks` table, structured by the config converter);
`Faults` carries it out through the training loop's observer seam.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import attrs
import torch

from buildtrain.config.convert import converter
from buildtrain.steps.train.observer import Observer


@attrs.frozen(kw_only=True)
class FaultPlan:
    """The faults of one train step process, all off by default."""

    kill_after: tuple[int, ...] = ()  # checkpoint, then SIGKILL this process after these updates
    kill_in_checkpoint: int | None = None  # SIGKILL while writing this update's checkpoint
    step_delay: float = 0.0  # seconds to sleep per update, to make signals land mid-run in tests
    perturb: tuple[int, str, float] | None = None  # (update, tensor, delta): inject a difference
    skip_cursor_restore: bool = False  # negative control: a resume that forgets the data cursor
    stop_after: int | None = None  # spot checks: train only this many updates
    kill_rank: tuple[int, int] | None = None  # (rank, update): that rank SIGKILLs itself, no checkpoint

    @classmethod
    def from_job(cls, hooks: dict[str, Any]) -> FaultPlan:
        """From a job's `hooks` table (JSON: arrays for tuples); an unknown fault is an error."""
        return converter.structure(hooks, cls)


class Faults(Observer):
    """Carries out a `FaultPlan` on rank `rank`."""

    def __init__(self, plan: FaultPlan, rank: int, log: Any) -> None:
        self.plan, self.rank, self.log = plan, rank, log

    def resumed(self, cursor: int) -> int:
        return 0 if self.plan.skip_cursor_restore else cursor

    def updated(self, update: int, model: torch.nn.Module) -> bool:
        plan = self.plan
        if plan.perturb is not None and plan.perturb[0] == update:
            with torch.no_grad():
                dict(model.named_parameters())[plan.perturb[1]].view(-1)[0] += plan.perturb[2]
        if plan.kill_rank == (self.rank, update):
            self.log.info("hard_kill", step=update, rank=self.rank)
            signal.raise_signal(signal.SIGKILL)  # no checkpoint: the other ranks must cope
        if plan.step_delay:
            time.sleep(plan.step_delay)
        return plan.stop_after is not None and update >= plan.stop_after

    def wants_checkpoint(self, update: int) -> bool:
        return update in self.plan.kill_after

    def checkpoint_half_written(self, update: int) -> None:
        if self.plan.kill_in_checkpoint == update:  # die with a half-written checkpoint on disk
            signal.raise_signal(signal.SIGKILL)

    def checkpoint_written(self, update: int) -> None:
        if update in self.plan.kill_after:
            self.log.info("hard_kill", step=update)
            signal.raise_signal(signal.SIGKILL)
