"""Every preset mistake is caught before anything runs, and reads like a compiler error:
`FILE: KEY.PATH: what is wrong`, exit code 2, never a traceback, all problems at once."""

from __future__ import annotations

import random
import re
import tempfile
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import BtRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import LayeredPreset, emit, emit_value, layered_presets

from buildtrain.config.checks import reads_of, validators_of
from buildtrain.config.loader import load_preset
from buildtrain.config.problems import KeyPath, PresetError, display
from buildtrain.config.schema import FFN_MULTIPLE, SECTIONS, STAGE_KEYS, ModelConfig, Stage, SyntheticConfig
from buildtrain.errors import ConfigError, ExitCode

# (id, files (the preset is p.toml), key path, what the message says)
CASES: list[tuple[str, dict[str, str | bytes], str, str]] = [
    # unknown keys, with a suggestion when one is close
    ("unknown-key", {"p.toml": "[train]\nlrr = 1e-3\n"}, "train.lrr", "unknown key; did you mean 'lr'?"),
    ("unknown-section", {"p.toml": "[modle]\ndim = 64\n"}, "modle", "unknown key; did you mean 'model'?"),
    (
        "unknown-nested-key",
        {"p.toml": "[data.synthetic]\nsed = 1\n"},
        "data.synthetic.sed",
        "unknown key; did you mean 'seed'?",
    ),
    (
        "unknown-stage-key",
        {"p.toml": '[[stages]]\nname = "a"\ntrian = {}\n'},
        "stages[0].trian",
        "unknown key; did you mean 'train'?",
    ),
    (
        "unknown-key-in-stage-table",
        {"p.toml": '[[stages]]\nname = "a"\ntrain = { stpes = 3 }\n'},
        "stages[0].train.stpes",
        "unknown key; did you mean 'steps'?",
    ),
    (
        "unknown-key-no-match",
        {"p.toml": "[model]\nzzz = 1\n"},
        "model.zzz",
        "unknown key; valid keys here: dim,",
    ),
    # wrong types: TOML tells them apart, so nothing is coerced
    (
        "string-for-float",
        {"p.toml": '[train]\nlr = "fast"\n'},
        "train.lr",
        "expected a number, got 'fast' (string)",
    ),
    (
        "float-for-int",
        {"p.toml": "[train]\nsteps = 1.5\n"},
        "train.steps",
        "expected an integer, got 1.5 (float)",
    ),
    ("bool-for-int", {"p.toml": "[train]\nsteps = true\n"}, "train.steps", "expected an integer, got True"),
    (
        "int-for-bool",
        {"p.toml": "[model]\ntie_embeddings = 1\n"},
        "model.tie_embeddings",
        "expected true or false, got 1 (integer)",
    ),
    ("value-for-section", {"p.toml": "model = 3\n"}, "model", "expected a table, got 3 (integer)"),
    ("value-for-table", {"p.toml": "[data]\nsynthetic = 3\n"}, "data.synthetic", "expected a table, got 3"),
    (
        "short-array",
        {"p.toml": "[train]\nbetas = [0.9]\n"},
        "train.betas",
        "expected an array of 2 values, got 1",
    ),
    (
        "string-for-array",
        {"p.toml": '[data]\nfiles = "a.txt"\n'},
        "data.files",
        "expected an array, got 'a.txt'",
    ),
    ("date-for-float", {"p.toml": "[train]\nlr = 2024-01-01\n"}, "train.lr", "expected a number"),
    ("number-for-name", {"p.toml": "name = 3\n"}, "name", "expected a non-empty string, got 3 (integer)"),
    ("stages-not-array", {"p.toml": "stages = 3\n"}, "stages", "expected a non-empty array of tables"),
    ("stage-not-table", {"p.toml": "stages = [1]\n"}, "stages[0]", "expected a table, got 1 (integer)"),
    ("extends-not-path", {"p.toml": "extends = 3\n"}, "extends", "expected a path or a list of paths"),
    # out of range
    ("negative-lr", {"p.toml": "[train]\nlr = -1e-3\n"}, "train.lr", "must be > 0.0 (got -0.001)"),
    ("zero-lr", {"p.toml": "[train]\nlr = 0.0\n"}, "train.lr", "must be > 0.0 (got 0.0)"),
    (
        "negative-steps",
        {"p.toml": "[train]\nsteps = -1\nwarmup_steps = 0\n"},
        "train.steps",
        "must be >= 0 (got -1)",
    ),
    ("zero-layers", {"p.toml": "[model]\nn_layers = 0\n"}, "model.n_layers", "must be >= 1 (got 0)"),
    ("short-sequence", {"p.toml": "[train]\nseq_len = 1\n"}, "train.seq_len", "must be >= 2 (got 1)"),
    (
        "heldout-too-large",
        {"p.toml": "[data]\nheldout_fraction = 0.9\n"},
        "data.heldout_fraction",
        "must be <= 0.5 (got 0.9)",
    ),
    ("dropout-one", {"p.toml": "[model]\ndropout = 1.0\n"}, "model.dropout", "must be < 1.0 (got 1.0)"),
    (
        "negative-seed",
        {"p.toml": "[data.synthetic]\nseed = -1\n"},
        "data.synthetic.seed",
        "must be >= 0 (got -1)",
    ),
    (
        "negative-threads",
        {"p.toml": "[numerics]\nthreads = -2\n"},
        "numerics.threads",
        "must be >= 0 (got -2)",
    ),
    ("beta-one", {"p.toml": "[train]\nbetas = [1.0, 0.9]\n"}, "train.betas", "each beta must be in [0, 1)"),
    (
        "warmup-beyond-steps",
        {"p.toml": "[train]\nsteps = 10\n"},
        "train.warmup_steps",
        "20 exceeds train.steps 10",
    ),
    (
        "huge-integer",
        {"p.toml": "[train]\nsteps = 99999999999999999999\n"},
        "train.steps",
        "must be a 64-bit integer",
    ),
    (
        "unknown-choice",
        {"p.toml": '[model]\nmlp = "relu"\n'},
        "model.mlp",
        "must be one of 'swiglu', 'gelu' (got 'relu')",
    ),
    # shapes
    (
        "heads-do-not-divide-dim",
        {"p.toml": "[model]\ndim = 30\nn_heads = 4\nn_kv_heads = 1\n"},
        "model.n_heads",
        "4 does not divide model.dim 30; choose a divisor of 30",
    ),
    (
        "odd-head-size",
        {"p.toml": "[model]\ndim = 12\nn_heads = 4\nn_kv_heads = 1\n"},
        "model.n_heads",
        "odd head size 3",
    ),
    (
        "kv-heads-do-not-divide-heads",
        {"p.toml": "[model]\nn_heads = 4\nn_kv_heads = 3\n"},
        "model.n_kv_heads",
        "3 does not divide model.n_heads 4; choose a divisor of 4",
    ),
    (
        "micro-batch-does-not-divide-batch",
        {"p.toml": "[train]\nbatch_size = 6\nmicro_batch_size = 4\n"},
        "train.micro_batch_size",
        "4 does not divide train.batch_size 6; choose a divisor of 6",
    ),
    # data settings that contradict each other
    (
        "files-source-without-files",
        {"p.toml": '[data]\nsource = "files"\n'},
        "data.files",
        "source is 'files' but no files are listed",
    ),
    (
        "files-with-synthetic-source",
        {"p.toml": '[data]\nfiles = ["a.txt"]\n'},
        "data.files",
        "files are listed but source is 'synthetic'",
    ),
    # stages
    (
        "init-from-missing-stage",
        {"p.toml": '[[stages]]\nname = "pretrain"\n[[stages]]\nname = "ft"\ninit_from = "pretrian"\n'},
        "stages[1].init_from",
        "no stage named 'pretrian'; did you mean 'pretrain'?",
    ),
    (
        "init-from-later-stage",
        {"p.toml": '[[stages]]\nname = "a"\ninit_from = "b"\n[[stages]]\nname = "b"\n'},
        "stages[0].init_from",
        "stage 'b' does not come before 'a'; a stage can only start from an earlier one",
    ),
    (
        "init-from-itself",
        {"p.toml": '[[stages]]\nname = "a"\ninit_from = "a"\n'},
        "stages[0].init_from",
        "stage 'a' does not come before 'a'",
    ),
    (
        "duplicate-stage-name",
        {"p.toml": '[[stages]]\nname = "a"\n[[stages]]\nname = "a"\n'},
        "stages[1].name",
        "'a' is already the name of stages[0]",
    ),
    (
        "stage-without-name",
        {"p.toml": "[[stages]]\nsteps = 3\n"},
        "stages[0].name",
        "each stage needs a name",
    ),
    (
        "stage-problem-at-the-stage",
        {"p.toml": '[[stages]]\nname = "a"\n[[stages]]\nname = "b"\ntrain = { lr = -1.0 }\n'},
        "stages[1].train.lr",
        "must be > 0.0",
    ),
    # extends
    ("missing-extends", {"p.toml": 'extends = "nope.toml"\n'}, "extends", "'nope.toml' not found"),
]


