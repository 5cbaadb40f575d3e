"""The one seam between the training loop and whatever watches or disturbs it.

The loop calls an `Observer` at fixed points of every update and of every checkpoint; the base
class does nothing, so a plain run pays nothing. Fault injection (`faults.py`, for the test suite
and `bt verify`) and the divergence watcher of `bt verify` (`buildtrain/verify/watch.py`) subclass
it, which lets verification plug into training without the steps knowing about verify.

Order within one update (`trainer.train`): forward, loss, backward, clip, optimizer update, zero
grads, `updated`, record (`recorded`, rank 0, for each line written; see `wants_record`), then a checkpoint if due or `wants_checkpoint`
(`checkpoint_half_written` in the middle of writing it, `checkpoint_written` after). The record
of an update may be made during the next one, after that one's forward and backward are queued
and before its optimizer update (`arriving.py`); an observer that `wants_record` gets it at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Observer:
    """Does nothing; subclasses override the points they need."""

    def resumed(self, cursor: int) -> int:
        """After a resume: the data cursor the loop goes on from (the checkpoint's, normally)."""
        return cursor

    def updated(self, update: int, model: torch.nn.Module) -> bool:
        """After the optimizer update and zero grad, on every rank. True: end training here."""
        return False

    def recorded(self, entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        """After rank 0 wrote an update's trace line (`entry`; `tensors` the whole training state
        as it is when the line is written). Lines are written in batches (at checkpoints, every
        `record.RECORD_EVERY` updates) unless `wants_record` asks for each at once, which makes
        `tensors` the state of `entry`'s update. True: end training here."""
        return False

    def wants_record(self, update: int) -> bool:
        """Whether the line of `update` is wanted at once (its fingerprints copied from the device
        now, one synchronisation) rather than with the next batch."""
        return False

    def wants_checkpoint(self, update: int) -> bool:
        """A checkpoint after `update` even off the cadence."""
        return False

    def checkpoint_half_written(self, update: int) -> None:
        """While the checkpoint of `update` is written: the weights are on disk, the rest is not."""

    def checkpoint_written(self, update: int) -> None:
        """After the checkpoint of `update` was sealed and renamed into place."""


class Observers(Observer):
    """Several observers as one, each called in order at every point (all of them, always)."""

    def __init__(self, *observers: Observer) -> None:
        self.observers = observers

    def resumed(self, cursor: int) -> int:
        for observer in self.observers:
            cursor = observer.resumed(cursor)
        return cursor

    def updated(self, update: int, model: torch.nn.Module) -> bool:
        return any([observer.updated(update, model) for observer in self.observers])

    def recorded(self, entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        return any([observer.recorded(entry, tensors) for observer in self.observers])

    def wants_record(self, update: int) -> bool:
        return any([observer.wants_record(update) for observer in self.observers])

    def wants_checkpoint(self, update: int) -> bool:
        return any([observer.wants_checkpoint(update) for observer in self.observers])

    def checkpoint_half_written(self, update: int) -> None:
        for observer in self.observers:
            observer.checkpoint_half_written(update)

    def checkpoint_written(self, update: int) -> None:
        for observer in self.observers:
            observer.checkpoint_written(update)
