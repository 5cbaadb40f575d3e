"""The multiple-choice scorer: each choice's summed log-likelihood after its context.

Sequences (`suites.scored_sequence`) go through the model in batches of `batch_size` in question
order, padded on the right (a causal model's positions never see what follows them, so padding
changes no score). Log-probabilities are taken in float32 and each choice's are added in float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from buildtrain.config.suite_files import MultipleChoice
from buildtrain.steps.suites import Encode, accuracy, pair_ids, scored_sequence


@torch.no_grad()
def scored(
    model: torch.nn.Module,
    sequences: Sequence[tuple[list[int], list[int]]],
    batch_size: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager[Any] | None = None,
) -> list[tuple[float, bool]]:
    """(summed log-likelihood, whether each token is the argmax) of each (input, continuation)
    sequence's continuation, where the input's last `len(continuation)` positions predict it."""
    model.eval()
    found: list[tuple[float, bool]] = []
    for first in range(0, len(sequences), batch_size):
        batch = sequences[first : first + batch_size]
        width = max(len(inputs) for inputs, _ in batch)
        rows = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (inputs, _) in enumerate(batch):
            rows[row, : len(inputs)] = torch.tensor(inputs, dtype=torch.long)
        with autocast or contextlib.nullcontext():
            logits = model(rows.to(device))  # (B, T, vocab)
        logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
        for row, (inputs, continuation) in enumerate(batch):
            end, n = len(inputs), len(continuation)
            window, wanted = logprobs[row, end - n : end], torch.tensor(continuation)
            picked = window.gather(1, wanted[:, None])
            found.append((picked.double().sum().item(), bool((window.argmax(-1) == wanted).all())))
    return found


def loglikelihoods(
    model: torch.nn.Module,
    sequences: Sequence[tuple[list[int], list[int]]],
    batch_size: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager[Any] | None = None,
) -> list[float]:
    """The summed log-likelihood of each sequence's continuation (`scored`)."""
    return [score for score, _ in scored(model, sequences, batch_size, device, autocast)]


def choice_loglikelihoods(
    model: torch.nn.Module,
    questions: Sequence[MultipleChoice],
    encode: Encode,
    end: int,
    window: int,
    batch_size: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager[Any] | None = None,
) -> list[list[float]]:
    """Each question's choices' log-likelihoods after its context (`suites.pair_ids`)."""
    sequences = []
    for question in questions:
        for choice in question.choices:
            context, continuation = pair_ids(question.context, choice, encode, end)
            inputs, _ = scored_sequence(context, continuation, window)
            sequences.append((inputs, continuation))
    flat = loglikelihoods(model, sequences, batch_size, device, autocast)
    grouped, at = [], 0
    for question in questions:
        grouped.append(flat[at : at + len(question.choices)])
        at += len(question.choices)
    return grouped


def score(
    model: torch.nn.Module,
    questions: Sequence[MultipleChoice],
    encode: Encode,
    end: int,
    window: int,
    batch_size: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager[Any] | None = None,
) -> dict[str, Any]:
    """`acc` and `acc_norm` of the model on `questions` (see `suites.accuracy`)."""
    scores = choice_loglikelihoods(model, questions, encode, end, window, batch_size, device, autocast)
    return accuracy(scores, questions)
