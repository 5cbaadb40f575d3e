"""The data step for chat records (`data.format = "chat"`): render, encode, mask, shard.

Each JSONL line is `{"prompt": ..., "completion": ...}` (a user turn and the assistant's answer)
or `{"messages": [{"role", "content"}, ...]}`. The chat template (its text is in the step's
config, so in its hash) renders the record; the text each assistant turn adds is what the model
learns to write, and only its tokens (and the end-of-document token after the record) count in
the loss: a mask shard beside each token shard holds 1 for them and 0 for everything else.
A record is never cut: it goes whole to the train or the held-out split (by its index, as split
blocks do), and training windows that pack several records read each token's own mask.

The template runs in Jinja's immutable sandbox (as transformers renders it), bounded in time and
memory (`config/templates.py`): it can format the record and nothing else, and every failure is
one line naming the record. A record is data too: a line longer than `RECORD_BYTES`, or text that
is not Unicode (a lone surrogate), is refused with one line; text of a special token inside a
message's content is encoded as plain text, never as the control token (it could end a record
or fake a turn). Needs no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from buildtrain.config.steps import TextSettings
from buildtrain.config.templates import TemplateRefused, compile_template, one_line, render
from buildtrain.errors import StepFailed
from buildtrain.steps.data import split
from buildtrain.steps.data.documents import Recorder
from buildtrain.steps.data.index import token_width
from buildtrain.steps.data.shards import ShardWriter, finish
from buildtrain.steps.sources import Source, open_source
from buildtrain.steps.tokenizer.files import load

Message = dict[str, str]
ASSISTANT = "assistant"
RECORD_BYTES = 16 << 20  # one JSONL line: a record longer than this is refused, not tokenized


def records(path: Source | Path) -> Iterator[tuple[str, list[Message]]]:
    """(where, messages) for every non-blank line of a chat JSONL file."""
    with open_source(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {number}"
            if len(line) > RECORD_BYTES:
                raise StepFailed(
                    f"{where}: the record is {len(line)} bytes, more than {RECORD_BYTES}; split or drop it"
                )
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
        try:
            message["role"].encode("utf-8"), message["content"].encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (\ud800) is no text a tokenizer can read
            raise StepFailed(
                f"{where}: a message holds a lone surrogate, not Unicode text; fix the record"
            ) from None
    if not any(message["role"] == ASSISTANT for message in messages):
        raise StepFailed(f"{where}: no assistant turn (nothing to learn); add a completion")
    return messages


class Renderer:
    """A chat template compiled once in the bounded sandbox (`config/templates.py`)."""

    def __init__(self, template: str, end_of_document: str) -> None:
        def raise_exception(message: str) -> None:
            raise TemplateRefused(f"the template refused the record: {one_line(message)}")

        try:
            self.template = compile_template(template, trim_blocks=True, lstrip_blocks=True)
        except TemplateRefused as exc:
            raise StepFailed(f"data.chat_template: {exc}; fix the template") from None
        self.template.environment.globals["raise_exception"] = raise_exception
        self.end_of_document = end_of_document

    def render(self, messages: list[Message], prompt: bool, where: str = "a record") -> str:
        variables = {
            "messages": messages,
            "add_generation_prompt": prompt,
            "eos_token": self.end_of_document,
            "bos_token": "",
        }
        try:
            return render(self.template, variables)
        except TemplateRefused as exc:
            raise StepFailed(f"{where}: data.chat_template: {exc}") from None

    def segments(self, messages: list[Message], where: str) -> list[tuple[str, bool]]:
        """The rendered record as (text, learned) pieces: each assistant turn's own text is
        learned; the template's text before it (generation prompt included) is not."""
        pieces, done = [], ""
        for index, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            before = self.render(messages[:index], True, where)
            through = self.render(messages[: index + 1], False, where)
            if not before.startswith(done) or not through.startswith(before):
                raise StepFailed(
                    f"{where}: the chat template does not render a conversation as an extension of its "
                    "beginning, so the completion cannot be told apart; use another template"
                )
            pieces += [(before[len(done) :], False), (through[len(before) :], True)]
            done = through
        rest = self.render(messages, False, where)[len(done) :]
        return [*pieces, (rest, False)] if rest else pieces


def encoded(
    tokenizer: Any, pieces: list[tuple[str, bool]], end_of_document: int, plain: Sequence[str] = ()
) -> tuple[list[int], list[int]]:
    """Token ids and loss masks of a record's pieces, then the end-of-document token (learned:
    the model learns where an answer ends). The texts in `plain` (contents that hold a special
    token's text) are encoded with no special token recognised in them."""
    ids, masks = [], []
    for text, learned in pieces:
        found = []
        for part, literal in content_parts(text, plain):
            found += encode(tokenizer, part, literal)
        ids += found
        masks += [int(learned)] * len(found)
    return [*ids, end_of_document], [*masks, 1]


def content_parts(text: str, plain: Sequence[str]) -> list[tuple[str, bool]]:
    """`text` cut around each occurrence of a `plain` text: (part, whether it is one of them)."""
    if not plain:
        return [(text, False)]
    parts, at = [], 0
    while at < len(text):
        hits = [(text.find(p, at), -len(p), p) for p in plain if text.find(p, at) >= 0]
        if not hits:
            break
        start, _, found = min(hits)
        parts += [(text[at:start], False), (found, True)]
        at = start + len(found)
    return [(part, literal) for part, literal in [*parts, (text[at:], False)] if part]


def encode(tokenizer: Any, text: str, literal: bool) -> list[int]:
    if not literal:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    tokenizer.encode_special_tokens = True  # a special token's text is plain text here
    try:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    finally:
        tokenizer.encode_special_tokens = False


def with_special_text(
    messages: list[Message], specials: Sequence[str], where: str, rendered: str
) -> list[str]:
    """The contents of `messages` that hold a special token's text; each must appear verbatim
    in the rendered record, so that it can be encoded as plain text (or the record is refused)."""
    found = [m["content"] for m in messages if any(s in m["content"] for s in specials)]
    for content in found:
        if content not in rendered:
            raise StepFailed(
                f"{where}: a message holds the text of a special token and the chat template changes it, "
                "so it cannot be kept from acting as a control token; remove the token's text"
            )
    return found


def special_texts(tokenizer: Any) -> list[str]:
    """The text of every special token of `tokenizer`."""
    return [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content]


def record_text(messages: list[Message]) -> str:
    """A record as the contamination check reads it (documents, n-grams): its turns' contents."""
    return "".join(str(message["content"]) for message in messages)


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
    specials = special_texts(tokenizer)
    writers = {s: ShardWriter(out, s, shard_tokens, width) for s in ("train", "heldout")}
    masks = {s: ShardWriter(out, f"{s}-mask", shard_tokens, 1) for s in ("train", "heldout")}
    runs = split.SplitRuns(text.split_seed, text.heldout_fraction)
    recorder = Recorder()  # each record's turns as one document, for the contamination check
    count = 0
    for source in sources:
        for where, messages in records(source):
            recorder.add_text(record_text(messages))
            pieces = renderer.segments(messages, where)
            plain = with_special_text(messages, specials, where, "".join(p for p, _ in pieces))
            ids, mask = encoded(tokenizer, pieces, description["end_of_document"], plain)
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
