"""The plan hash covers what the run will compute and nothing else.

Same resolved config -> same hash, however the preset is spelled, split over files, overridden or
placed on disk; any change of a value the run reads -> another hash. Plans round-trip through the
store unchanged, and data files are hashed once.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from strategies import (
    PresetSpec,
    assignment,
    decoy,
    delete_leaf,
    emit,
    layout,
    leaves,
    preset_specs,
    put_leaf,
    rename_files,
    set_key,
    write_preset,
)

from buildtrain.config.checks import choices_of
from buildtrain.config.convert import converter
from buildtrain.config.preflight import cuda_available
from buildtrain.config.schema import SECTIONS, Config, NumericsConfig, SyntheticConfig
from buildtrain.errors import ConfigError
from buildtrain.kinds import KINDS
from buildtrain.plan.plan import Plan
from buildtrain.plan.planner import Planned, plan_preset
from buildtrain.plan.stored import load_plan
from buildtrain.plan.toolchain import Machine, cpu_vendor, fingerprint, portable_target, vendor_name
from buildtrain.store.store import Store

HYPOTHESIS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OLD = time.time() - 3600  # an mtime outside the stat cache's racy window


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A fresh directory per hypothesis example (tmp_path is shared by all examples)."""
    with tempfile.TemporaryDirectory() as name:
        yield Path(name).resolve()


def plan(preset: Path, overrides: list[str] | tuple[str, ...] = (), store: Path | None = None) -> Planned:
    return plan_preset(preset, overrides, Store(store or preset.parent / ".bt"))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# -- invariance -----------------------------------------------------------------------------------


@HYPOTHESIS
@given(spec=preset_specs(), seeds=st.tuples(st.integers(0, 2**32), st.integers(0, 2**32)))
def test_spelling_does_not_change_the_hash(spec: PresetSpec, seeds: tuple[int, int]) -> None:
    """Key order, whitespace, comments, inline tables vs sections vs dotted keys, number spelling
    (1e-3/0.001, 1_000/1000/0x3e8), defaults written or left out, stage settings hoisted into
    [train]/[data] or repeated per stage: one resolved config, one plan hash."""
    with scratch() as root:
        first, second = root / "first.toml", root / "second.toml"
        write_preset(first, spec, random.Random(seeds[0]))
        write_preset(second, spec, random.Random(seeds[1]))
        note(first.read_text())
        note(second.read_text())
        a, b = plan(first), plan(second)
        assert a.loaded.config == b.loaded.config
        assert a.plan.hash == b.plan.hash


@HYPOTHESIS
@given(spec=preset_specs(), seed=st.integers(0, 2**32), names=st.data())
def test_moving_and_renaming_files_does_not_change_the_hash(
    spec: PresetSpec, seed: int, names: st.DataObject
) -> None:
    """Another directory, another preset name, data files renamed and moved (same contents),
    another store: the same plan hash."""
    new_names = names.draw(
        st.lists(
            st.text("xyz0123", min_size=1, max_size=6),
            min_size=len(spec.files),
            max_size=len(spec.files),
            unique=True,
        )
    )
    mapping = {old: f"corpus/deeper/{new}.text" for old, new in zip(spec.files, new_names, strict=True)}
    moved = rename_files(spec, mapping)
    with scratch() as one, scratch() as two:
        here = one / "project" / "preset.toml"
        there = two / "elsewhere" / "renamed-preset.toml"
        write_preset(here, spec, random.Random(seed))
        write_preset(there, moved, random.Random(seed + 1))
        assert plan(here, store=one / "store-a").plan.hash == plan(there, store=two / "store-b").plan.hash


def _split_for_extends(
    doc: dict[str, Any], rng: random.Random
) -> tuple[dict[str, Any], dict[str, Any], list[tuple[tuple[str | int, ...], Any]]]:
    """Spread a preset document over a base file, the preset that extends it, and --set
    overrides; the base holds decoys for what the later layers override."""
    base: dict[str, Any] = {}
    child = json.loads(json.dumps(doc))  # a deep copy
    sets: list[tuple[tuple[str | int, ...], Any]] = []
    for path, value in leaves(doc):
        if path[0] == "stages":
            continue
        choice = rng.choice(["base", "child", "decoy", "set"])
        if choice == "set" and "files" not in path:
            sets.append((path, value))
            if rng.random() < 0.5:
                put_leaf(base, path, decoy(value))
            delete_leaf(child, path)
        elif choice == "base":
            put_leaf(base, path, value)
            delete_leaf(child, path)
        elif choice == "decoy":
            put_leaf(base, path, decoy(value))
    if "stages" in doc:
        stages = child["stages"]
        for path, value in leaves(stages):
            if path[-1] != "files" and rng.random() < 0.2:
                sets.append((("stages", *path), value))
                if rng.random() < 0.5:
                    delete_leaf(child, ("stages", *path))
        if rng.random() < 0.5:  # the whole array lives in the base (arrays are replaced, not merged)
            base["stages"] = child.pop("stages")
        elif rng.random() < 0.5:
            base["stages"] = [{"name": "decoy-stage"}]
    return base, child, sets


