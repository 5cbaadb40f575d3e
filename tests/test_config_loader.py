"""Loading presets: spellings, `extends`, `--set`, provenance, round trips, and robustness."""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

import attrs
import pytest
import tomli
from conftest import time_bound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import (
    TOML_DOCS,
    TOMLISH,
    PresetSpec,
    configs,
    emit,
    leaves,
    mutated_docs,
    preset_specs,
    write_preset,
)

from buildtrain.config import presets
from buildtrain.config.convert import converter
from buildtrain.config.loader import load_preset
from buildtrain.config.problems import display
from buildtrain.config.provenance import blame, merge_base, merge_layer
from buildtrain.config.reference import reference, render
from buildtrain.config.schema import (
    SECTIONS,
    STAGE_KEYS,
    TOP_LEVEL_KEYS,
    Config,
    DataConfig,
    EvalConfig,
    ExportConfig,
    InitConfig,
    LoraConfig,
    ModelConfig,
    NumericsConfig,
    RopeScalingConfig,
    Stage,
    SuiteConfig,
    TokenizerConfig,
    TrainConfig,
)
from buildtrain.errors import ConfigError, ExitCode

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# -- a preset resolves to exactly what it says ----------------------------------------------------


@settings(max_examples=5, deadline=None)
@given(spec=preset_specs())
def test_strategies_cover_every_key_of_the_schema(spec: PresetSpec) -> None:
    """The generators set every key; a new schema key must be added to them too."""
    stage = spec.values["stages"][0]
    expected = {
        "model": ModelConfig,
        "eval": EvalConfig,
        "numerics": NumericsConfig,
        "export": ExportConfig,
    }
    for section, cls in expected.items():
        assert set(spec.values[section]) == set(attrs.fields_dict(cls)), section
    assert set(stage["train"]) == set(attrs.fields_dict(TrainConfig))
    assert set(stage["data"]) == set(attrs.fields_dict(DataConfig))
    assert set(stage) == set(attrs.fields_dict(Stage))
    assert set(spec.values) == set(attrs.fields_dict(Config))


@FAST
@given(spec=preset_specs(), seed=st.integers(0, 2**32))
def test_any_spelling_of_a_preset_resolves_to_its_config(spec: PresetSpec, seed: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch).resolve()
        write_preset(root / "preset.toml", spec, random.Random(seed))
        assert load_preset(root / "preset.toml").config == spec.config(root)


def test_defaults_are_materialized(tmp_path: Path) -> None:
    loaded = load_preset(write(tmp_path / "empty.toml", ""))
    assert loaded.config == Config()
    assert [stage.name for stage in loaded.config.stages] == ["main"]


def test_stage_tables_override_the_top_level_defaults(tmp_path: Path) -> None:
    preset = write(
        tmp_path / "p.toml",
        """
        [train]
        lr = 1e-3
        steps = 40
        [[stages]]
        name = "a"
        [[stages]]
        name = "b"
        init_from = "a"
        train = { lr = 5e-4 }
        data.synthetic.seed = 7
        """,
    )
    config = load_preset(preset).config
    a, b = config.stages
    assert (a.train.lr, a.train.steps, a.data.synthetic.seed) == (1e-3, 40, 0)
    assert (b.train.lr, b.train.steps, b.data.synthetic.seed) == (5e-4, 40, 7)
    assert b.init_from == "a" and config.final_stage is b


# -- extends --------------------------------------------------------------------------------------


def test_extends_merges_tables_and_later_wins(tmp_path: Path) -> None:
    write(tmp_path / "base.toml", "[model]\ndim = 32\nn_layers = 3\n[train]\nlr = 1e-3\nbetas = [0.8, 0.9]\n")
    write(tmp_path / "other.toml", "[model]\nn_layers = 4\n[train]\nbetas = [0.5, 0.6]\n")
    child = write(
        tmp_path / "child.toml",
        'extends = ["base.toml", "other.toml"]\n[train]\nlr = 2e-3\n',
    )
    config = load_preset(child).config
    assert (config.model.dim, config.model.n_layers) == (32, 4)  # merged key by key, later wins
    assert config.stages[0].train.lr == 2e-3  # the preset itself wins over what it extends
    assert config.stages[0].train.betas == (0.5, 0.6)  # arrays are replaced, not merged


def test_extends_chains_and_paths_are_relative_to_each_file(tmp_path: Path) -> None:
    write(tmp_path / "common" / "corpus" / "a.txt", "hello")
    write(tmp_path / "common" / "base.toml", '[data]\nsource = "files"\nfiles = ["corpus/*.txt"]\n')
    write(tmp_path / "common" / "mid.toml", 'extends = "base.toml"\n[model]\nn_layers = 3\n')
    child = write(tmp_path / "exp" / "child.toml", 'extends = "../common/mid.toml"\n')
    config = load_preset(child).config
    assert config.model.n_layers == 3
    assert config.stages[0].data.files == (str(tmp_path / "common" / "corpus" / "*.txt"),)


