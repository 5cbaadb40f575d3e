"""What the process running a train step hands the training loop besides the step itself: how to
stop, who observes, and which rank this process is. Torch-free until a default `Ranks` is made."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import attrs

from buildtrain.steps.train.observer import Observer

if TYPE_CHECKING:
    from buildtrain.steps.train.ranks import Ranks


@attrs.define
class StopRequest:
    """Set by SIGINT/SIGTERM; the loop finishes the update in flight, checkpoints and exits."""

    signal_name: str | None = None

    def install(self) -> None:
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, self._handle)

    def _handle(self, number: int, _: object) -> None:
        self.signal_name = signal.Signals(number).name


def _one_process() -> Ranks:
    from buildtrain.steps.train.ranks import Ranks  # imports torch

    return Ranks()


@attrs.frozen(kw_only=True)
class TrainControls:
    """The controls of one train step process; the defaults train alone, unobserved, and ignore
    signals (the process that runs the step installs `stop`)."""

    stop: StopRequest = attrs.Factory(StopRequest)
    observer: Observer = attrs.Factory(Observer)  # faults and watchers (see observer.py)
    ranks: Ranks = attrs.Factory(_one_process)
