"""The exact-match scorer: greedy generation after each context, compared with its target.

A question is right when the greedy continuation, cut at its first newline or end-of-document
token, is exactly the target. The model may generate at most (the target's UTF-8 bytes + 1)
tokens: every token but the end-of-document one stands for at least one byte, so that is room for
the target and the newline or end that closes it, and a longer continuation cannot match. The
prompt is the context's tokens (the end-of-document token when empty), cut from the left so that
prompt and continuation fit the model's context. One sequence at a time, with a key/value cache
(`train/generate.py`): greedy picks need no generator, so the result is as reproducible as the
weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from buildtrain.config.suite_files import ExactMatch, read_exact_match
from buildtrain.errors import StepFailed
from buildtrain.steps.eval.overlap import overlap_of, withheld
from buildtrain.steps.eval.suites import Codec, subset_indices, text_codec
from buildtrain.steps.sources import read_source
from buildtrain.steps.train.generate import generate
from buildtrain.store.layout import DEFAULT_NGRAM

if TYPE_CHECKING:
    from pathlib import Path

    from buildtrain.config.steps import EvalStep, SuiteStep
    from buildtrain.steps.eval.step import Loaded
    from buildtrain.steps.sources import Source


def continuation(model: Any, question: ExactMatch, codec: Codec, window: int) -> str:
    """The greedy continuation of the question's context, cut at its first newline."""
    budget = len(question.target.encode("utf-8")) + 1
    if budget >= window:
        raise StepFailed(
            f"a target of {budget - 1} bytes leaves no room for its context in the model's {window} "
            "tokens; shorten it"
        )
    prompt = (codec.encode(question.context) or [codec.end])[-(window - budget) :]
    ids = generate(model, prompt, budget, temperature=0.0, top_k=0, seed=0, stop=codec.end)
    return codec.decode(ids).split("\n", 1)[0]


@torch.no_grad()
def score(model: Any, questions: Sequence[ExactMatch], codec: Codec, window: int) -> dict[str, Any]:
    """`exact_match`: the share of questions whose continuation is exactly the target."""
    model.eval()
    right = sum(continuation(model, q, codec, window) == q.target for q in questions)
    return {"questions": len(questions), "exact_match": right / len(questions)}


def score_suite(
    loaded: Loaded,
    config: EvalStep,
    suite: SuiteStep,
    files: list[Source],
    inputs: dict[str, Path],
    work: Path,
) -> dict[str, Any]:
    """An `exact_match` suite (`config/suites/exact.py`) scored on the subset `config` draws, with
    its overlap with the training documents (`inputs`: the eval step's verified inputs)."""
    questions = read_exact_match(read_source(files[0]), files[0].path)
    chosen = [questions[i] for i in subset_indices(len(questions), config.subset, config.seed)]
    result = score(loaded.model, chosen, text_codec(inputs.get("tokenizer")), config.context)
    texts = [q.context + q.target for q in chosen]  # context and answer as one text
    overlap = overlap_of(texts, [q.context for q in chosen], inputs, suite.ngram or DEFAULT_NGRAM)
    return withheld(suite, result, overlap)
