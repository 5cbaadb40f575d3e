"""The tokenizer step: a byte-level BPE trained on a stage's training text, or a given file checked.

Output: `tokenizer.json` (Hugging Face `tokenizers` format, what the data step encodes with and the
export ships) and `description.json` (its kind, vocabulary size and end-of-document id). Training
reads only the pieces of text that the data step will put in the train split (see `pieces`), never
the held-out ones. It is deterministic: the BPE trainer breaks ties between equally frequent pairs
by pair id and serializes its vocabulary in id order, so the same text gives the same bytes at any
thread count (tests/test_tokenizer.py checks it across processes and RAYON_NUM_THREADS). Needs no
torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.convert import converter
from buildtrain.errors import StepFailed
from buildtrain.steps.formats import open_source
from buildtrain.steps.pieces import pieces
from buildtrain.steps.text import TextSettings, corpus
from buildtrain.store.objects import hash_file, write_bytes_durably

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext

TOKENIZER = "tokenizer.json"
DESCRIPTION = "description.json"
TRAIN_BATCH = 1024  # pieces handed to the trainer at a time


@attrs.frozen(kw_only=True)
class TokenizerSettings:
    """A tokenizer step's settings as the plan holds them (`plan/tokenizers.tokenizer_view`): a
    given file has no vocabulary size or frequency of its own to set."""

    kind: str
    end_of_document: str
    vocab_size: int | None = None
    min_frequency: int | None = None


@attrs.frozen(kw_only=True)
class TokenizerStep:
    """A tokenizer step's config, typed: the tokenizer, and the text a BPE is trained on."""

    tokenizer: TokenizerSettings
    text: TextSettings | None = None  # None for a given file

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TokenizerStep:
        """From the plan's step config (`Step.config`), which stays a plain dict for the hash."""
        return converter.structure(config, cls)


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    step = TokenizerStep.from_config(ctx.step.config)
    settings = step.tokenizer
    if step.text is None:
        (source,) = ctx.sources
        with open_source(source) as handle:  # a regular file only: a FIFO would block forever
            raw = handle.read()  # once: the bytes checked are the bytes stored
        tokenizer = load_given(source, raw, settings.end_of_document)
    else:
        tokenizer = train_bpe(step.text, ctx.sources, settings)
        raw = tokenizer.to_str().encode("utf-8")
        ctx.log.info("tokenizer_trained", vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))
    write_bytes_durably(out / TOKENIZER, raw)
    description = describe(tokenizer, settings.kind, settings.end_of_document)
    write_bytes_durably(out / DESCRIPTION, canonical_bytes(description))
    return {"tokenizer": digest("tokenizer", {"file": hash_file(out / TOKENIZER)[0], **description})}


def new_bpe() -> Any:
    """An empty byte-level BPE: every byte is a symbol, so any text can be encoded (no unknowns)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe(text: TextSettings, sources: list[Path], settings: TokenizerSettings) -> Any:
    """Train on the train split's pieces of the corpus, in corpus order."""
    from tokenizers import pre_tokenizers, trainers

    tokenizer = new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        min_frequency=settings.min_frequency,
        special_tokens=[settings.end_of_document],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_train_batches(text, sources), trainer=trainer)
    return tokenizer


def _train_batches(text: TextSettings, sources: list[Path]) -> Iterator[list[str]]:
    batch: list[str] = []
    for piece in pieces(text, corpus(text, sources)):
        if not piece.held_out:
            batch.append(piece.text)
            if len(batch) == TRAIN_BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def load_given(path: Path, raw: bytes, end_of_document: str) -> Any:
    """A tokenizer file the preset names, refused with its path unless it loads and has the
    end-of-document token."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except (UnicodeDecodeError, Exception) as exc:  # the library raises a bare Exception
        raise StepFailed(
            f"{path}: not a Hugging Face tokenizer.json ({exc}); give the file that a tokenizer saved (Tokenizer.save)"
        ) from None
    if tokenizer.token_to_id(end_of_document) is None:
        raise StepFailed(
            f"{path}: has no token {end_of_document!r}; set data.tokenizer.end_of_document to the token "
            "that ends a document in this vocabulary"
        )
    return tokenizer


def describe(tokenizer: Any, kind: str, end_of_document: str) -> dict[str, Any]:
    """What the data step, training (the embedding size) and export need to know."""
    vocabulary = tokenizer.get_vocab(with_added_tokens=True)
    return {
        "type": kind,
        "vocab_size": max(vocabulary.values()) + 1,  # ids need not be contiguous in a given file
        "end_of_document": tokenizer.token_to_id(end_of_document),
        "end_of_document_token": end_of_document,
    }


def load(folder: Path) -> tuple[Any, dict[str, Any]]:
    """A tokenizer step's output: the tokenizer and its description."""
    import json

    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / TOKENIZER)), json.loads((folder / DESCRIPTION).read_bytes())


BYTE_END_OF_DOCUMENT = "<|endoftext|>"


def byte_level_json(end_of_document: int) -> bytes:
    """The byte tokenizer as a `tokenizers` file: id b for byte b, `<|endoftext|>` at
    `end_of_document`. A byte-level BPE with no merges and no regex split encodes every text to
    exactly its UTF-8 bytes, so transformers reads the same ids buildtrain trained on. Written out
    here (canonical JSON), not serialized by the library, so the export's bytes do not depend on
    the `tokenizers` release (the export step's hash does not name it)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": end_of_document,
                "content": BYTE_END_OF_DOCUMENT,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {character: byte for byte, character in _gpt2_byte_map().items()},
            "merges": [],
        },
    }
    return canonical_bytes(document)


def _gpt2_byte_map() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters (what ByteLevel uses)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes, strict=True)}


def export_files(inputs: dict[str, Path], described: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """(tokenizer.json bytes, description) of what a plan's export ships: the tokenizer step's
    output, or the byte tokenizer (`described` is then the plan's byte description)."""
    import json

    if "tokenizer" in inputs:
        folder = inputs["tokenizer"]
        return (folder / TOKENIZER).read_bytes(), json.loads((folder / DESCRIPTION).read_bytes())
    description = {**described, "end_of_document_token": BYTE_END_OF_DOCUMENT}
    return byte_level_json(described["end_of_document"]), description
