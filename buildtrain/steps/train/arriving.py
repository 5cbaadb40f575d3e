"""An update's loss and gradient norm on their way to the host while the next update computes.

Reading a number that a GPU computed waits for everything queued before the read. Read at the
end of its own update (a `.tolist()` after clipping), it left the GPU idle while the host checked
the loss, updated the optimizer, recorded and logged the update, and prepared and queued the next
forward pass: on a GPU, the host's share of every update was added to it. So the training loop
copies the two numbers into page-locked memory the moment they are queued, and reads them one
update later, once the next forward and backward are queued behind them (`Training.settle`).

Nothing is computed in another order: the device runs the same kernels on the same values, and
the record of an update still fingerprints that update's weights (the next optimizer update is
queued only after it). A non-finite loss still fails the step before anything is written: an
update that ends at a checkpoint, an evaluation or the last update is read at once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import torch

from buildtrain.errors import StepFailed
from buildtrain.steps.train.memory import newest


@attrs.frozen(eq=False)
class Arriving:
    """Values on their way from the device; on the CPU, already there."""

    host: torch.Tensor
    ready: Any = None  # a CUDA event recorded after the copy, where there is one

    @classmethod
    def copy(cls, values: torch.Tensor) -> Arriving:
        if values.device.type != "cuda":
            return cls(values)
        host = values.to("cpu", non_blocking=True)  # torch pins a non-blocking copy to the host
        ready = torch.cuda.Event()
        ready.record()
        return cls(host, ready)

    def read(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()  # waits for this copy, not for the work queued after it
        return self.host.tolist()


@attrs.frozen
class Waiting:
    """An update done on the device whose line is not made yet: what its record needs."""

    update: int
    cursor: int  # the data cursor after it
    lr: float
    started: float  # time.perf_counter() when the update began
    values: Arriving  # (batch loss, gradient norm)
    gathered: dict[str, torch.Tensor] | None = None  # sharded: the whole tensors its record digests
    evaluated: dict[str, Any] | None = None  # the held-out loss taken after it

    def checked(self, work: Path) -> tuple[float, float]:
        """(loss, gradient norm); a non-finite loss fails the step, naming the newest checkpoint
        in `work` (the step's folder), which a new run resumes from."""
        loss, grad_norm = self.values.read()
        if not math.isfinite(loss):
            raise StepFailed(
                f"loss is {loss} at step {self.update}; nothing was written for this step "
                f"(newest checkpoint: {newest(work)}). Lower train.lr or raise train.warmup_steps."
            )
        return loss, grad_norm
