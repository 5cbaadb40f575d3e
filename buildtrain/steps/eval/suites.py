"""Benchmark suites as an eval step reads them: questions parsed from a suite's file, the subset
drawn from them, and the token sequences each question is scored on. Torch-free (the scoring
itself is `choice.py`).

A multiple-choice suite is JSONL, one question a line: `{"context": str, "choices": [str, ...],
"answer": index}`. Each choice is scored by the summed log-likelihood of its tokens after the
context. The tokens follow lm-evaluation-harness's rule for a (context, continuation) pair, so
that buildtrain and the harness's HF back end on the `hf/` export score the same ids:

- whitespace at the end of the context moves to the front of the continuation;
- the continuation's tokens are those of `context + continuation` past the context's own tokens
  (a BPE merge across the boundary is the whole text's);
- an empty context is the end-of-document token (the `hf/` export's bos_token_id);
- a sequence longer than the model's context + 1 is cut from the left.

The choices are written as they are scored: the file carries any space between context and
choice (a harness task reproduces this with `target_delimiter: ""`).

An exact-match suite is JSONL of `{"context": str, "target": str}`, scored by greedy generation
(`exact.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from buildtrain.canonical import digest
from buildtrain.config.schema import END_OF_DOCUMENT
from buildtrain.config.suite_files import MultipleChoice  # the file formats, read at plan time too
from buildtrain.errors import StepFailed

Encode = Callable[[str], list[int]]


def subset_indices(count: int, fraction: float, seed: int) -> list[int]:
    """The questions a subset evaluates, in file order: the `round(fraction * count)` (at least one)
    whose digests under `seed` come first. A pure function of (count, fraction, seed), and a
    smaller fraction draws a subset of a larger one's."""
    if fraction >= 1.0:
        return list(range(count))
    keep = max(1, round(fraction * count))
    ranked = sorted(range(count), key=lambda i: digest("eval-subset", {"seed": seed, "index": i}))
    return sorted(ranked[:keep])


@attrs.frozen(kw_only=True)
class Codec:
    """A plan's tokenizer as the suites use it: text to ids, ids to text, the end-of-document id."""

    encode: Encode
    decode: Callable[[list[int]], str]
    end: int


def text_codec(tokenizer: Path | None) -> Codec:
    """The codec of a plan's tokenizer: a tokenizer step's output folder, or None for the byte
    tokenizer (whose ids are a text's UTF-8 bytes; bytes that are not UTF-8 decode to U+FFFD)."""
    if tokenizer is None:
        return Codec(
            encode=lambda text: list(text.encode("utf-8")),
            decode=lambda ids: bytes(i for i in ids if i < END_OF_DOCUMENT).decode("utf-8", "replace"),
            end=END_OF_DOCUMENT,
        )
    from buildtrain.steps.tokenizer.files import load

    loaded, description = load(tokenizer)
    return Codec(
        encode=lambda text: loaded.encode(text).ids,
        decode=lambda ids: loaded.decode(ids),
        end=int(description["end_of_document"]),
    )


def pair_ids(context: str, continuation: str, encode: Encode, end: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a pair, by the rule in this module's docstring."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [end], encode(continuation)
    whole, alone = encode(context + continuation), encode(context)
    return alone, whole[len(alone) :]


def scored_sequence(context: list[int], continuation: list[int], window: int) -> tuple[list[int], int]:
    """(model input, how many of its last positions predict the continuation): the pair cut from
    the left to `window + 1` tokens, less its last token (which nothing after it predicts)."""
    if not continuation:
        raise StepFailed("a choice encodes to no tokens after its context; give non-empty choices")
    if len(continuation) > window:
        raise StepFailed(
            f"a choice is {len(continuation)} tokens, more than the model's context ({window}); shorten it"
        )
    tokens = (context + continuation)[-(window + 1) :]
    return tokens[:-1], len(continuation)


def accuracy(
    loglikelihoods: Sequence[Sequence[float]], questions: Sequence[MultipleChoice]
) -> dict[str, Any]:
    """`acc`: the share of questions whose most likely choice (the first, on a tie) is the answer;
    `acc_norm`: the same with each log-likelihood divided by its choice's length in characters."""
    right = right_norm = 0
    for scores, question in zip(loglikelihoods, questions, strict=True):
        right += _first_max(scores) == question.answer
        normed = [s / len(c) for s, c in zip(scores, question.choices, strict=True)]
        right_norm += _first_max(normed) == question.answer
    count = len(questions)
    return {"questions": count, "acc": right / count, "acc_norm": right_norm / count}


def _first_max(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))
