"""The vocabulary a given `tokenizer.json` declares, read at `bt plan` without the tokenizers library.

The model's vocabulary is the tokenizer's largest id + 1 (ids need not be contiguous), and the
embedding, the output layer and the logits grow with it: one id of 50,000,000 in a file of 300
tokens asks for a 50M-row embedding. Pre-flight sizes the model by this number, so such a file is
refused at `bt plan` with the file and the numbers, not found out by a train step killed for memory.
The file is untrusted: anything but a regular file, JSON that is not a tokenizer, ids that are not
non-negative integers or past what a token shard holds, are refused with one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from buildtrain.sources.regular import open_regular
from buildtrain.sources.stat_cache import StatCache

# Token shards hold uint32 ids (steps/data/tokenized.py), so no larger vocabulary can be trained on.
MAX_VOCAB_SIZE = 1 << 32
# The largest tokenizer.json in common use (a 256k vocabulary) is about 35 MB; a file past this
# is not a tokenizer, and parsing it at every `bt plan` would cost seconds and gigabytes.
MAX_TOKENIZER_BYTES = 1 << 30


class VocabularyError(ValueError):
    """A tokenizer file whose vocabulary cannot be read; the message reads after the path."""


@attrs.frozen(kw_only=True)
class Vocabulary:
    """The ids a tokenizer file declares: the model's vocabulary is `size`."""

    size: int  # the largest id + 1
    tokens: int  # how many ids are listed (fewer than `size` when ids are skipped)


def read_vocabulary(path: Path, cache: StatCache | None = None) -> Vocabulary:
    """The vocabulary of the tokenizer.json at `path` (`OSError` if it cannot be read,
    `VocabularyError` if it is not a tokenizer); remembered by content in `cache`, if given."""
    source = cache.digest_of(path) if cache is not None else None
    if cache is not None and source is not None:
        known = cache.derived_fact("vocabulary", source)
        if isinstance(known, list) and len(known) == 2 and all(type(n) is int and n > 0 for n in known):
            return Vocabulary(size=known[0], tokens=known[1])
    with open_regular(path) as handle:
        raw = handle.read(MAX_TOKENIZER_BYTES + 1)
    vocabulary = _parse(raw)
    if cache is not None and source is not None:
        cache.remember("vocabulary", raw, source, [vocabulary.size, vocabulary.tokens])
    return vocabulary


def _parse(raw: bytes) -> Vocabulary:
    if len(raw) > MAX_TOKENIZER_BYTES:
        raise VocabularyError(f"larger than {MAX_TOKENIZER_BYTES >> 20} MiB, not a tokenizer.json")
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VocabularyError(f"not a Hugging Face tokenizer.json ({exc})") from None
    except ValueError as exc:  # a limit of the parser: an integer of thousands of digits
        raise VocabularyError(f"not a Hugging Face tokenizer.json ({str(exc).partition(':')[0]})") from None
    except RecursionError:
        raise VocabularyError("not a Hugging Face tokenizer.json (nested too deep to read)") from None
    return vocabulary_of(document)


def vocabulary_of(document: Any) -> Vocabulary:
    """The ids of a parsed tokenizer.json as the tokenizers library assigns them when it loads the
    file: the model's vocabulary (a table of token -> id, or Unigram's list of pieces, whose ids
    are their places), then each added token (`added_ids`)."""
    model = document.get("model") if isinstance(document, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = document.get("added_tokens", []) if isinstance(document, dict) else None
    if isinstance(vocab, dict):
        known = vocab
    elif isinstance(vocab, list):
        known = {_piece(entry): index for index, entry in enumerate(vocab)}
    else:
        raise VocabularyError("not a Hugging Face tokenizer.json (no model.vocab)")
    for token_id in known.values():
        if type(token_id) is not int or token_id < 0:
            raise VocabularyError(f"model.vocab has the id {token_id!r}; ids are integers from 0")
    if not isinstance(added, list):
        raise VocabularyError(f"added_tokens is {type(added).__name__}, not a list")
    ids = set(known.values()) | set(added_ids(known, len(vocab), added))
    if not ids:
        raise VocabularyError("not a Hugging Face tokenizer.json (it declares no token)")
    size = max(ids) + 1
    if size > MAX_VOCAB_SIZE:
        raise VocabularyError(
            f"its largest id is {size - 1:,}: past the {MAX_VOCAB_SIZE:,} ids a token shard holds"
        )
    return Vocabulary(size=size, tokens=len(ids))


def added_ids(known: dict[str, int], model_size: int, added: list[Any]) -> list[int]:
    """The ids the library gives the added tokens the model does not know (a token of the model's
    vocabulary keeps its id): the next id after the model's entries (their count, not their
    largest id) and after the added tokens before it. The ids written in the file are not used (the library
    only warns when they differ), so a file cannot claim a larger vocabulary through them."""
    assigned: dict[str, int] = {}  # the added tokens the model does not know
    for token in added:
        content = token.get("content") if isinstance(token, dict) else None
        if not isinstance(content, str):
            raise VocabularyError("an added token has no content; not a Hugging Face tokenizer.json")
        if content in assigned or content in known:
            continue
        last = max(assigned.values(), default=None)
        assigned[content] = model_size if last is None or (last < model_size and model_size) else last + 1
    return list(assigned.values())


def _piece(entry: Any) -> str:
    if isinstance(entry, list) and entry and isinstance(entry[0], str):
        return entry[0]
    raise VocabularyError("model.vocab lists a piece that is not [text, score]")