def test_problems_are_reported_in_the_file_that_set_the_key(tmp_path: Path) -> None:
    write(tmp_path / "base.toml", "[train]\nlr = -1.0\n")
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[model]\nn_layers = 0\n')
    with pytest.raises(ConfigError) as caught:
        load_preset(child)
    assert any("base.toml: train.lr: must be > 0.0" in p for p in caught.value.problems)
    assert any("child.toml: model.n_layers" in p for p in caught.value.problems)
    assert not any("child.toml: train.lr" in p for p in caught.value.problems)


def ladder(folder: Path, files: int) -> Path:
    """`files` presets, each extending the next two: every file is reached along many paths
    (2**30 for the first of 31), so a loader that follows each path never finishes."""
    for i in range(files):
        bases = [f"f{j}.toml" for j in (i + 1, i + 2) if j < files]
        write(
            folder / f"f{i}.toml",
            f"extends = {bases}\n[train]\nseed = {i}\n" if bases else "[model]\ndim = 32\n",
        )
    return folder / "f0.toml"


def test_an_extends_diamond_reads_each_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[Path] = []
    read_toml = presets._read_toml
    monkeypatch.setattr(presets, "_read_toml", lambda path: reads.append(path) or read_toml(path))
    with time_bound(10, "loading a 31-file extends diamond"):
        loaded = load_preset(ladder(tmp_path, 31))
    assert sorted(reads) == sorted({path.resolve() for path in reads}) and len(reads) == 31
    assert loaded.config.stages[0].train.seed == 0 and loaded.config.model.dim == 32
    assert len(loaded.layers) == 31 and loaded.layers[-1] == display(tmp_path / "f0.toml")


def naive_read(path: Path) -> tuple[dict, dict, list[str]]:
    """The loader as it was before it kept what it merged: every path through the DAG re-read."""
    raw = tomli.loads(path.read_text())
    merged: dict = {}
    provenance: dict = {}
    layers: list[str] = []
    for base_name in raw.pop("extends", []):
        base, base_provenance, base_layers = naive_read((path.parent / base_name).resolve())
        merged = presets.deep_merge(merged, base)
        merge_base(provenance, base, base_provenance)
        layers += base_layers
    merge_layer(provenance, raw, display(path))
    return presets.deep_merge(merged, raw), provenance, [*layers, display(path)]


LAYER_VALUES = st.one_of(
    st.integers(0, 9),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.sampled_from("pq"), st.integers(0, 9), max_size=2),
)
LAYER_DOCS = st.dictionaries(
    st.sampled_from("ab"), st.dictionaries(st.sampled_from("xyz"), LAYER_VALUES, max_size=3), max_size=2
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    docs=st.lists(LAYER_DOCS, min_size=2, max_size=6),
    edges=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=12),
)
def test_a_preset_merged_once_per_file_equals_one_merged_along_every_path(docs, edges) -> None:
    """The same raw preset, the same provenance, and the same blame for every key as the loader
    that merged each file once per path to it (a repeated layer counts at its last application)."""
    bases: dict[int, list[int]] = {i: [] for i in range(len(docs))}
    for a, b in edges:  # only from a file to a later one: a DAG, with diamonds
        if a < b < len(docs) and b not in bases[a]:
            bases[a].append(b)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch).resolve()
        for i, doc in enumerate(docs):
            extends = [f"f{j}.toml" for j in bases[i]]
            text = f"extends = {extends}\n" + "".join(
                f"[{table}]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in keys.items())
                for table, keys in doc.items()
            )
            write(root / f"f{i}.toml", text)
        layered = presets.read_preset(root / "f0.toml")
        raw, provenance, layers = naive_read(root / "f0.toml")
    assert layered.raw == raw and layered.provenance == provenance
    assert layered.layers == list(dict.fromkeys(reversed(layers)))[::-1]
    for key in provenance:
        for other in provenance:
            assert blame(layered.provenance, layered.layers, key, (key, other), "-") == blame(
                provenance, layers, key, (key, other), "-"
            )


def toml_value(value: object) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {v}" for k, v in value.items()) + " }"
    return str(value)


# -- --set ----------------------------------------------------------------------------------------

STAGED = """
[[stages]]
name = "pretrain"
[[stages]]
name = "finetune"
init_from = "pretrain"
train = { lr = 1e-3 }
"""


@pytest.mark.parametrize(
    "key",
    ["stages.finetune.train.lr", "stages[1].train.lr", "stages.1.train.lr"],
)
def test_set_addresses_a_stage_by_name_or_index(tmp_path: Path, key: str) -> None:
    config = load_preset(write(tmp_path / "p.toml", STAGED), [f"{key}=5e-4"]).config
    assert config.stage("finetune").train.lr == 5e-4
    assert config.stage("pretrain").train.lr == TrainConfig().lr


