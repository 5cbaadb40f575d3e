"""The tokenizer step: a byte-level BPE trained on a stage's training text, or a given file checked.

Output: `tokenizer.json` (Hugging Face `tokenizers` format, what the data step encodes with and the
export ships) and `description.json` (its kind, vocabulary size and end-of-document id); how the
steps downstream read them is `tokenizer_files.py`. Training
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

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.steps import TextSettings, TokenizerSettings, TokenizerStep
from buildtrain.errors import StepFailed
from buildtrain.sources.durable import write_bytes_durably
from buildtrain.steps.corpus import corpus
from buildtrain.steps.sources import Source, read_source
from buildtrain.steps.tokenizer.files import DESCRIPTION, TOKENIZER
from buildtrain.steps.tokenizer.pieces import pieces
from buildtrain.store.objects import hash_file

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext

TRAIN_BATCH = 1024  # pieces handed to the trainer at a time


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    step = TokenizerStep.from_config(ctx.step.config)
    settings = step.tokenizer
    if step.text is None:
        (source,) = ctx.sources
        raw = read_source(source)  # once: the bytes checked (also against the plan) are the bytes stored
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


def train_bpe(text: TextSettings, sources: list[Source], settings: TokenizerSettings) -> Any:
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


def _train_batches(text: TextSettings, sources: list[Source]) -> Iterator[list[str]]:
    batch: list[str] = []
    for piece in pieces(text, corpus(text, sources)):
        if not piece.held_out:
            batch.append(piece.text)
            if len(batch) == TRAIN_BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def load_given(path: Source | Path, raw: bytes, end_of_document: str) -> Any:
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
