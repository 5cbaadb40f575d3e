"""The data step: deterministic, name-blind byte tokenization, split into held-out blocks, sharded."""

from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path
from typing import Any

import attrs
import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.config.schema import END_OF_DOCUMENT, DataConfig, SyntheticConfig
from buildtrain.config.steps import BYTES, DataStep
from buildtrain.errors import StepFailed
from buildtrain.kinds.data import data_view
from buildtrain.steps import formats
from buildtrain.steps.data import index as data_index
from buildtrain.steps.data import split as split_module
from buildtrain.steps.data import step as data
from buildtrain.steps.data.shards import ShardWriter
from buildtrain.steps.seeds import derive_unit
from buildtrain.steps.text import arithmetic_document
from buildtrain.store.objects import hash_file
from buildtrain.store.tensors import tensor_digest


class FakeLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.events.append(("warning", event, fields))


def spec_of(config: DataConfig) -> DataStep:
    """The data step's config as the plan holds it, typed as the step types it."""
    return DataStep.from_config({"data": data_view(config), "tokenizer": attrs.asdict(BYTES)})


def synthetic(**overrides: Any) -> DataConfig:
    settings_ = {
        "synthetic": SyntheticConfig(documents=60, lines=4, seed=3),
        "split_block": 16,
        "shard_tokens": 1024,
        "heldout_fraction": 0.2,
        **overrides,
    }
    return DataConfig(**settings_)


def files_config(**overrides: Any) -> DataConfig:
    settings_ = {
        "source": "files",
        "files": ("*.txt",),
        "split_block": 16,
        "shard_tokens": 1024,
        "heldout_fraction": 0.25,
        **overrides,
    }
    return DataConfig(**settings_)


def in_plan_order(paths: list[Path]) -> list[Path]:
    """Sources as the plan lists them and the executor hands them over: by (blake3, size)."""
    return sorted(paths, key=hash_file)


