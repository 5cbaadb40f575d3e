"""The tokenizer step: deterministic bytes, trained on the train split only, hashed by content,
shared between stages, and invalidating exactly what reads it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, BtRunner, plan_hash
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.config.steps import TextSettings, TokenizerSettings
from buildtrain.errors import StepFailed
from buildtrain.plan.plan import Plan
from buildtrain.plan.planner import plan_preset
from buildtrain.steps.corpus import corpus
from buildtrain.steps.tokenizer import step as tokenizer_step
from buildtrain.steps.tokenizer.pieces import pieces
from buildtrain.store.store import Store

MICRO_BPE = REPO / "tests" / "presets" / "micro_bpe.toml"
WORDS = [
    "the",
    "a",
    "model",
    "trains",
    "on",
    "text",
    "and",
    "learns",
    "tokens",
    "from",
    "bytes",
    "which",
    "merge",
    "into",
    "words",
    "over",
    "time",
]
TEXT_VIEW = {"source": "files", "format": "jsonl", "text_field": "text", "split_block": 128}
TEXT_VIEW |= {"heldout_fraction": 0.2, "split_seed": 0}
TEXT_CONFIG = TextSettings.from_config(TEXT_VIEW)
BPE = TokenizerSettings(kind="bpe", vocab_size=320, min_frequency=2, end_of_document="<|endoftext|>")


def write_corpus(folder: Path, documents: int = 300, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(documents):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(10, 60)))
            handle.write(json.dumps({"text": text}) + "\n")
    return path


def bpe_preset(root: Path) -> Path:
    write_corpus(root / "corpus")
    shutil.copy(REPO / "tests" / "presets" / "micro.toml", root / "micro.toml")
    shutil.copy(MICRO_BPE, root / "micro_bpe.toml")
    return root / "micro_bpe.toml"


def plan_of(preset: Path, store: Path, *overrides: str) -> Plan:
    return plan_preset(preset, list(overrides), Store(store)).plan


def labels_changed(before: Plan, after: Plan) -> set[str]:
    old = {s.label: s.hash for s in before.steps}
    return {s.label for s in after.steps if old.get(s.label) != s.hash}


def trained_bytes(path: Path) -> bytes:
    return tokenizer_step.train_bpe(TEXT_CONFIG, [path], BPE).to_str().encode()


def test_training_gives_the_same_bytes_twice_and_at_any_thread_count(tmp_path: Path) -> None:
    path = write_corpus(tmp_path)
    first = trained_bytes(path)
    assert first == trained_bytes(path)
    script = (
        "import sys; from pathlib import Path; from test_tokenizer import trained_bytes; "
        "sys.stdout.buffer.write(trained_bytes(Path(sys.argv[1])))"
    )
    for threads in ("1", "4"):  # fresh processes: another hash seed, another rayon pool
        env = {**os.environ, "RAYON_NUM_THREADS": threads, "PYTHONPATH": str(REPO / "tests")}
        result = subprocess.run(
            [sys.executable, "-c", script, str(path)], capture_output=True, env=env, check=True
        )
        assert result.stdout == first, threads


def test_training_reads_only_the_train_pieces(tmp_path: Path) -> None:
    path = write_corpus(tmp_path)
    every = list(pieces(TEXT_CONFIG, corpus(TEXT_CONFIG, [path])))
    fed = [text for batch in tokenizer_step._train_batches(TEXT_CONFIG, [path]) for text in batch]
    assert any(piece.held_out for piece in every) and fed
    assert fed == [piece.text for piece in every if not piece.held_out]


def test_vocab_size_invalidates_tokenizer_data_train_eval_export_and_diff_says_why(
    tmp_path: Path, bt: BtRunner
) -> None:
    preset = bpe_preset(tmp_path)
    before = plan_of(preset, tmp_path / ".bt")
    after = plan_of(preset, tmp_path / ".bt", "data.tokenizer.vocab_size=400")
    assert [s.label for s in before.steps] == ["tokenizer:main", "data:main", "train:main", "eval", "export"]
    assert labels_changed(before, after) == {"tokenizer:main", "data:main", "train:main", "eval", "export"}
    shards = plan_of(preset, tmp_path / ".bt", "data.shard_tokens=2048")
    assert labels_changed(before, shards) == {"data:main", "train:main", "eval", "export"}  # not retrained
    diff = bt("diff", before.hash, after.hash)
    assert diff.returncode == 0, diff.stderr
    assert "data.tokenizer.vocab_size: 320 -> 400" in diff.stdout
    assert "tokenizer:main  invalidated: config tokenizer.vocab_size" in diff.stdout


def test_a_tokenizer_file_is_hashed_by_content_not_by_path(tmp_path: Path) -> None:
    corpus_path = write_corpus(tmp_path)
    (tmp_path / "tok.json").write_bytes(trained_bytes(corpus_path))
    preset = tmp_path / "p.toml"
    preset.write_text(
        f'extends = "{REPO / "tests" / "presets" / "micro.toml"}"\n'
        '[data]\nsource = "files"\nfiles = ["corpus.jsonl"]\nformat = "jsonl"\n'
        'tokenizer = { file = "tok.json" }\n'
    )
    store = tmp_path / ".bt"
    first = plan_of(preset, store)
    (tmp_path / "tok.json").rename(tmp_path / "renamed.json")
    renamed = plan_of(preset, store, f'data.tokenizer.file="{tmp_path / "renamed.json"}"')
    assert renamed.hash == first.hash
    raw = (tmp_path / "renamed.json").read_bytes()
    # One byte of whitespace added: still a tokenizer file (bt plan reads its vocabulary).
    (tmp_path / "renamed.json").write_bytes(raw.replace(b',"merges"', b', "merges"', 1))
    edited = plan_of(preset, store, f'data.tokenizer.file="{tmp_path / "renamed.json"}"')
    assert edited.hash != first.hash
    assert str(tmp_path) not in json.dumps(first.to_body())  # no path anywhere in the plan


def test_stages_that_ask_for_the_same_tokenizer_on_the_same_text_share_one_step(tmp_path: Path) -> None:
    preset = bpe_preset(tmp_path)
    (tmp_path / "two.toml").write_text(
        'extends = "micro_bpe.toml"\n[[stages]]\nname = "a"\n[[stages]]\nname = "b"\ntrain = { lr = 1e-3 }\n'
    )
    plan = plan_of(tmp_path / "two.toml", tmp_path / ".bt")
    kinds = [s.kind for s in plan.steps]
    assert kinds.count("tokenizer") == 1 and kinds.count("data") == 1
    assert plan_of(preset, tmp_path / ".bt").steps[0].hash == plan.steps[0].hash  # across plans too


def test_a_stage_that_starts_from_another_may_not_change_its_tokenizer(tmp_path: Path, bt: BtRunner) -> None:
    bpe_preset(tmp_path)
    (tmp_path / "ft.toml").write_text(
        'extends = "micro_bpe.toml"\n[[stages]]\nname = "a"\n[[stages]]\nname = "b"\ninit_from = "a"\n'
        'data = { tokenizer = { kind = "bpe", vocab_size = 500 } }\n'
    )
    result = bt("plan", str(tmp_path / "ft.toml"))
    assert result.returncode == 2
    assert "stages.b.data.tokenizer: differs from the tokenizer of stage 'a'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_given_file_without_the_end_of_document_token_is_refused(tmp_path: Path) -> None:
    raw = tokenizer_step.new_bpe().to_str().encode()
    with pytest.raises(StepFailed, match=r"tok.json: has no token '<\|endoftext\|>'"):
        tokenizer_step.load_given(tmp_path / "tok.json", raw, "<|endoftext|>")
    with pytest.raises(StepFailed, match=r"tok.json: not a Hugging Face tokenizer.json"):
        tokenizer_step.load_given(tmp_path / "tok.json", b"{}", "<|endoftext|>")


def test_the_bpe_preset_runs_and_a_rerun_is_a_null_build(tmp_path: Path, bt: BtRunner) -> None:
    preset = bpe_preset(tmp_path)
    planned = plan_hash(bt("plan", str(preset)))
    first = bt("run", planned)
    assert first.returncode == 0, first.stderr
    again = bt("run", planned)
    assert again.returncode == 0 and "5 cached" in again.stderr, again.stderr


def test_ids_past_65535_go_into_uint32_shards_that_training_reads(tmp_path: Path) -> None:
    from tokenizers import AddedToken

    from buildtrain.canonical import canonical_bytes
    from buildtrain.config.steps import DataSettings
    from buildtrain.steps.data.index import DATA_INDEX
    from buildtrain.steps.data.tokenized import build_tokenized
    from buildtrain.steps.train.batches import TokenStream

    wide = tokenizer_step.new_bpe()  # no merges: unknown words fall back to their bytes
    wide.add_tokens([f"filler{i}" for i in range(70_000)])
    wide.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    wide.add_tokens(["WIDE"])
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / tokenizer_step.TOKENIZER).write_text(wide.to_str())
    description = tokenizer_step.describe(wide, "file", "<|endoftext|>")
    (folder / tokenizer_step.DESCRIPTION).write_bytes(canonical_bytes(description))
    assert description["vocab_size"] > 1 << 16
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"ab WIDE c{i}"}) + "\n" for i in range(200)))
    out = tmp_path / "out"
    out.mkdir()
    config = DataSettings(**{**TEXT_VIEW, "split_block": 16, "shard_tokens": 1024, "tokenizer": {}})

    class Log:
        def info(self, *_: object, **__: object) -> None: ...

    build_tokenized(config.text, config.shard_tokens, [path], folder, out, Log())
    index = json.loads((out / DATA_INDEX).read_bytes())
    split = index["splits"]["train"]
    assert split["dtype"] == "u32" and split["shards"][0]["digest"]
    tokens = TokenStream(out, split).read(0, len(TokenStream(out, split))).tolist()
    wide_id, end = wide.token_to_id("WIDE"), description["end_of_document"]
    assert wide_id > 1 << 16 and end > 1 << 16
    assert tokens.count(wide_id) > 100 and tokens.count(end) > 100
    assert max(tokens) < description["vocab_size"]


def test_the_fast_held_out_unit_is_derive_unit() -> None:
    from buildtrain.steps.seeds import derive_unit
    from buildtrain.steps.tokenizer.pieces import HeldOutUnit

    for seed in (0, 7, 2**40):
        unit = HeldOutUnit(seed)
        assert all(unit(i) == derive_unit(seed, "heldout", i) for i in [*range(300), 10**9, 2**62])


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.characters(exclude_categories=("Cs",)), max_size=400),
    limit=st.integers(16, 64),
    chunk=st.integers(1, 50),
)
def test_pieces_rebuild_the_text_fit_the_limit_and_ignore_read_chunks(
    text: str, limit: int, chunk: int
) -> None:
    from buildtrain.steps.tokenizer.pieces import cut

    raw = text.encode("utf-8")
    whole = list(cut([raw], limit))
    assert b"".join(whole) == raw and len(whole) >= 1
    assert all(len(piece) <= limit for piece in whole)
    assert all(piece.decode("utf-8") for piece in whole if piece)  # never inside a character
    assert list(cut([raw[i : i + chunk] for i in range(0, len(raw), chunk)], limit)) == whole
