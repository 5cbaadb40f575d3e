"""The vocabulary of a given tokenizer.json, read at `bt plan` without the tokenizers library: the
same number the library gives when the step loads the file, and one line for a hostile file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buildtrain.config import vocabulary
from buildtrain.config.vocabulary import MAX_VOCAB_SIZE, Vocabulary, VocabularyError, read_vocabulary
from buildtrain.sources.stat_cache import StatCache

TOKENS = st.text("abcdefgh", min_size=1, max_size=3)


def tokenizer_json(kind: str, vocab: dict[str, int], added: list[tuple[str, int, bool]]) -> dict[str, Any]:
    if kind == "WordLevel":
        model: dict[str, Any] = {"type": "WordLevel", "vocab": vocab, "unk_token": next(iter(vocab))}
    elif kind == "BPE":
        model = {"type": "BPE", "vocab": vocab, "merges": [], "unk_token": None}
    else:
        model = {"type": "Unigram", "vocab": [[token, -1.0] for token in vocab], "unk_id": 0}
    tokens = [
        {
            "id": i,
            "content": c,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": s,
        }
        for c, i, s in added
    ]
    return {"version": "1.0", "model": model, "added_tokens": tokens}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kind=st.sampled_from(["WordLevel", "BPE", "Unigram"]),
    vocab=st.dictionaries(TOKENS, st.integers(0, 3000), min_size=1, max_size=8),
    added=st.lists(st.tuples(TOKENS, st.integers(0, 10**6), st.booleans()), max_size=5),
)
def test_the_vocabulary_is_the_one_the_tokenizers_library_loads(tmp_path_factory, kind, vocab, added) -> None:
    """Largest id + 1 as the library assigns ids, sparse vocabularies and added tokens included
    (the library gives an added token its own next id, whatever id the file writes)."""
    from tokenizers import Tokenizer

    document = tokenizer_json(kind, vocab, added)
    try:
        loaded = Tokenizer.from_str(json.dumps(document))
    except Exception:  # the library refuses it: so does the tokenizer step, at run time
        return
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(json.dumps(document))
    ids = loaded.get_vocab(with_added_tokens=True).values()
    assert read_vocabulary(path) == Vocabulary(size=max(ids) + 1, tokens=len(set(ids)))


def test_one_id_of_50_million_makes_a_vocabulary_of_50_million_and_one(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json("BPE", {"a": 0, "b": 1, "c": 50_000_000}, [])))
    assert read_vocabulary(path) == Vocabulary(size=50_000_001, tokens=3)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"\xff\xfe", "not a Hugging Face tokenizer.json"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deep to read"),
        (b"{}", "no model.vocab"),
        (b'{"model": {"vocab": "abc"}}', "no model.vocab"),
        (b'{"model": {"vocab": {"a": -1}}}', "model.vocab has the id -1"),
        (b'{"model": {"vocab": {"a": 1.5}}}', "model.vocab has the id 1.5"),
        (b'{"model": {"vocab": {"a": true}}}', "model.vocab has the id True"),
        (b'{"model": {"vocab": {"a": "7"}}}', "model.vocab has the id '7'"),
        (b'{"model": {"vocab": [1, 2]}}', "a piece that is not [text, score]"),
        (b'{"model": {"vocab": {"a": 0}}, "added_tokens": 3}', "added_tokens is int, not a list"),
        (b'{"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 1}]}', "an added token has no content"),
        (b'{"model": {"vocab": {}}}', "it declares no token"),
        (
            b'{"model": {"vocab": {"a": %d}}}' % MAX_VOCAB_SIZE,
            "past the 4,294,967,296 ids a token shard holds",
        ),
        (b'{"model": {"vocab": {"a": 1%s}}}' % (b"0" * 5000), "not a Hugging Face tokenizer.json"),
    ],
)
def test_a_hostile_tokenizer_file_is_refused_in_one_line(tmp_path: Path, content: bytes, said: str) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(VocabularyError) as caught:
        read_vocabulary(path)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_a_vocabulary_is_remembered_by_content_in_the_stat_cache(tmp_path: Path, monkeypatch) -> None:
    """Parsing a 10 MB tokenizer.json took 200-300 ms of every `bt plan`; its content's digest
    finds it again, and an edited file is read afresh."""
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json("BPE", {"a": 0, "b": 7}, [])))
    old = time.time() - 3600  # outside the stat cache's racy window
    os.utime(path, (old, old))
    cache = StatCache(tmp_path / "files.json")
    assert read_vocabulary(path, cache) == Vocabulary(size=8, tokens=2)
    cache.save()
    cache = StatCache(tmp_path / "files.json")
    monkeypatch.setattr(vocabulary, "_parse", lambda raw: pytest.fail("parsed again"))
    assert read_vocabulary(path, cache) == Vocabulary(size=8, tokens=2)
    monkeypatch.undo()
    path.write_text(json.dumps(tokenizer_json("BPE", {"a": 0, "b": 9}, [])))
    assert read_vocabulary(path, cache) == Vocabulary(size=10, tokens=2)


def test_a_file_that_changes_while_read_is_not_remembered(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json("BPE", {"a": 0}, [])))
    cache = StatCache(tmp_path / "files.json")
    source = cache.digest_of(path)
    cache.remember("vocabulary", b"other bytes", source, [5, 5])
    assert cache.derived_fact("vocabulary", source) is None
    cache.remember("vocabulary", path.read_bytes(), source, [1, 1])
    assert cache.derived_fact("vocabulary", source) == [1, 1]