def _problems(root: Path, files: dict[str, str | bytes], overrides: tuple[str, ...] = ()) -> list[str]:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_preset(root / "p.toml", overrides)
    assert caught.value.exit_code == ExitCode.USAGE == 2
    return caught.value.problems


@pytest.mark.parametrize(("files", "key", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_mistake_names_file_key_and_problem(
    tmp_path: Path, files: dict[str, str | bytes], key: str, message: str
) -> None:
    problems = _problems(tmp_path, files)
    expected = f"{display(tmp_path / 'p.toml')}: {key}: "
    matching = [p for p in problems if p.startswith(expected)]
    assert matching, problems
    assert any(message in p for p in matching), problems


def test_malformed_toml_gives_line_and_column(tmp_path: Path) -> None:
    problems = _problems(tmp_path, {"p.toml": "[train]\nlr = = 3\n"})
    assert problems == [f"{display(tmp_path / 'p.toml')}:2:6: invalid TOML: Invalid value"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[model]\ndim = 64\n[model]\n", r":3:\d+: invalid TOML: Cannot declare \('model',\) twice"),
        (b'name = "x\n', r":1:\d+: invalid TOML: Illegal character"),
        (b"\xff\xfe[model]", r": not UTF-8 text \(byte 0\)"),
        (b"x = " + b"[" * 1000 + b"]" * 1000, r": invalid TOML: .*nested"),
        (b"x = 1" + b"0" * 5000, r": invalid TOML: .*limit"),
    ],
    ids=["duplicate-table", "unterminated-string", "not-utf8", "deep-nesting", "huge-integer-literal"],
)
def test_unreadable_presets(tmp_path: Path, content: bytes, message: str) -> None:
    problems = _problems(tmp_path, {"p.toml": content})
    assert len(problems) == 1
    assert re.match(re.escape(display(tmp_path / "p.toml")) + message, problems[0]), problems


def test_missing_preset(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: file not found"):
        load_preset(tmp_path / "nope.toml")


def test_cyclic_extends_names_the_cycle(tmp_path: Path) -> None:
    problems = _problems(tmp_path, {"p.toml": 'extends = "b.toml"\n', "b.toml": 'extends = "p.toml"\n'})
    b, p = display(tmp_path / "b.toml"), display(tmp_path / "p.toml")
    assert problems == [f"{b}: extends: cycle: {p} -> {b} -> {p}"]


def test_self_extends_is_a_cycle(tmp_path: Path) -> None:
    problems = _problems(tmp_path, {"p.toml": 'extends = "p.toml"\n'})
    assert problems == [
        f"{display(tmp_path / 'p.toml')}: extends: cycle: {display(tmp_path / 'p.toml')} -> {display(tmp_path / 'p.toml')}"
    ]


def test_problem_in_a_base_preset_names_the_base(tmp_path: Path) -> None:
    problems = _problems(
        tmp_path,
        {"p.toml": 'extends = "base/b.toml"\n', "base/b.toml": 'extends = "gone.toml"\n[train]\nlr = 0.0\n'},
    )
    assert problems == [
        f"{display(tmp_path / 'base' / 'b.toml')}: extends: 'gone.toml' not found (looked for {tmp_path / 'base' / 'gone.toml'})"
    ]


def test_stage_defaults_problem_is_reported_once_at_its_source(tmp_path: Path) -> None:
    problems = _problems(
        tmp_path, {"p.toml": '[train]\nlr = -1.0\n[[stages]]\nname = "a"\n[[stages]]\nname = "b"\n'}
    )
    assert problems == [f"{display(tmp_path / 'p.toml')}: train.lr: must be > 0.0 (got -1.0)"]


def test_all_problems_are_collected(tmp_path: Path) -> None:
    """One preset with many mistakes reports every one of them, not just the first."""
    text = """
        name = "many"
        colour = "red"
        [model]
        dim = 30
        n_heads = 4
        n_kv_heads = 3
        mlp = "relu"
        [data.synthetic]
        kindd = "arithmetic"
        seed = -1
        [train]
        lr = -1.0
        steps = "many"
        batch_size = 6
        micro_batch_size = 4
        [[stages]]
        name = "a"
        init_from = "b"
        [[stages]]
        name = "b"
        train = { lrr = 3 }
        [[stages]]
        name = "c"
        init_from = "nope"
    """
    problems = _problems(tmp_path, {"p.toml": text})
    keys = {p.split(": ")[1] for p in problems}
    assert keys >= {
        "colour",
        "model.n_heads",
        "model.n_kv_heads",
        "model.mlp",
        "data.synthetic.kindd",
        "data.synthetic.seed",
        "train.lr",
        "train.steps",
        "train.micro_batch_size",
        "stages[0].init_from",
        "stages[1].train.lrr",
        "stages[2].init_from",
    }
    assert len(problems) == len(set(problems))  # each once, though three stages share [train]


# -- through the real command line ----------------------------------------------------------------

REPRESENTATIVE = {
    "malformed": ({"p.toml": "[train]\nlr = = 3\n"}, "p.toml:2:6: invalid TOML: Invalid value"),
    "unknown-key": (
        {"p.toml": "[train]\nlrr = 1e-3\n"},
        "p.toml: train.lrr: unknown key; did you mean 'lr'?",
    ),
    "shape": (
        {"p.toml": "[model]\ndim = 64\nn_heads = 4\nn_kv_heads = 3\n"},
        "p.toml: model.n_kv_heads: 3 does not divide model.n_heads 4; choose a divisor of 4",
    ),
    "later-stage": (
        {"p.toml": '[[stages]]\nname = "a"\ninit_from = "b"\n[[stages]]\nname = "b"\n'},
        "p.toml: stages[0].init_from: stage 'b' does not come before 'a'; a stage can only start from an earlier one",
    ),
    "extends-cycle": (
        {"p.toml": 'extends = "b.toml"\n', "b.toml": 'extends = "p.toml"\n'},
        "b.toml: extends: cycle: p.toml -> b.toml -> p.toml",
    ),
}


@pytest.mark.parametrize("case", list(REPRESENTATIVE))
def test_bt_plan_reports_preset_mistakes_with_exit_code_2(tmp_path: Path, bt: BtRunner, case: str) -> None:
    files, line = REPRESENTATIVE[case]
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    result = bt("plan", "p.toml", cwd=tmp_path)
    assert result.returncode == ExitCode.USAGE == 2
    assert result.stdout == ""  # nothing that could pass for a plan hash
    assert line in result.stderr.splitlines()
    assert "bt plan: 1 problem in the preset; nothing was run" in result.stderr
    assert "Traceback" not in result.stderr


def test_bt_plan_lists_every_problem(tmp_path: Path, bt: BtRunner) -> None:
    (tmp_path / "p.toml").write_text("[model]\nn_layers = 0\n[train]\nlr = -1.0\nsteps = 1.5\n")
    result = bt("plan", "p.toml", "--set", "eval.every=-1", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "p.toml: model.n_layers: must be >= 1 (got 0)",
        "--set eval.every=-1: eval.every: must be >= 0 (got -1)",
        "p.toml: train.steps: expected an integer, got 1.5 (float)",
        "p.toml: train.lr: must be > 0.0 (got -1.0)",
        "bt plan: 4 problems in the preset; nothing was run",
    ]


# -- each problem once, at the key and in the file that set it ------------------------------------

# (id, preset text, the one problem): a bad value is reported at its own key and never again
# through a rule that reads it.
ONE_BAD_VALUE = [
    ("steps-negative", "[train]\nsteps = -1\n", "train.steps: must be >= 0 (got -1)"),
    (
        "steps-wrong-type",
        '[train]\nsteps = "many"\n',
        "train.steps: expected an integer, got 'many' (string)",
    ),
    ("batch-zero", "[train]\nbatch_size = 0\n", "train.batch_size: must be >= 1 (got 0)"),
    ("dim-zero", "[model]\ndim = 0\n", "model.dim: must be >= 1 (got 0)"),
    ("heads-zero", "[model]\nn_heads = 0\n", "model.n_heads: must be >= 1 (got 0)"),
    ("heads-wrong-type", '[model]\nn_heads = "x"\n', "model.n_heads: expected an integer, got 'x' (string)"),
    (
        "source-unknown",
        '[data]\nsource = "bogus"\n',
        "data.source: must be one of 'synthetic', 'files' (got 'bogus')",
    ),
]


@pytest.mark.parametrize(
    ("text", "problem"), [c[1:] for c in ONE_BAD_VALUE], ids=[c[0] for c in ONE_BAD_VALUE]
)
def test_one_bad_value_is_one_problem(tmp_path: Path, text: str, problem: str) -> None:
    assert _problems(tmp_path, {"p.toml": text}) == [f"{display(tmp_path / 'p.toml')}: {problem}"]


BIG = 2**63 - 1
HUGE_COUNTS = [
    (
        "documents",
        f"[data]\nsynthetic = {{ documents = {BIG} }}\n",
        f"data.synthetic.documents: must be <= 100000000 (got {BIG})",
    ),
    (
        "lines",
        f"[data]\nsynthetic = {{ lines = {BIG} }}\n",
        f"data.synthetic.lines: must be <= 100000000 (got {BIG})",
    ),
    (
        "documents-x-lines",
        "[data]\nsynthetic = { documents = 100000, lines = 10000 }\n",
        "data.synthetic.lines: 10000 lines x data.synthetic.documents 100000 = 1,000,000,000 lines, more than "
        "the 100,000,000 the synthetic corpus allows; use data files for a larger corpus",
    ),
    (
        "shard-tokens",
        f"[data]\nshard_tokens = {BIG}\n",
        f"data.shard_tokens: must be <= 1073741824 (got {BIG})",
    ),
    (
        "micro-batches",
        "[train]\nbatch_size = 4611686018427387904\nmicro_batch_size = 1\n",
        "train.micro_batch_size: 1 makes 4,611,686,018,427,387,904 micro-batches per update, more than 65,536; "
        "raise train.micro_batch_size or lower train.batch_size",
    ),
]


@pytest.mark.parametrize(("text", "problem"), [c[1:] for c in HUGE_COUNTS], ids=[c[0] for c in HUGE_COUNTS])
def test_a_huge_count_is_refused_naming_the_key_and_the_limit(
    tmp_path: Path, text: str, problem: str
) -> None:
    """2**63-1 synthetic documents planned, then wrote into tmp/ forever."""
    assert _problems(tmp_path, {"p.toml": text}) == [f"{display(tmp_path / 'p.toml')}: {problem}"]


def test_a_rule_broken_by_a_parent_preset_names_the_parent(tmp_path: Path) -> None:
    files = {
        "p.toml": 'extends = "base/b.toml"\n[model]\ndim = 32\n',
        "base/b.toml": "[train]\nsteps = 10\nwarmup_steps = 20\n",
    }
    assert _problems(tmp_path, files) == [
        f"{display(tmp_path / 'base' / 'b.toml')}: train.warmup_steps: 20 exceeds train.steps 10"
    ]


def test_a_rule_broken_by_a_later_layer_names_that_layer(tmp_path: Path) -> None:
    """The keys a rule reads came from two files: the one applied last made the conflict."""
    files = {"p.toml": 'extends = "b.toml"\n[train]\nsteps = 10\n', "b.toml": "[train]\nwarmup_steps = 12\n"}
    assert _problems(tmp_path, files) == [
        f"{display(tmp_path / 'p.toml')}: train.warmup_steps: 12 exceeds train.steps 10"
    ]


@pytest.mark.parametrize(
    ("assignment", "problem"),
    [
        ("train.steps=10", "train.warmup_steps: 20 exceeds train.steps 10"),
        ("train.batch_size=6", "train.micro_batch_size: 16 does not divide train.batch_size 6"),
        ("model.dim=12", "model.n_heads: gives an odd head size 3"),
        ("stages[0].train.steps=10", "stages[0].train.warmup_steps: 20 exceeds train.steps 10"),
    ],
)
def test_a_rule_broken_by_set_names_the_set(tmp_path: Path, assignment: str, problem: str) -> None:
    """The preset sets other keys of the same tables, and so wrote the tables the rules guard."""
    problems = _problems(tmp_path, {"p.toml": "[train]\nlr = 1e-3\n[model]\nn_layers = 1\n"}, (assignment,))
    assert len(problems) == 1
    assert problems[0].startswith(f"--set {assignment}: {problem}")


def test_a_rule_of_a_stage_is_reported_at_the_stage_that_broke_it(tmp_path: Path) -> None:
    """A rule over inherited keys only is the top level's (once); one over a key the stage set
    is that stage's."""
    text = (
        '[train]\nwarmup_steps = 8\n[[stages]]\nname = "a"\ntrain = { steps = 5 }\n[[stages]]\nname = "b"\n'
    )
    assert _problems(tmp_path, {"p.toml": text}) == [
        f"{display(tmp_path / 'p.toml')}: stages[0].train.warmup_steps: 8 exceeds train.steps 5"
    ]
    text = '[train]\nsteps = 5\n[[stages]]\nname = "a"\n[[stages]]\nname = "b"\ntrain = { lr = 1e-3 }\n'
    assert _problems(tmp_path, {"p.toml": text}) == [
        f"{display(tmp_path / 'p.toml')}: train.warmup_steps: 20 exceeds train.steps 5"
    ]


def test_a_stage_without_a_name_is_no_name_to_clash_with(tmp_path: Path) -> None:
    text = '[[stages]]\nname = 3\n[[stages]]\nname = "stage0"\n'
    assert _problems(tmp_path, {"p.toml": text}) == [
        f'{display(tmp_path / "p.toml")}: stages[0].name: each stage needs a name, for example name = "pretrain"'
    ]


def _schema_key(key: KeyPath, stages: int) -> bool:
    """Whether a key path names a key of the preset language (a stage by an index it has)."""
    if key[:1] == ("stages",) and len(key) > 2:
        if not (isinstance(key[1], int) and key[1] < stages and key[2] in STAGE_KEYS):
            return False
        cls: type | None = Stage
        rest = key[2:]
    elif len(key) == 1:
        return key[0] in ("name", "stages", *SECTIONS)
    else:
        cls, rest = SECTIONS.get(str(key[0])), key[1:]
    for index, part in enumerate(rest):
        if cls is None:  # past a value: only an array may go on, by index, and only at the end
            return isinstance(part, int) and index == len(rest) - 1
        if part not in attrs.fields_dict(cls):
            return False
        nested = typing.get_type_hints(cls)[part]
        cls = nested if attrs.has(nested) else None
    return True


def _written(doc: Any, prefix: KeyPath = ()) -> set[KeyPath]:
    """Every key path a preset document writes, tables included."""
    found = {prefix} if prefix else set()
    if isinstance(doc, dict):
        for key, value in doc.items():
            found |= _written(value, (*prefix, key))
    elif isinstance(doc, list) and all(isinstance(item, dict) for item in doc):
        for index, value in enumerate(doc):
            found |= _written(value, (*prefix, index))
    return found


def _set_path(key: str) -> KeyPath:
    path: list[str | int] = []
    for part in key.split("."):
        path += ["stages", int(part[7:-1])] if part.startswith("stages[") else [part]
    return tuple(path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layered_presets())
def test_each_problem_once_at_a_real_key_blamed_on_a_layer_that_wrote_its_table(spec: LayeredPreset) -> None:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "base.toml").write_text(emit(spec.base, rng), encoding="utf-8")
        (root / "p.toml").write_text('extends = "base.toml"\n' + emit(spec.preset, rng), encoding="utf-8")
        overrides = [f"{key}={emit_value(value, rng)}" for key, value in spec.overrides]
        try:
            load_preset(root / "p.toml", overrides)
        except PresetError as exc:
            found = exc.found
        else:
            return
        # What each layer wrote, by label.
        wrote = {
            display(root / "base.toml"): _written(spec.base),
            display(root / "p.toml"): _written(spec.preset),
        }
        for assignment, (key, _) in zip(overrides, spec.overrides, strict=True):
            wrote.setdefault(f"--set {assignment}", set()).add(_set_path(key))

    assert found
    stages = len(spec.preset.get("stages", [])) or 1
    keys = [problem.key for problem in found]
    assert len(keys) == len(set(keys)), [str(p) for p in found]  # no key twice, so no problem twice
    every = set().union(*wrote.values())
    alone = [p.key for p in found if len(p.involves) == 1]  # a value wrong on its own
    for problem in found:
        # A rule is not reported over a value that is wrong on its own: that is one problem.
        for key in problem.involves[1:]:
            assert not any(k[: len(key)] == key or key[: len(k)] == k for k in alone), [str(p) for p in found]
        assert _schema_key(problem.key, stages) or problem.key in every, str(problem)
        # Blamed on a layer that wrote the problem's table: the stage's own, or the top level's.
        table = problem.key[:-1]
        tables = {table, table[2:]} if table[:1] == ("stages",) else {table}
        touched = {
            label
            for label, keys_ in wrote.items()
            if any(k[: len(t)] == t for k in keys_ for t in tables if t)
        }
        assert problem.source in (touched or set(wrote)), str(problem)


@pytest.mark.parametrize("cls", [*SECTIONS.values(), SyntheticConfig], ids=lambda cls: cls.__name__)
def test_rules_read_only_the_fields_they_declare_and_those_come_first(cls: type) -> None:
    """A validator without `@reads` reads nothing but its value; a rule reads only the fields it
    declares, each declared before its own field (so attrs validates them first)."""

    class Recorder:
        def __init__(self, instance: Any) -> None:
            self.instance, self.read = instance, set()

        def __getattr__(self, name: str) -> Any:
            self.read.add(name)
            return getattr(self.instance, name)

    names = [field.name for field in attrs.fields(cls)]
    for field in attrs.fields(cls):
        for check in validators_of(field):
            declared = reads_of(check) or ()
            recorder = Recorder(cls())
            check(recorder, field, getattr(recorder.instance, field.name))
            assert recorder.read <= set(declared), (field.name, recorder.read)
            assert all(names.index(name) < names.index(field.name) for name in declared), field.name


@given(half=st.integers(1, 1 << 15), mlp=st.sampled_from(["swiglu", "gelu"]))
def test_the_derived_ffn_hidden_is_the_smallest_multiple_at_or_above_its_ratio(half: int, mlp: str) -> None:
    dim = 2 * half  # one head of an even size
    hidden = ModelConfig(dim=dim, n_heads=1, n_kv_heads=1, mlp=mlp).ffn_hidden
    exact = 8 * dim / 3 if mlp == "swiglu" else 4 * dim
    assert hidden % FFN_MULTIPLE == 0
    assert exact <= hidden < exact + FFN_MULTIPLE


def test_a_set_ffn_hidden_is_kept_as_it_is() -> None:
    assert ModelConfig(dim=256, ffn_hidden=683).ffn_hidden == 683
    assert ModelConfig(dim=256).ffn_hidden == 688 and ModelConfig().ffn_hidden == 176  # tiny's width
