"""JSONL and Parquet sources: the same documents give the same tokens as plain text files, with
the byte tokenizer and with a trained one; a malformed line or a missing key stops the step with
the file, line or row group and key, and nothing reaches the store."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, BtRunner, plan_hash, time_bound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_data_step import FakeLog

from buildtrain.config.schema import DataConfig, TokenizerConfig
from buildtrain.config.steps import BYTES
from buildtrain.errors import StepFailed
from buildtrain.kinds.data import data_view
from buildtrain.sources.durable import write_bytes_durably
from buildtrain.steps.data import step as data
from buildtrain.steps.tokenizer import step as tokenizer

DOCUMENTS = st.lists(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=300), min_size=1, max_size=12
)
COMMON = {
    "source": "files",
    "files": ("x",),
    "split_block": 32,
    "shard_tokens": 1024,
    "heldout_fraction": 0.25,
}


def spec(format: str, tokenized: bool) -> dict[str, Any]:
    config = DataConfig(**COMMON, format=format, tokenizer=TokenizerConfig() if tokenized else "bytes")
    view = data_view(config)
    return {"config": {"data": view} if tokenized else {"data": view, "tokenizer": attrs.asdict(BYTES)}}


def write_sources(folder: Path, documents: list[str]) -> dict[str, list[Path]]:
    """The same documents as plain files (one each, in order), one JSONL file and one Parquet file
    of small row groups."""
    folder.mkdir(parents=True, exist_ok=True)
    plain = []
    for index, text in enumerate(documents):
        plain.append(folder / f"{index}.txt")
        plain[-1].write_bytes(text.encode("utf-8"))
    with open(folder / "c.jsonl", "w", encoding="utf-8") as handle:
        for text in documents:
            handle.write(json.dumps({"id": 1, "text": text}) + "\n")
    pq.write_table(
        pa.table({"text": documents, "n": list(range(len(documents)))}),
        folder / "c.parquet",
        row_group_size=3,
    )
    return {"text": plain, "jsonl": [folder / "c.jsonl"], "parquet": [folder / "c.parquet"]}


def byte_level_tokenizer(folder: Path) -> Path:
    """A tokenizer step's output for a tiny BPE over a fixed text (shared by every example)."""
    folder.mkdir(parents=True, exist_ok=True)
    trained = tokenizer.new_bpe()
    from tokenizers import pre_tokenizers, trainers

    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    trained.train_from_iterator(["hello world, tokens merge into words " * 20], trainer=trainer)
    write_bytes_durably(folder / tokenizer.TOKENIZER, trained.to_str().encode())
    description = tokenizer.describe(trained, "bpe", "<|endoftext|>")
    write_bytes_durably(folder / tokenizer.DESCRIPTION, json.dumps(description).encode())
    return folder


def shards(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.glob("*.bin"))}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(documents=DOCUMENTS, tokenized=st.booleans())
def test_jsonl_and_parquet_give_the_tokens_of_the_same_text_in_plain_files(
    tmp_path_factory: pytest.TempPathFactory, documents: list[str], tokenized: bool
) -> None:
    root = tmp_path_factory.mktemp("formats")
    sources = write_sources(root / "src", documents)
    tokenizer_dir = byte_level_tokenizer(root / "tok") if tokenized else None
    built = {}
    for format, paths in sources.items():
        out = root / format
        out.mkdir()
        try:
            digests = data.build_from_plan(
                spec(format, tokenized)["config"], paths, out, FakeLog(), tokenizer_dir
            )
        except StepFailed as exc:  # too little text for both splits: the same for every format
            built[format] = str(exc)
            continue
        built[format] = (digests, shards(out))
    assert built["jsonl"] == built["text"]
    assert built["parquet"] == built["text"]


def failure(tmp_path: Path, format: str, paths: list[Path], **extra: Any) -> str:
    view = {**spec(format, False)["config"]["data"], **extra}
    with pytest.raises(StepFailed) as caught:
        data.build_from_plan(
            {"data": view, "tokenizer": attrs.asdict(BYTES)},
            paths,
            tmp_path,
            FakeLog(),
        )
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_malformed_jsonl_line_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "broken\n')
    assert failure(tmp_path, "jsonl", [path]).startswith(f"{path}: line 3: not valid JSON")


