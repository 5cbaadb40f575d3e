"""A tokenizer step's output as the steps that read it see it: the file names, loading the
tokenizer (the data step encodes with it), and the tokenizer.json an export ships (the tokenizer
step's, or the byte tokenizer written out). The BPE trainer stays in `tokenizer.py`, outside the
code hash of the data and export steps. Needs no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from buildtrain.canonical import canonical_bytes
from buildtrain.store.layout import TOKENIZER_DESCRIPTION as DESCRIPTION
from buildtrain.store.layout import TOKENIZER_FILE as TOKENIZER


def load(folder: Path) -> tuple[Any, dict[str, Any]]:
    """A tokenizer step's output: the tokenizer and its description."""
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
    if "tokenizer" in inputs:
        folder = inputs["tokenizer"]
        return (folder / TOKENIZER).read_bytes(), json.loads((folder / DESCRIPTION).read_bytes())
    description = {**described, "end_of_document_token": BYTE_END_OF_DOCUMENT}
    return byte_level_json(described["end_of_document"]), description