@pytest.mark.parametrize(
    ("assignment", "expected"),
    [
        ("train.lr=3e-4", 3e-4),
        ("train.lr=1", 1.0),
        ("model.mlp=gelu", "gelu"),  # a bare word is a string
        ('model.mlp="gelu"', "gelu"),
        ("train.betas=[0.5, 0.6]", (0.5, 0.6)),
        ("model.tie_embeddings=false", False),
        ("train.steps=1_000", 1000),
    ],
)
def test_set_takes_toml_values(tmp_path: Path, assignment: str, expected: object) -> None:
    config = load_preset(write(tmp_path / "p.toml", ""), [assignment]).config
    key = assignment.partition("=")[0]
    section, name = key.split(".")
    holder = config.stages[0] if section in ("train", "data") else config
    assert getattr(getattr(holder, section), name) == expected


def test_set_wins_over_every_file_and_the_last_set_wins(tmp_path: Path) -> None:
    write(tmp_path / "base.toml", "[train]\nlr = 1e-3\n")
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[train]\nlr = 2e-3\n')
    config = load_preset(child, ["train.lr=3e-3", "train.lr=4e-3"]).config
    assert config.stages[0].train.lr == 4e-3


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("train.lr", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        (".=1", "expected KEY=VALUE"),
        ("[0]=1", "only stages take an index"),
        ("train[0]=1", "only stages take an index"),
        ("extends=other.toml", "cannot be set with --set"),
        ("stages.nope.train.lr=1", "no stage 'nope'"),
        ("stages.finetun.train.lr=1", "did you mean 'finetune'"),
        ("train.lr.x=1", "train.lr: expected a number, got {'x': 1} (table)"),
        ("name.x=1", "name: expected a non-empty string"),
        ("stages[0].name.x=1", "stages[0].name is not a table"),
        ("train.lr=[1,", "invalid TOML value"),
        ("train.steps=" + "9" * 5000, "invalid TOML value"),
        ("train.lr=-1", "train.lr: must be > 0.0 (got -1.0)"),
        ("trian.lr=1", "did you mean 'train'"),
    ],
)
def test_bad_set_is_a_config_error_naming_the_set(tmp_path: Path, assignment: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_preset(write(tmp_path / "p.toml", STAGED), [assignment])
    assert caught.value.exit_code == ExitCode.USAGE
    problem = "\n".join(caught.value.problems)
    assert f"--set {assignment}" in problem
    assert message in problem


def test_set_on_an_implicit_stage_creates_the_stage_override(tmp_path: Path) -> None:
    config = load_preset(
        write(tmp_path / "p.toml", "[train]\nlr = 1e-3\n"), ["stages[0].train.lr=2e-3"]
    ).config
    assert config.stages[0].name == "main" and config.stages[0].train.lr == 2e-3


def test_provenance_records_where_each_key_came_from(tmp_path: Path) -> None:
    write(tmp_path / "base.toml", "[model]\ndim = 32\n")
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[train]\nlr = 2e-3\n')
    loaded = load_preset(child, ["eval.every=5"])
    assert loaded.source_of(("model", "dim")).endswith("base.toml")
    assert loaded.source_of(("train", "lr")).endswith("child.toml")
    assert loaded.source_of(("eval", "every")) == "--set eval.every=5"
    assert loaded.source_of(("numerics", "threads")).endswith("child.toml")  # unset: the preset itself


# -- round trip -----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(config=configs())
def test_config_round_trips_through_the_converter(config: Config) -> None:
    plain = converter.unstructure(config)
    assert converter.structure(plain, Config) == config


# -- robustness: garbled presets are reported, never crash ----------------------------------------


def _load_only_config_errors(content: str | bytes) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "garbled.toml"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        try:
            load_preset(path)
        except ConfigError as exc:
            assert exc.problems
            assert all(problem.startswith(str(path)) for problem in exc.problems), exc.problems


@settings(max_examples=60, deadline=None)
@given(content=st.binary(max_size=200) | TOMLISH)
def test_garbled_text_raises_only_config_errors(content: str | bytes) -> None:
    _load_only_config_errors(content)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=TOML_DOCS | mutated_docs(), seed=st.integers(0, 2**16))
def test_valid_toml_with_wrong_keys_and_types_raises_only_config_errors(doc: dict, seed: int) -> None:
    """Random keys, values of random types (dates, NaN, huge integers, nested arrays), inside an
    otherwise valid preset or on their own."""
    _load_only_config_errors(emit(doc, random.Random(seed)))