def build(config: DataConfig, sources: list[Path], out: Path) -> tuple[dict[str, str], dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    digests = data.build(spec_of(config), sources, out, FakeLog())
    return digests, json.loads((out / data_index.DATA_INDEX).read_bytes())


def split_tokens(out: Path, index: dict[str, Any], split: str) -> list[int]:
    raw = b"".join((out / shard["file"]).read_bytes() for shard in index["splits"][split]["shards"])
    return [int.from_bytes(raw[i : i + 2], "little") for i in range(0, len(raw), 2)]


def reassemble(out: Path, index: dict[str, Any], config: DataConfig) -> list[int]:
    """Undo the split: block b of the corpus went to held-out iff its keyed unit is < fraction."""
    parts = {split: split_tokens(out, index, split) for split in ("train", "heldout")}
    positions = {"train": 0, "heldout": 0}
    stream: list[int] = []
    block = 0
    while any(positions[s] < len(parts[s]) for s in parts):
        held_out = derive_unit(config.split_seed, "heldout", block) < config.heldout_fraction
        split = "heldout" if held_out else "train"
        stream += parts[split][positions[split] : positions[split] + config.split_block]
        positions[split] += config.split_block
        block += 1
    return stream


def expected_tokens(documents: list[bytes]) -> list[int]:
    tokens: list[int] = []
    for document in documents:
        tokens += [*document, END_OF_DOCUMENT]
    return tokens


def test_synthetic_build_is_deterministic(tmp_path: Path) -> None:
    config = synthetic()
    first, index_one = build(config, [], tmp_path / "one")
    second, index_two = build(config, [], tmp_path / "two")
    assert first == second
    assert index_one == index_two
    assert (tmp_path / "one" / data_index.DATA_INDEX).read_bytes() == (
        tmp_path / "two" / data_index.DATA_INDEX
    ).read_bytes()
    for name in first:
        if name != "data":
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    other, _ = build(synthetic(synthetic=SyntheticConfig(documents=60, lines=4, seed=4)), [], tmp_path / "x")
    assert other["data"] != first["data"]


def test_synthetic_tokens_are_the_documents_plus_end_of_document(tmp_path: Path) -> None:
    config = synthetic()
    _, index = build(config, [], tmp_path)
    documents = [arithmetic_document(3, i, 4) for i in range(60)]
    assert all(document.count(b"\n") == 4 and b"+" in document for document in documents)
    assert reassemble(tmp_path, index, config) == expected_tokens(documents)
    assert index["documents"] == 60


# Enough text (about 8 blocks or more) that a split is rarely empty, and sometimes an empty document.
documents_strategy = st.builds(
    lambda texts, empty: [*texts, b""] if empty else texts,
    st.lists(st.binary(min_size=40, max_size=150), min_size=3, max_size=6),
    st.booleans(),
)


@settings(max_examples=25, deadline=None)
@given(documents=documents_strategy, block=st.sampled_from([16, 17, 23]), seed=st.integers(0, 50))
def test_file_tokens_are_raw_bytes_plus_end_of_document_in_digest_order(
    documents: list[bytes], block: int, seed: int
) -> None:
    config = files_config(split_block=block, split_seed=seed, heldout_fraction=0.5)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        paths = []
        for number, document in enumerate(documents):
            (root / f"doc{number}.txt").write_bytes(document)
            paths.append(root / f"doc{number}.txt")
        ordered = in_plan_order(paths)
        try:
            _, index = build(config, ordered, root / "out")
        except StepFailed:  # too little text for both splits: covered by its own test
            return
        contents = [path.read_bytes() for path in ordered]
        assert reassemble(root / "out", index, config) == expected_tokens(contents)
        total = sum(len(document) + 1 for document in documents)
        assert index["splits"]["train"]["tokens"] + index["splits"]["heldout"]["tokens"] == total


@settings(max_examples=25, deadline=None)
@given(
    documents=documents_strategy,
    block=st.sampled_from([16, 17, 23]),
    window=st.integers(1, 5),
    chunk=st.integers(1, 64),
    bulk=st.integers(1, 3),
)
def test_routing_by_runs_does_not_depend_on_the_window_or_the_chunks_read(
    documents: list[bytes], block: int, window: int, chunk: int, bulk: int
) -> None:
    """The split is decided `split.WINDOW` blocks ahead, bytes arrive in chunks of any size, and
    whole blocks go by mask or by runs: a run of blocks cut by a window's end or a chunk's must
    still land where the per-block rule sends each block, with the same shards and digests as
    the defaults give."""
    config = files_config(split_block=block, heldout_fraction=0.5)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        paths = []
        for number, document in enumerate(documents):
            (root / f"doc{number}.txt").write_bytes(document)
            paths.append(root / f"doc{number}.txt")
        ordered = in_plan_order(paths)
        try:
            default, _ = build(config, ordered, root / "default")
        except StepFailed:  # too little text for both splits: covered by its own test
            return
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(split_module, "WINDOW", window)
            patch.setattr(formats, "READ_CHUNK", chunk)
            patch.setattr(data, "BULK_BLOCKS", bulk)  # whole blocks by mask from 1, 2 or 3 on
            small, index = build(config, ordered, root / "small")
        assert small == default
        assert reassemble(root / "small", index, config) == expected_tokens([p.read_bytes() for p in ordered])


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 65535), min_size=1, max_size=300),
    cuts=st.lists(st.integers(1, 40), min_size=1, max_size=20),
    shard_tokens=st.integers(1, 70),
)
def test_shards_do_not_depend_on_how_tokens_are_handed_over(
    tokens: list[int], cuts: list[int], shard_tokens: int
) -> None:
    """Tokens written in pieces of any size: the same shard files and digests as one write of
    them all, each shard's digest of its own bytes."""
    array = np.array(tokens, dtype="<u2")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "whole").mkdir()
        (root / "pieces").mkdir()
        whole = ShardWriter(root / "whole", "train", shard_tokens)
        whole.write(array)
        whole.close()
        pieces = ShardWriter(root / "pieces", "train", shard_tokens)
        position = 0
        for cut in itertools.cycle(cuts):
            if position >= len(array):
                break
            pieces.write(array[position : position + cut])
            position += cut
        pieces.close()
        assert pieces.shards == whole.shards
        assert sum(shard["tokens"] for shard in whole.shards) == len(tokens)
        for shard in whole.shards:
            raw = (root / "pieces" / shard["file"]).read_bytes()
            assert raw == (root / "whole" / shard["file"]).read_bytes()
            assert shard["digest"] == tensor_digest(shard["file"], "u16", [len(raw) // 2], raw)
        assert b"".join((root / "whole" / s["file"]).read_bytes() for s in whole.shards) == array.tobytes()


def test_tokens_do_not_depend_on_file_names_or_places(tmp_path: Path) -> None:
    contents = [b"first document\n" * 20, b"second one, longer\n" * 30, bytes(range(256)) * 3]
    by_digest = sorted(contents, key=lambda c: blake3.blake3(c).hexdigest())
    # Name the files so that name order is digest order in one folder and the reverse in the other.
    one, two = tmp_path / "here", tmp_path / "elsewhere" / "deeper"
    one.mkdir()
    two.mkdir(parents=True)
    for rank, content in enumerate(by_digest):
        (one / f"{rank}.txt").write_bytes(content)
        (two / f"z{len(contents) - rank}.text").write_bytes(content)
    first_sources = in_plan_order(sorted(one.iterdir()))
    second_sources = in_plan_order(sorted(two.iterdir()))
    assert [p.name for p in sorted(two.iterdir())] != [p.name for p in second_sources]
    first, _ = build(files_config(), first_sources, tmp_path / "out-one")
    second, _ = build(files_config(), second_sources, tmp_path / "out-two")
    assert first == second


def test_read_chunk_boundaries_do_not_change_the_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.txt").write_bytes(b"0123456789abcdef" * 50)
    (tmp_path / "b.txt").write_bytes(b"some other text\n" * 40)
    sources = in_plan_order([tmp_path / "a.txt", tmp_path / "b.txt"])
    reference, _ = build(files_config(), sources, tmp_path / "reference")
    monkeypatch.setattr(formats, "READ_CHUNK", 7)  # the readers moved to steps/formats.py
    chunked, _ = build(files_config(), sources, tmp_path / "chunked")
    assert chunked == reference


def test_shards_hold_at_most_shard_tokens_and_are_described_exactly(tmp_path: Path) -> None:
    config = synthetic(shard_tokens=1024, heldout_fraction=0.1)
    digests, index = build(config, [], tmp_path)
    train_shards = index["splits"]["train"]["shards"]
    assert len(train_shards) >= 2  # the corpus is big enough to need several shards
    for split in ("train", "heldout"):
        shards = index["splits"][split]["shards"]
        assert [s["file"] for s in shards] == [f"{split}-{n:05d}.bin" for n in range(len(shards))]
        for number, shard in enumerate(shards):
            raw = (tmp_path / shard["file"]).read_bytes()
            assert shard["tokens"] == len(raw) // 2 and len(raw) % 2 == 0
            assert 1 <= shard["tokens"] <= config.shard_tokens
            if number < len(shards) - 1:
                assert shard["tokens"] == config.shard_tokens  # only the last shard is short
            assert shard["digest"] == tensor_digest(shard["file"], "u16", [shard["tokens"]], raw)
            assert digests[shard["file"]] == shard["digest"]
        assert index["splits"][split]["tokens"] == sum(s["tokens"] for s in shards)
    shards = {s["file"] for sp in index["splits"].values() for s in sp["shards"]}
    assert set(digests) == shards | {"data", "documents.u64"}  # no n-gram filter: the ngrams step records it


def test_train_plus_heldout_is_every_token(tmp_path: Path) -> None:
    config = synthetic()
    _, index = build(config, [], tmp_path)
    total = sum(len(arithmetic_document(3, i, 4)) + 1 for i in range(60))
    train, heldout = index["splits"]["train"]["tokens"], index["splits"]["heldout"]["tokens"]
    assert train + heldout == total
    assert 0 < heldout < train


def test_index_records_format_tokenizer_and_logs_the_build(tmp_path: Path) -> None:
    config = synthetic()
    log = FakeLog()
    tmp_path.mkdir(exist_ok=True)
    data.build(spec_of(config), [], tmp_path, log)
    index = json.loads((tmp_path / data_index.DATA_INDEX).read_bytes())
    assert index["format"] == data_index.DATA_FORMAT
    assert index["tokenizer"] == {"type": "bytes", "vocab_size": 257, "end_of_document": END_OF_DOCUMENT}
    built = [fields for level, event, fields in log.events if event == "data_built"]
    assert built == [
        {
            "documents": 60,
            "train_tokens": index["splits"]["train"]["tokens"],
            "heldout_tokens": index["splits"]["heldout"]["tokens"],
            "blocks": built[0]["blocks"],
        }
    ]


def seed_sending_block_zero(to_heldout: bool, fraction: float) -> int:
    return next(s for s in range(10_000) if (derive_unit(s, "heldout", 0) < fraction) == to_heldout)


@pytest.mark.parametrize(("empty", "to_heldout"), [("heldout", False), ("train", True)])
def test_an_empty_split_fails_with_a_helpful_message(tmp_path: Path, empty: str, to_heldout: bool) -> None:
    (tmp_path / "tiny.txt").write_bytes(b"fifteen bytes!!")  # 16 tokens: a single split block
    seed = seed_sending_block_zero(to_heldout, 0.05)
    config = files_config(heldout_fraction=0.05, split_seed=seed)
    (tmp_path / "out").mkdir()
    with pytest.raises(StepFailed) as failure:
        data.build(spec_of(config), [tmp_path / "tiny.txt"], tmp_path / "out", FakeLog())
    message = str(failure.value)
    assert f"the {empty} split is empty" in message
    assert "data.split_block" in message and "data.heldout_fraction" in message