def _rebase_files(doc: dict[str, Any], prefix: str) -> None:
    """Data paths are relative to the file that names them: rewrite them for a base elsewhere."""
    tables = [doc.get("data")] + [s.get("data") for s in doc.get("stages", []) if isinstance(s, dict)]
    for table in tables:
        if isinstance(table, dict) and "files" in table:
            table["files"] = [prefix + name for name in table["files"]]


@HYPOTHESIS
@given(spec=preset_specs(), seed=st.integers(0, 2**32))
def test_extends_and_set_reach_the_same_hash_as_one_file(spec: PresetSpec, seed: int) -> None:
    rng = random.Random(seed)
    doc = layout(spec, rng)
    base, child, sets = _split_for_extends(doc, rng)
    _rebase_files(base, "../")
    child["extends"] = rng.choice(["common/base.toml", ["common/base.toml"]])
    overrides = [assignment(path, value, rng) for path, value in sets]
    with scratch() as root:
        spec.write_files(root)
        write(root / "flat.toml", emit(doc, rng))
        write(root / "common" / "base.toml", emit(base, rng))
        write(root / "child.toml", emit(child, rng))
        note(f"base:\n{(root / 'common' / 'base.toml').read_text()}")
        note(f"child:\n{(root / 'child.toml').read_text()}\n--set {overrides}")
        flat, layered = plan(root / "flat.toml"), plan(root / "child.toml", overrides)
        assert layered.loaded.config == flat.loaded.config
        assert layered.plan.hash == flat.plan.hash


