"""The data step for chat records (`data.format = "chat"`): render, encode, mask, shard.

Each JSONL line is `{"prompt": ..., "completion": ...}` (a user turn and the assistant's answer)
or `{"messages": [{"role", "content"}, ...]}`. The chat template (its text is in the step's
config, so in its hash) renders the record; the text each assistant turn adds is what the model
learns to write, and only its tokens (and the end-of-document token after the record) count in
the loss: a mask shard beside each token shard holds 1 for them and 0 for everything else.
A record is never cut: it goes whole to the train or the held-out split (by its index, as split
blocks do), and training windows that pack several records read each token's own mask.

The template runs in Jinja's immutable sandbox (as transformers renders it): it can format the
record and nothing else. Needs no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from buildtrain.config.steps import TextSettings
from buildtrain.errors import StepFailed
from buildtrain.steps import split
from buildtrain.steps.data_index import token_width
from buildtrain.steps.documents import Recorder
from buildtrain.steps.shards import ShardWriter, finish
from buildtrain.steps.sources import Source, open_source
from buildtrain.steps.tokenizer_files import load

Message = dict[str, str]
ASSISTANT = "assistant"


def records(path: Source | Path) -> Iterator[tuple[str, list[Message]]]:
    """(where, messages) for every non-blank line of a chat JSONL file."""
    with open_source(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {number}"
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                raise StepFailed(f"{where}: not valid JSON ({exc}); fix or remove the line") from None
            yield where, messages_of(record, where)


def messages_of(record: Any, where: str) -> list[Message]:
    """A record's conversation: its messages, or its prompt and completion as two turns."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        messages = record["messages"]
    elif isinstance(record, dict) and {"prompt", "completion"} <= set(record):
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": ASSISTANT, "content": record["completion"]},
        ]
    else:
        raise StepFailed(
            f'{where}: expected {{"prompt", "completion"}} or {{"messages": [...]}}; fix the record'
        )
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise StepFailed(f"{where}: every message needs a string role and content; fix the record")
    if not any(message["role"] == ASSISTANT for message in messages):
        raise StepFailed(f"{where}: no assistant turn (nothing to learn); add a completion")
    return messages


class Renderer:
    """A chat template compiled once in Jinja's immutable sandbox."""

    def __init__(self, template: str, end_of_document: str) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise StepFailed(f"the chat template refused a record: {message}")

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        try:
            self.template = environment.from_string(template)
        except TemplateError as exc:
            raise StepFailed(f"data.chat_template: not a Jinja template ({exc})") from None
        self.end_of_document = end_of_document

    def render(self, messages: list[Message], prompt: bool) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=prompt, eos_token=self.end_of_document, bos_token=""
        )

    def segments(self, messages: list[Message], where: str) -> list[tuple[str, bool]]:
        """The rendered record as (text, learned) pieces: each assistant turn's own text is
        learned; the template's text before it (generation prompt included) is not."""
        pieces, done = [], ""
        for index, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            before = self.render(messages[:index], prompt=True)
            through = self.render(messages[: index + 1], prompt=False)
            if not before.startswith(done) or not through.startswith(before):
                raise StepFailed(
                    f"{where}: the chat template does not render a conversation as an extension of its "
                    "beginning, so the completion cannot be told apart; use another template"
                )
            pieces += [(before[len(done) :], False), (through[len(before) :], True)]
            done = through
        rest = self.render(messages, prompt=False)[len(done) :]
        return [*pieces, (rest, False)] if rest else pieces


def encoded(
    tokenizer: Any, pieces: list[tuple[str, bool]], end_of_document: int
) -> tuple[list[int], list[int]]:
    """Token ids and loss masks of a record's pieces, then the end-of-document token (learned:
    the model learns where an answer ends)."""
    ids, masks = [], []
    for text, learned in pieces:
        found = tokenizer.encode(text, add_special_tokens=False).ids
        ids += found
        masks += [int(learned)] * len(found)
    return [*ids, end_of_document], [*masks, 1]


def build_chat(
    text: TextSettings,
    shard_tokens: int,
    sources: Sequence[Source | Path],
    tokenizer_dir: Path,
    out: Path,
    log: Any,
) -> dict[str, str]:
    """Token and mask shards of every chat record, each record whole in one split."""
    tokenizer, description = load(tokenizer_dir)
    width = token_width(description["vocab_size"])
    renderer = Renderer(text.chat_template, description["end_of_document_token"])
    writers = {s: ShardWriter(out, s, shard_tokens, width) for s in ("train", "heldout")}
    masks = {s: ShardWriter(out, f"{s}-mask", shard_tokens, 1) for s in ("train", "heldout")}
    runs = split.SplitRuns(text.split_seed, text.heldout_fraction)
    recorder = Recorder()  # each record's turns as one document, for the contamination check
    count = 0
    for source in sources:
        for where, messages in records(source):
            recorder.add_text("".join(str(message["content"]) for message in messages))
            ids, mask = encoded(tokenizer, renderer.segments(messages, where), description["end_of_document"])
            held_out, _ = runs.run(count)
            name = "heldout" if held_out else "train"
            writers[name].write(np.array(ids, dtype=np.uint32))
            masks[name].write(np.array(mask, dtype=np.uint8))
            count += 1
    return finish(
        out,
        writers,
        tokenizer=description,
        documents=count,
        blocks=count,
        units=f"{count} chat records",
        log=log,
        recorder=recorder,
        masks=masks,
    )