def test_a_missing_jsonl_key_names_the_key_and_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    message = failure(tmp_path, "jsonl", [path])
    assert message.startswith(f"{path}: line 2: no key 'text' (keys: body)") and "data.text_field" in message
    path.write_text('{"text": 3}\n')
    assert "key 'text' is int, not a string" in failure(tmp_path, "jsonl", [path])


def test_parquet_problems_name_the_file_column_and_row_group(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["a", "b"]}), path)
    assert failure(tmp_path, "parquet", [path]).startswith(f"{path}: no column 'text' (columns: body)")
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), path, row_group_size=2)
    assert failure(tmp_path, "parquet", [path]).startswith(f"{path}: row group 1: column 'text' has 1 null")
    pq.write_table(pa.table({"text": [1, 2]}), path)
    assert "column 'text' is int64, not a string column" in failure(tmp_path, "parquet", [path])
    path.write_bytes(b"not parquet")
    assert "not a readable Parquet file" in failure(tmp_path, "parquet", [path])


def not_utf8_parquet(path: Path) -> None:
    """Four rows in two row groups; row 1 of group 1 holds bytes that are not UTF-8 (Arrow does not
    check a string column's bytes when it writes them)."""
    values = pa.array([b"one", b"two", b"three", b"\xff\xfe four"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": values}), path, row_group_size=2)


def test_bytes_that_are_not_utf8_name_the_file_row_group_column_and_row(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    not_utf8_parquet(path)
    assert failure(tmp_path, "parquet", [path]) == (
        f"{path}: row group 1: column 'text', row 1 of the group: not UTF-8 text (byte 0xff at 0); "
        "fix or drop the row"
    )


def test_a_jsonl_record_nested_too_deep_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    assert (
        failure(tmp_path, "jsonl", [path])
        == f"{path}: line 2: nested too deep to read; fix or remove the line"
    )


@pytest.mark.parametrize("format", ["text", "jsonl", "parquet"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link"])
def test_a_data_file_swapped_for_a_fifo_or_dev_zero_stops_the_step(
    tmp_path: Path, format: str, kind: str
) -> None:
    """After `bt run` located the file and before the step opened it: refused, never read."""
    path = tmp_path / "c.data"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    with time_bound(10, f"a data step reading a {kind}"):
        message = failure(tmp_path, format, [path])
    said = "a FIFO" if kind == "fifo" else "a device"
    assert message.startswith(f"{path}: is {said}, not a regular file; plan again")


@pytest.mark.parametrize("record", ["not-utf8", "too-deep"])
def test_an_unreadable_record_fails_the_run_in_one_line(tmp_path: Path, bt: BtRunner, record: str) -> None:
    if record == "not-utf8":
        name, format, said = (
            "c.parquet",
            "parquet",
            "row group 1: column 'text', row 1 of the group: not UTF-8",
        )
        not_utf8_parquet(tmp_path / name)
    else:
        name, format, said = "c.jsonl", "jsonl", "line 51: nested too deep to read"
        (tmp_path / name).write_text('{"text": "fine"}\n' * 50 + "[" * 100_000 + "\n")
    preset = tmp_path / "p.toml"
    preset.write_text(
        f'extends = "{REPO / "tests" / "presets" / "micro.toml"}"\n'
        f'[data]\nsource = "files"\nfiles = ["{name}"]\nformat = "{format}"\n'
    )
    result = bt("run", plan_hash(bt("plan", str(preset))))
    assert result.returncode == 1
    assert f"{tmp_path / name}: {said}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_record_fails_the_run_in_one_line_and_leaves_nothing_in_the_store(
    tmp_path: Path, bt: BtRunner, store: Path
) -> None:
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n' * 50 + '{"txt": "typo"}\n')
    preset = tmp_path / "p.toml"
    preset.write_text(
        f'extends = "{REPO / "tests" / "presets" / "micro.toml"}"\n'
        '[data]\nsource = "files"\nfiles = ["c.jsonl"]\nformat = "jsonl"\n'
    )
    result = bt("run", plan_hash(bt("plan", str(preset))))
    assert result.returncode == 1
    assert f"{tmp_path / 'c.jsonl'}: line 51: no key 'text'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list((store / "steps").glob("*")) if (store / "steps").exists() else True