def _alternatives(path: tuple[str | int, ...], value: Any, config: Config) -> list[Any]:
    """Other values for one key, to try in order (some break a rule of the schema)."""
    if isinstance(value, bool):
        return [not value]
    if path[0] == "stages" and path[-1] in ("name", "init_from"):
        return [stage.name for stage in config.stages if stage.name != value] + [f"{value}-x"]
    if isinstance(value, str):
        return [c for c in _choices_for(path) if c != value] or [value + "-x"]
    if isinstance(value, int):
        return [value + 1, value * 2, value // 2, value - 1, value + 2]
    if isinstance(value, float):
        return [value * 2, value / 2, value + 0.25, value - 0.25, 0.5, 0.1]
    if isinstance(value, list):  # betas
        return [[value[0] / 2, value[1]], [value[0], value[1] / 2], [0.5, 0.5]]
    return []


def _choices_for(path: tuple[str | int, ...]) -> tuple[str, ...]:
    """The allowed values of a choice key (`model.mlp`, `stages[0].data.source`), else ()."""
    classes = {**SECTIONS, "synthetic": SyntheticConfig}
    cls = classes.get(str(path[-2])) if len(path) > 1 else None
    return (choices_of(attrs.fields_dict(cls)[str(path[-1])]) or ()) if cls else ()


def _hashed_leaves(config: Config) -> list[tuple[tuple[str | int, ...], Any]]:
    """Every key the run reads: all but paths, the synthetic settings of a files stage, the text
    field or column of another format, and the thread count under the portable profile."""
    found = []
    for path, value in leaves(converter.unstructure(config)):
        if path[-1] == "files":
            continue
        unused_synthetic = path[0] == "stages" and path[3:4] == ("synthetic",)
        if unused_synthetic and config.stages[int(path[1])].data.source == "files":  # type: ignore[arg-type]
            continue
        if path == ("numerics", "threads") and config.numerics.profile == "portable":
            continue
        if path[:2] == ("eval", "suites"):  # tables naming files: tests/test_suites.py changes them
            continue
        if (
            path in (("eval", "subset"), ("eval", "seed"), ("eval", "checkpoints_every"))
            and not config.eval.suites
        ):
            continue  # they draw the suites' questions: read (and hashed) only with suites
        if path[0] == "stages" and path[3:] in (("text_field",), ("text_column",)):
            # read only under their format (jsonl, parquet), and hashed only there
            wanted = {"text_field": "jsonl", "text_column": "parquet"}[str(path[3])]
            if config.stages[int(path[1])].data.format != wanted:  # type: ignore[arg-type]
                continue
        found.append((path, list(value) if isinstance(value, tuple) else value))
    return found


def assert_change_is_hashed(path: tuple[str | int, ...], before: Planned, after: Planned) -> None:
    """The plan hash changes; and unless the key is a label (plan or stage name) or configures a
    step the plan does not have (export off), the change reaches a step hash too."""
    assert after.plan.hash != before.plan.hash, path
    label = path[-1] == "name"
    absent = path[0] == "export" and path != ("export", "enabled") and not before.loaded.config.export.enabled
    if not (label or absent):
        assert {s.hash for s in after.plan.steps} != {s.hash for s in before.plan.steps}, path


@HYPOTHESIS
@given(spec=preset_specs(), choice=st.data())
def test_changing_any_single_value_changes_the_hash(spec: PresetSpec, choice: st.DataObject) -> None:
    with scratch() as root:
        write_preset(root / "p.toml", spec, random.Random(0))
        before = plan(root / "p.toml")
        path, value = choice.draw(st.sampled_from(_hashed_leaves(before.loaded.config)))
        note(f"changing {path} from {value!r}")
        for other in _alternatives(path, value, before.loaded.config):
            try:
                after = plan(root / "p.toml", [assignment(path, other, random.Random(0))])
            except ConfigError:
                continue  # not a valid value here (a shape rule, a range); try the next one
            if after.loaded.config == before.loaded.config:
                continue
            assert_change_is_hashed(path, before, after)
            return
        note(f"no valid other value for {path}")  # a single-choice key, or a shape rule in the way


def test_every_leaf_of_the_config_can_be_changed_and_changes_the_hash(tmp_path: Path) -> None:
    """A deterministic sweep of the example pipeline: every key it resolves, one at a time."""
    preset = Path(__file__).resolve().parent.parent / "examples" / "pretrain_finetune.toml"
    store = tmp_path / ".bt"
    before = plan_preset(preset, [], Store(store))
    unchangeable = []
    for path, value in _hashed_leaves(before.loaded.config):
        for other in _alternatives(path, value, before.loaded.config):
            try:
                after = plan_preset(preset, [assignment(path, other, random.Random(0))], Store(store))
            except ConfigError:
                continue
            if after.loaded.config == before.loaded.config:
                continue
            assert_change_is_hashed(path, before, after)
            break
        else:
            unchangeable.append(set_key(path))
    # Keys with a single allowed value, and keys that no --set alone can change validly here.
    expected = [
        "eval.suite",
        "stages[0].name",  # another name breaks the finetune stage's init_from
        "stages[0].init_from",  # the only other stage comes later
        "stages[1].init_from",  # the only earlier stage is the one it names; none cannot be --set
        "stages[0].data.source",  # files: the pretrain stage lists none
        "stages[0].data.synthetic.kind",
        "stages[0].data.tokenizer",
        "stages[0].train.optimizer",
        "stages[1].data.source",  # synthetic: the finetune stage lists files
        "stages[1].data.tokenizer",
        "stages[1].train.optimizer",
    ]
    if not cuda_available():
        expected.append("numerics.device")  # cuda is refused without a device
    assert sorted(unchangeable) == sorted(expected)


def test_threads_enter_the_hash_only_under_native(tmp_path: Path) -> None:
    preset = write(tmp_path / "p.toml", "")

    def hash_with(*overrides: str) -> str:
        return plan(preset, overrides).plan.hash

    assert hash_with("numerics.threads=1") == hash_with("numerics.threads=2") == hash_with()
    native = [hash_with("numerics.profile=native", f"numerics.threads={n}") for n in (1, 2)]
    assert native[0] != native[1]
    assert hash_with("numerics.profile=native", "numerics.threads=1") != hash_with("numerics.threads=1")


def machine(target: str, model: str) -> Machine:
    """A machine that computes portable plans for `target`, its CPU named `model`."""
    cpu = {"arch": "x86_64", "isa": "avx512", "cpu": model}
    return Machine(
        torch="2.13.0+cpu@cf30153c4c13",
        cpu=cpu,
        target=target,
        gpu={},
        cores=2,
        tokenizers="0.22.1",
        kernels="fused",
    )


def test_the_portable_hash_names_neither_the_cpu_vendor_nor_the_model() -> None:
    """One portable plan trains to the same weights on an Intel Xeon and an AMD EPYC (MKL made to
    take the asked branch on both, executor/process/mkl.py): a portable hash stands for the class of CPU,
    not its vendor or model; native's names the model."""
    xeon = machine(portable_target(), "Intel(R) Xeon(R) Processor")
    other_xeon = machine(portable_target(), "Intel(R) Xeon(R) Gold 6338")
    epyc = machine(portable_target(), "AMD EPYC 9B14")
    portable, native = NumericsConfig(), NumericsConfig(profile="native", threads=1)

    def facts(numerics: NumericsConfig, on: Machine) -> dict[str, Any]:
        return fingerprint(KINDS["train"].computes, numerics, torch=True, machine=on)

    assert facts(portable, xeon) == facts(portable, other_xeon) == facts(portable, epyc)
    assert facts(native, xeon) != facts(native, other_xeon)
    assert facts(native, xeon) != facts(native, epyc)


def test_this_machines_portable_target_is_the_cpu_class_without_its_vendor(tmp_path: Path) -> None:
    planned = plan(write(tmp_path / "p.toml", "")).plan
    train = next(step for step in planned.steps if step.kind == "train")
    assert train.toolchain["target"] == portable_target()
    if platform.machine() in ("x86_64", "AMD64"):
        assert portable_target() == "x86_64-avx2"
        if os.path.exists("/proc/cpuinfo"):
            assert cpu_vendor() != "unknown"  # still read from this machine, for messages
            assert cpu_vendor() not in json.dumps(train.toolchain)


@pytest.mark.parametrize(
    ("line", "name"),
    [
        ("vendor_id\t: GenuineIntel", "intel"),
        ("vendor_id\t: AuthenticAMD", "amd"),
        ("vendor_id\t: HygonGenuine", "hygongenuine"),
        ("model name\t: an emulator without a vendor", "unknown"),
    ],
)
def test_the_vendor_is_read_from_cpuinfo(line: str, name: str) -> None:
    assert vendor_name(f"processor\t: 0\n{line}\nflags\t\t: fpu avx2\n") == name


def test_unused_synthetic_settings_do_not_enter_a_files_stage(tmp_path: Path) -> None:
    write(tmp_path / "data" / "a.txt", "hello")
    preset = write(tmp_path / "p.toml", '[data]\nsource = "files"\nfiles = ["data/a.txt"]\n')
    assert plan(preset).plan.hash == plan(preset, ["data.synthetic.seed=9"]).plan.hash


def test_store_location_and_time_do_not_enter_the_hash(tmp_path: Path) -> None:
    preset = write(tmp_path / "p.toml", 'name = "x"\n')
    first = plan(preset, store=tmp_path / "one")
    store_two = tmp_path / "elsewhere" / "two"
    second = plan(preset, store=store_two)
    assert first.plan.hash == second.plan.hash
    stored = (store_two / "plans" / f"{second.plan.hash}.json").read_bytes()
    assert stored == (tmp_path / "one" / "plans" / f"{first.plan.hash}.json").read_bytes()
    assert str(tmp_path).encode() not in stored  # no path anywhere in what is hashed
    assert b"created" not in stored and b"planned" not in stored  # timestamps live in .meta.json


def test_data_file_content_enters_the_hash(tmp_path: Path) -> None:
    data = write(tmp_path / "data" / "a.txt", "hello")
    preset = write(tmp_path / "p.toml", '[data]\nsource = "files"\nfiles = ["data/*.txt"]\n')
    before = plan(preset).plan.hash
    data.write_text("hello!")
    assert plan(preset).plan.hash != before
    data.write_text("hello")
    assert plan(preset).plan.hash == before


# -- round trips ----------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=preset_specs())
def test_plans_round_trip_through_the_store(spec: PresetSpec) -> None:
    with scratch() as root:
        write_preset(root / "p.toml", spec, random.Random(0))
        store = Store(root / ".bt")
        planned = plan_preset(root / "p.toml", [], store).plan
        assert Plan.from_body(planned.to_body(), kinds=KINDS) == planned
        loaded = load_plan(store, planned.hash[:8])
        assert loaded == planned
        assert loaded.hash == planned.hash
        assert Plan.from_body(json.loads(json.dumps(planned.to_body())), kinds=KINDS) == planned


def test_a_tampered_plan_body_is_refused(tmp_path: Path) -> None:
    planned = plan(write(tmp_path / "p.toml", "")).plan
    body = json.loads(json.dumps(planned.to_body()))
    body["steps"][1]["config"]["train"]["lr"] = 1.0
    with pytest.raises(ValueError, match="recorded hash does not match"):
        Plan.from_body(body, kinds=KINDS)
    body = json.loads(json.dumps(planned.to_body()))
    body["steps"] = list(reversed(body["steps"]))
    with pytest.raises(ValueError, match="does not precede it"):
        Plan.from_body(body, kinds=KINDS)


def test_a_plan_naming_a_kind_outside_the_registry_is_refused(tmp_path: Path) -> None:
    """The plan model does not know the kinds (they sit above it): its reader is given them."""
    body = json.loads(json.dumps(plan(write(tmp_path / "p.toml", "")).plan.to_body()))
    Plan.from_body(body, kinds=KINDS)
    with pytest.raises(ValueError, match="unknown step kind 'train'"):
        Plan.from_body(body, kinds=set(KINDS) - {"train"})


# -- the stat cache -------------------------------------------------------------------------------


def _files_preset(root: Path) -> tuple[Path, Path]:
    data = write(root / "data" / "a.txt", "some text\n" * 100)
    os.utime(data, (OLD, OLD))
    return write(root / "p.toml", '[data]\nsource = "files"\nfiles = ["data/*.txt"]\n'), data


def test_a_second_plan_does_not_rehash_data(tmp_path: Path) -> None:
    preset, data = _files_preset(tmp_path)
    first = plan(preset)
    assert first.hashed_bytes == data.stat().st_size
    second = plan(preset)
    assert second.hashed_bytes == 0
    assert second.plan.hash == first.plan.hash


def test_a_modified_data_file_is_rehashed(tmp_path: Path) -> None:
    preset, data = _files_preset(tmp_path)
    first = plan(preset)
    data.write_text("other text\n" * 100)
    os.utime(data, (OLD + 5, OLD + 5))
    second = plan(preset)
    assert second.hashed_bytes == data.stat().st_size
    assert second.plan.hash != first.plan.hash


@pytest.mark.parametrize("damage", ["garbage", "wrong-digest", "truncated"])
def test_a_corrupted_stat_cache_is_discarded(tmp_path: Path, damage: str) -> None:
    preset, data = _files_preset(tmp_path)
    first = plan(preset)
    cache = tmp_path / ".bt" / "cache" / "files.json"
    body = cache.read_bytes()
    if damage == "garbage":
        cache.write_bytes(b"\x00not json")
    elif damage == "truncated":
        cache.write_bytes(body[: len(body) // 2])
    else:  # a plausible cache whose entry lies about the content: must not be believed
        claimed, _, raw = body.partition(b"\n")
        tampered = json.loads(raw)
        for entry in tampered["entries"].values():
            entry["blake3"] = "0" * 64
        cache.write_bytes(claimed + b"\n" + json.dumps(tampered).encode())
    second = plan(preset)
    assert second.hashed_bytes == data.stat().st_size  # rehashed, not trusted
    assert second.plan.hash == first.plan.hash
    assert plan(preset).hashed_bytes == 0  # and rebuilt


def test_a_moved_and_renamed_copy_of_an_example_plans_alike(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parent.parent
    original = plan_preset(repo / "examples" / "own_text.toml", [], Store(tmp_path / "one")).plan
    copy = tmp_path / "copy"
    write(copy / "base" / "small.toml", (repo / "presets" / "tiny.toml").read_text())
    preset = (repo / "examples" / "own_text.toml").read_text()
    preset = preset.replace('"../presets/tiny.toml"', '"../base/small.toml"').replace(
        '"data/*.txt"', '"texts/*.md"'
    )
    write(copy / "mine" / "renamed.toml", "# a copy\n" + preset)
    for number, source in enumerate(sorted((repo / "examples" / "data").glob("*.txt"))):
        (copy / "mine" / "texts").mkdir(parents=True, exist_ok=True)
        (copy / "mine" / "texts" / f"{9 - number}.md").write_bytes(source.read_bytes())
    moved = plan_preset(copy / "mine" / "renamed.toml", [], Store(tmp_path / "two")).plan
    assert moved.hash == original.hash