@settings(max_examples=40, deadline=None)
@given(
    assignments=st.lists(
        st.text(max_size=16)
        | st.tuples(
            st.sampled_from(
                ["train.lr", "stages[0]", "stages.1", "stages.x.y", "data.files", "", ".", "a..b"]
            ),
            st.text(max_size=8),
        ).map("=".join),
        max_size=3,
    )
)
def test_garbled_set_raises_only_config_errors(assignments: list[str]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = write(Path(scratch) / "p.toml", STAGED)
        try:
            load_preset(path, assignments)
        except ConfigError as exc:
            assert exc.problems


# -- the generated reference ----------------------------------------------------------------------


def _schema_has(key: str) -> bool:
    """Whether a documented key path names a key of the preset language."""
    parts = key.split(".")
    if parts[0] == "stages[]":
        if parts[1] not in STAGE_KEYS:
            return False
        cls: type | None = Stage
        parts = parts[1:]
    elif len(parts) == 1:
        return parts[0] in TOP_LEVEL_KEYS
    else:
        cls = SECTIONS.get(parts[0])
        parts = parts[1:]
    for part in parts:
        part = part.removesuffix("[]")  # an array of tables: its element's keys follow
        if cls is None or part not in attrs.fields_dict(cls):
            return False
        nested = typing.get_type_hints(cls)[part]
        tables = [t for t in typing.get_args(nested) if attrs.has(t)]  # a word or a table
        cls = nested if attrs.has(nested) else (tables[0] if tables else None)
    return True


def test_reference_documents_only_keys_of_the_schema() -> None:
    documented = [doc.key for doc in reference()]
    assert len(documented) == len(set(documented))
    assert [key for key in documented if not _schema_has(key)] == []
    assert not _schema_has("train.nope") and not _schema_has("stages[].nope")  # the check can fail


def _always_a_table(field: attrs.Attribute) -> bool:
    """A key whose default is a table (its own keys are documented, not it)."""
    default = field.default
    if isinstance(default, attrs.Factory) and not default.takes_self:  # type: ignore[arg-type]
        default = default.factory()
    return attrs.has(type(default))


def test_reference_documents_every_key_of_the_schema() -> None:
    documented = {doc.key for doc in reference()}
    expected = {*TOP_LEVEL_KEYS} - set(SECTIONS)
    for section, cls in SECTIONS.items():
        for path, _ in leaves(converter.unstructure(cls())):
            expected.add(".".join([section, *map(str, path)]))
    expected |= {f"stages[].{key}" for key in STAGE_KEYS}
    expected |= {f"data.tokenizer.{f.name}" for f in attrs.fields(TokenizerConfig)}  # a word or a table
    # Keys a default leaves out: those that enter a plan only when set (`since`), tables that
    # exist only when written, and the keys of an array's tables.
    for section, cls in SECTIONS.items():
        expected |= {f"{section}.{f.name}" for f in attrs.fields(cls) if not _always_a_table(f)}
    tables = (
        ("model.init", InitConfig),
        ("model.rope_scaling", RopeScalingConfig),
        ("train.lora", LoraConfig),
        ("eval.suites[]", SuiteConfig),
    )
    for key, cls in tables:
        expected |= {f"{key}.{f.name}" for f in attrs.fields(cls)}
    assert documented == expected


def test_reference_defaults_and_choices_are_the_real_ones(tmp_path: Path) -> None:
    """Setting each key to its documented default changes nothing; each documented choice loads."""
    preset = write(tmp_path / "p.toml", "")
    for doc in reference():
        if doc.default.startswith("(") or doc.key in ("extends", "stages"):
            continue
        if doc.key.startswith(
            ("data.tokenizer.", "model.init.", "model.rope_scaling.", "train.lora.", "eval.suites[].")
        ):
            continue  # keys of a table that exists only when written
        key = doc.key.replace("stages[]", "stages[0]")
        assert load_preset(preset, [f"{key}={doc.default}"]).config == Config(), doc.key
        for choice in doc.choices:
            load_preset(
                preset, [f'{key}="{choice}"'] + (['data.files=["p.toml"]'] if choice == "files" else [])
            )
        if doc.choices:
            with pytest.raises(ConfigError, match="must be one of"):
                load_preset(preset, [f'{key}="not-a-choice"'])


def test_reference_renders_markdown() -> None:
    command = [sys.executable, "-m", "buildtrain.config.reference"]
    text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert text == render()
    assert text.startswith("## Preset reference\n")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(reference())
    assert "| `train.lr` | float | `0.003` | > 0.0 | peak learning rate |" in rows
    assert (
        '| `model.mlp` | string | `"swiglu"` | `swiglu`, `gelu` | feed-forward block: swiglu or gelu |'
        in rows
    )
    for heading in ("### top level", *(f"### [{s}]" for s in SECTIONS), "### [[stages]]"):
        assert heading in text.splitlines()
