"""A data step's output as the steps that read it see it: the index file, its format and the width
of a shard's token ids. The data step writes them (`shards.py`); the train and eval steps read
them through this module alone, so none of the data step's readers, tokenizers or writers enters
their code hash. Torch-free, numpy-free."""

from __future__ import annotations

from typing import Any

from buildtrain.config.schema import BYTE_VOCAB_SIZE, ModelConfig
from buildtrain.errors import StepFailed
from buildtrain.store.layout import DATA_INDEX  # noqa: F401 (its readers take the name from here)

DATA_FORMAT = 1
U16_IDS = 1 << 16  # ids a uint16 shard can hold; a larger vocabulary gets uint32 shards


def token_width(vocab_size: int) -> int:
    """Bytes per token id in a shard."""
    return 2 if vocab_size <= U16_IDS else 4


def vocab_size(index: dict[str, Any]) -> int:
    """The size of the vocabulary a data step's tokens come from, as its `data.json` records it."""
    return int(index["tokenizer"].get("vocab_size", BYTE_VOCAB_SIZE))


def embedding_rows(model: ModelConfig, index: dict[str, Any]) -> int:
    """Rows of the model's embedding: the tokenizer's vocabulary, or a checkpoint's own embedding
    (which may have more rows than its tokenizer has ids, never fewer)."""
    ids = vocab_size(index)
    if not model.vocab_size:
        return ids
    if ids > model.vocab_size:
        raise StepFailed(
            f"the tokenizer has {ids} ids but the model's embedding only {model.vocab_size} rows; "
            "use the checkpoint's own tokenizer (leave data.tokenizer out)"
        )
    return model.vocab_size


def records_end(index: dict[str, Any]) -> int | None:
    """The token that ends each record of chat data (whose splits carry loss masks), else None:
    training and evaluation keep attention within a record there."""
    if "masks" not in index["splits"]["train"]:
        return None
    return int(index["tokenizer"]["end_of_document"])
