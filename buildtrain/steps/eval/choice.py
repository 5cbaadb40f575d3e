"""The multiple-choice scorer: each choice's summed log-likelihood after its context.

Sequences (`suites.scored_sequence`) go through the model in batches of `batch_size` in question
order, padded on the right (a causal model's positions never see what follows them, so padding
changes no score). Log-probabilities are taken in float32 and each choice's are added in float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from buildtrain.config.suite_files import MultipleChoice, read_multiple_choice
from buildtrain.steps.eval.overlap import overlap_of, withheld
from buildtrain.steps.eval.suites import (
    Encode,
    accuracy,
    pair_ids,
    scored_sequence,
    subset_indices,
    text_codec,
)
from buildtrain.steps.sources import read_source
from buildtrain.store.layout import DEFAULT_NGRAM

if TYPE_CHECKING:
    from pathlib import Path

    from buildtrain.config.steps import EvalStep, SuiteStep
    from buildtrain.steps.eval.step import Loaded
    from buildtrain.steps.sources import Source


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


def score_suite(
    loaded: Loaded,
    config: EvalStep,
    suite: SuiteStep,
    files: list[Source],
    inputs: dict[str, Path],
    work: Path,
) -> dict[str, Any]:
    """A `multiple_choice` suite (`config/suites/choice.py`) scored on the subset `config` draws,
    with its overlap with the training documents (`inputs`: the eval step's verified inputs)."""
    questions = read_multiple_choice(read_source(files[0]), files[0].path)
    chosen = [questions[i] for i in subset_indices(len(questions), config.subset, config.seed)]
    codec = text_codec(inputs.get("tokenizer"))
    batch = config.eval.batch_size
    result = score(
        loaded.model, chosen, codec.encode, codec.end, config.context, batch, loaded.device, loaded.autocast
    )
    texts = [q.context + q.choices[q.answer] for q in chosen]  # context and answer as one text
    overlap = overlap_of(texts, [q.context for q in chosen], inputs, suite.ngram or DEFAULT_NGRAM)
    return withheld(suite, result, overlap)
