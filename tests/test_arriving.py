"""An update's loss and norm read one update later (`steps/train/arriving.py`): the same numbers,
and a non-finite loss still fails the step that made it, naming the checkpoint a rerun resumes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from buildtrain.errors import StepFailed
from buildtrain.steps.train.arriving import Arriving, Waiting

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def waiting(loss: float, norm: float = 0.5, device: str = "cpu") -> Waiting:
    values = Arriving.copy(torch.tensor([loss, norm], device=device))
    return Waiting(update=7, cursor=28, lr=1e-3, started=0.0, values=values)


def test_a_finite_update_reads_back_its_two_numbers(tmp_path: Path) -> None:
    assert waiting(2.5, 0.25).checked(tmp_path) == (2.5, 0.25)


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_fails_the_update_that_made_it(tmp_path: Path, loss: float) -> None:
    with pytest.raises(
        StepFailed, match=r"loss is .* at step 7; nothing was written .*newest checkpoint: none"
    ):
        waiting(loss).checked(tmp_path)


@CUDA
def test_values_on_a_gpu_arrive_in_page_locked_memory(tmp_path: Path) -> None:
    arriving = Arriving.copy(torch.tensor([1.5, 0.75], device="cuda"))
    assert arriving.host.is_pinned() and arriving.ready is not None
    assert arriving.read() == [1.5, 0.75]
    assert waiting(3.0, device="cuda").checked(tmp_path) == (3.0, 0.5)
