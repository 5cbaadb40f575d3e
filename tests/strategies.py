"""Hypothesis strategies and a small TOML writer for preset tests, kept apart from the tests.

A preset is generated as a `PresetSpec`: the fully resolved value of every key of every stage,
plus the contents of its data files. `layout` turns a spec into one of the many TOML documents
that resolve to it (stage defaults hoisted into `[train]`/`[data]` or repeated per stage, default
values written or left out, the single `main` stage implicit or explicit), and `emit` writes a
document as TOML text in one of many spellings (key order, sections, inline tables or dotted
keys, comments, whitespace, `1e-3`/`0.001`/`1_000`/`0x3e8`). Both take a `random.Random`, so a
test can draw two of them and expect one plan hash.
"""

from __future__ import annotations

import datetime
import math
import random
import re
import string
import typing
from decimal import Decimal
from pathlib import Path
from typing import Any

import attrs
from hypothesis import strategies as st

from buildtrain.config.checks import choices_of
from buildtrain.config.schema import (
    Config,
    DataConfig,
    EvalConfig,
    ExportConfig,
    ModelConfig,
    NumericsConfig,
    RopeScalingConfig,
    Stage,
    SyntheticConfig,
    TokenizerConfig,
    TrainConfig,
)

# -- a TOML writer --------------------------------------------------------------------------------

BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def emit_key(key: str) -> str:
    return key if BARE_KEY.match(key) else emit_string(key)


def emit_string(text: str, rng: random.Random | None = None) -> str:
    """A TOML string: literal ('...') when it can be, else basic ("...") with escapes."""
    plain = all(c == "\t" or (" " <= c != "\x7f") for c in text)
    if rng is not None and plain and "'" not in text and rng.random() < 0.3:
        return f"'{text}'"
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char < " " or char == "\x7f":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _group_digits(digits: str, rng: random.Random) -> str:
    """Insert TOML underscores between digits (`1000` -> `1_000`)."""
    if len(digits) < 2 or rng.random() < 0.5:
        return digits
    out = digits[0]
    for char in digits[1:]:
        out += ("_" if rng.random() < 0.3 else "") + char
    return out


def emit_int(value: int, rng: random.Random) -> str:
    choice = rng.randrange(6)
    if value >= 0 and choice == 1:
        return "0x" + _group_digits(format(value, "x" if rng.random() < 0.5 else "X"), rng)
    if value >= 0 and choice == 2:
        return "0o" + format(value, "o")
    if value >= 0 and choice == 3:
        return "0b" + format(value, "b")
    sign = "-" if value < 0 else ("+" if choice == 4 else "")
    return sign + _group_digits(str(abs(value)), rng)


def emit_float(value: float, rng: random.Random, *, int_ok: bool = False) -> str:
    """One of many exact spellings of `value`: every decimal spelling of the shortest repr's
    exact value parses back to the same float."""
    if math.isnan(value):
        return rng.choice(["nan", "+nan", "-nan"])
    if math.isinf(value):
        return ("-" if value < 0 else rng.choice(["", "+"])) + "inf"
    sign = "-" if math.copysign(1.0, value) < 0 else rng.choice(["", "+"])
    magnitude = Decimal(repr(abs(value)))
    _, digit_tuple, exponent = magnitude.normalize().as_tuple()
    digits = "".join(map(str, digit_tuple))
    assert isinstance(exponent, int)
    choice = rng.randrange(5)
    if choice == 0:
        text = repr(abs(value))
    elif choice == 1:  # integer mantissa: 1e-3, 25e-5
        pad = rng.randrange(3) if digits != "0" else 0
        text = _group_digits(digits + "0" * pad, rng) + rng.choice("eE") + str(exponent - pad)
    elif choice == 2:  # one leading digit: 2.5e-4, 1.0E+2
        fraction = digits[1:] or "0"
        text = f"{digits[0]}.{fraction}e{rng.choice(['', '+'] if exponent + len(digits) - 1 >= 0 else [''])}{exponent + len(digits) - 1}"
    elif choice == 3 and -30 < exponent < 30:  # positional: 0.001, 1000.0
        positional = format(magnitude, "f")
        text = positional if "." in positional else positional + ".0"
        whole, _, fraction = text.partition(".")
        text = _group_digits(whole, rng) + "." + fraction
    else:
        text = repr(abs(value))
    if int_ok and value.is_integer() and abs(value) < 1e15 and rng.random() < 0.3:
        text = str(int(abs(value)))  # the float keys accept integers: `lr = 1` is 1.0
    return sign + text


def emit_value(value: Any, rng: random.Random, *, float_keys: bool = True) -> str:
    """A TOML value; `rng` picks the spelling."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return emit_int(value, rng)
    if isinstance(value, float):
        return emit_float(value, rng, int_ok=float_keys)
    if isinstance(value, str):
        return emit_string(value, rng)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        items = [emit_value(item, rng, float_keys=float_keys) for item in value]
        if items and rng.random() < 0.25:
            body = "".join(f"\n  {item}," for item in items)
            return f"[{body}\n]"
        return "[" + rng.choice([", ", ","]).join(items) + "]"
    if isinstance(value, dict):
        return _inline_table(value, rng)
    raise TypeError(f"no TOML for {value!r}")


def _inline_table(table: dict[str, Any], rng: random.Random) -> str:
    keys = list(table)
    rng.shuffle(keys)
    parts = [f"{emit_key(k)} = {emit_value(table[k], rng)}" for k in keys]
    return "{ " + ", ".join(parts) + " }" if parts else "{}"


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _dotted(prefix: str, table: dict[str, Any], rng: random.Random) -> list[tuple[str, str]]:
    """A table as dotted-key assignments: `model.dim = 64`."""
    if not table:
        return [(prefix, "{}")]
    pairs = []
    for key, value in table.items():
        path = f"{prefix}.{emit_key(key)}"
        if isinstance(value, dict) and value:
            pairs.extend(_dotted(path, value, rng))
        else:
            pairs.append((path, emit_value(value, rng)))
    return pairs


def _comment(rng: random.Random) -> str:
    return "# " + rng.choice(["note", "tuned by hand", "see README", "[train] lr = 1", ""])


def _assignment(key: str, value: str, rng: random.Random) -> str:
    space = rng.choice([" = ", "=", "  =  ", " =\t"])
    trailer = "  " + _comment(rng) if rng.random() < 0.15 else ""
    indent = rng.choice(["", "", "  ", "\t"])
    return f"{indent}{key}{space}{value}{trailer}"


def _emit_table(path: list[str], table: dict[str, Any], rng: random.Random, out: list[str]) -> None:
    body: list[str] = []
    later: list[tuple[str, Any]] = []
    for key, value in table.items():
        ekey = emit_key(key)
        if isinstance(value, dict):
            style = rng.choice(["section", "inline", "dotted"])
            if style == "section":
                later.append((key, value))
            elif style == "inline":
                body.append(_assignment(ekey, _inline_table(value, rng), rng))
            else:
                body.extend(_assignment(k, v, rng) for k, v in _dotted(ekey, value, rng))
        elif _is_table_array(value) and rng.random() < 0.7:
            later.append((key, value))
        else:
            body.append(_assignment(ekey, emit_value(value, rng), rng))
    rng.shuffle(body)
    for line in body:
        if rng.random() < 0.1:
            out.append(rng.choice(["", _comment(rng)]))
        out.append(line)
    rng.shuffle(later)
    for key, value in later:
        sub = [*path, emit_key(key)]
        out.append("")
        if isinstance(value, dict):
            out.append(rng.choice(["[", "[ "]) + ".".join(sub) + "]")
            _emit_table(sub, value, rng, out)
        else:
            for item in value:
                out.append("[[" + ".".join(sub) + "]]")
                _emit_table(sub, item, rng, out)


def emit(doc: dict[str, Any], rng: random.Random) -> str:
    """`doc` as TOML text, spelled as `rng` chooses."""
    out: list[str] = []
    if rng.random() < 0.5:
        out.append(_comment(rng))
    _emit_table([], shuffled(doc, rng), rng, out)
    return "\n".join(out) + rng.choice(["\n", "", "\n\n"])


def shuffled(value: Any, rng: random.Random) -> Any:
    """The same data with every table's keys in a random order."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


# -- resolved presets -----------------------------------------------------------------------------


def _choices(cls: type, name: str) -> st.SearchStrategy[str]:
    found = choices_of(attrs.fields_dict(cls)[name])
    assert found, f"{cls.__name__}.{name} has no choices"
    return st.sampled_from(found)


def positive(high: float) -> st.SearchStrategy[float]:
    nice = st.sampled_from([v for v in (1e-8, 1e-5, 3e-4, 0.001, 0.02, 0.5, 1.0, 2.5, 1e4) if v <= high])
    return st.one_of(nice, st.floats(min_value=0.0, max_value=high, exclude_min=True))


def unit(low: float = 0.0, high: float = 1.0, exclude_max: bool = False) -> st.SearchStrategy[float]:
    return st.floats(min_value=low, max_value=high, exclude_max=exclude_max)


SEEDS = st.integers(0, 2**40)


@st.composite
def rope_scalings(draw: st.DrawFn) -> dict[str, Any]:
    low = draw(positive(8.0))
    return {
        "rope_type": "llama3",
        "factor": draw(positive(64.0)),
        "low_freq_factor": low,
        "high_freq_factor": low + draw(st.floats(0.01, 8.0)),  # above low, or refused
        "original_max_position_embeddings": draw(st.integers(1, 1 << 17)),
    }


@st.composite
def models(draw: st.DrawFn) -> dict[str, Any]:
    head_dim = draw(st.sampled_from([2, 4, 8]))
    kv_heads, group = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    mlp, norm = draw(_choices(ModelConfig, "mlp")), draw(_choices(ModelConfig, "norm"))
    return {
        "dim": head_dim * kv_heads * group,
        "n_layers": draw(st.integers(1, 4)),
        "n_heads": kv_heads * group,
        "n_kv_heads": kv_heads,
        "ffn_hidden": draw(st.integers(1, 256)),
        "head_dim": draw(st.sampled_from([0, 0, 2, 6])),  # 0: dim / n_heads; else its own (qwen3)
        "mlp": mlp,
        "norm": norm,
        "norm_eps": draw(positive(0.1)),
        "rope_theta": draw(positive(1e6)),
        "tie_embeddings": draw(st.booleans()),
        "dropout": draw(unit(0.0, 0.9)),
        "init_std": draw(positive(1.0)),
        "qkv_bias": draw(st.booleans()),
        "qk_norm": (norm, mlp) == ("rmsnorm", "swiglu") and draw(st.booleans()),  # qwen3's blocks only
        "rope_scaling": draw(st.none() | rope_scalings()),
        "vocab_size": 0,  # the tokenizer's: a larger one is a checkpoint's (tests/test_import.py)
        "init": None,  # a checkpoint folder: tests/test_import.py plans those
    }


@st.composite
def trains(draw: st.DrawFn) -> dict[str, Any]:
    micro = draw(st.integers(1, 8))
    steps = draw(st.integers(1, 10_000))
    reduction = draw(_choices(TrainConfig, "reduction"))
    return {
        "steps": steps,
        "seed": draw(SEEDS),
        "seq_len": draw(st.integers(2, 256)),
        "batch_size": micro * draw(st.integers(1, 4)),
        "micro_batch_size": micro,
        "reduction": reduction,
        "optimizer": draw(_choices(TrainConfig, "optimizer")),
        "lr": draw(positive(10.0)),
        "betas": [draw(unit(exclude_max=True)), draw(unit(exclude_max=True))],
        "eps": draw(positive(1e-3)),
        "weight_decay": draw(unit(0.0, 1.0)),
        "grad_clip": draw(unit(0.0, 10.0)),
        "schedule": draw(_choices(TrainConfig, "schedule")),
        "warmup_steps": draw(st.integers(0, steps)),
        "min_lr_ratio": draw(unit()),
        "checkpoint_every": draw(st.integers(1, 1000)),
        "keep_checkpoints": draw(st.integers(1, 5)),
        "digest_every": draw(st.integers(1, 100)),
        "lora": None,  # adapters on a checkpoint's weights: tests/test_lora.py plans those
        "sharding": draw(st.sampled_from(["none", "fsdp"])) if reduction == "invariant" else "none",
        "activation_checkpointing": draw(st.booleans()),
    }


@st.composite
def datas(draw: st.DrawFn, files: list[str]) -> dict[str, Any]:
    use_files = bool(files) and draw(st.booleans())
    chosen = sorted(draw(st.sets(st.sampled_from(files), min_size=1))) if use_files else []
    return {
        "source": "files" if use_files else "synthetic",
        "files": chosen,
        "synthetic": {
            "kind": draw(_choices(SyntheticConfig, "kind")),
            "documents": draw(st.integers(1, 10**6)),
            "lines": draw(st.integers(1, 64)),
            "seed": draw(SEEDS),
        },
        # chat needs a tokenizer file and a template: tests/test_chat.py plans it
        "format": draw(_choices(DataConfig, "format").filter(lambda f: f != "chat")),
        "chat_template": "",
        "text_field": draw(st.sampled_from(["text", "content", "body"])),
        "text_column": draw(st.sampled_from(["text", "content", "body"])),
        "tokenizer": draw(
            st.one_of(
                _choices(DataConfig, "tokenizer"),
                st.fixed_dictionaries(
                    {
                        "kind": st.just("bpe"),
                        "vocab_size": st.integers(258, 1 << 17),
                        "min_frequency": st.integers(1, 10),
                        "end_of_document": st.sampled_from(["<|endoftext|>", "</s>"]),
                    }
                ),
            )
        ),
        "heldout_fraction": draw(st.floats(min_value=0.0, max_value=0.5, exclude_min=True)),
        "split_block": draw(st.integers(16, 4096)),
        "split_seed": draw(SEEDS),
        "shard_tokens": draw(st.integers(1024, 1 << 24)),
    }


@st.composite
def evals(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "suite": draw(_choices(EvalConfig, "suite")),
        "every": draw(st.integers(0, 100)),
        "seq_len": draw(st.integers(2, 256)),
        "batch_size": draw(st.integers(1, 16)),
        "max_batches": draw(st.integers(0, 10)),
        # Suites read files: tests/test_suites.py plans those. Without one, the suites' settings
        # enter no step (a step config reads them back as their defaults), so they stay there.
        "suites": [],
        "subset": 1.0,
        "seed": 0,
        "checkpoints_every": 0,
    }


@st.composite
def numerics(draw: st.DrawFn, devices: tuple[str, ...] = ("cpu",)) -> dict[str, Any]:
    return {
        "profile": draw(_choices(NumericsConfig, "profile")),
        "device": draw(st.sampled_from(devices)),
        "dtype": draw(_choices(NumericsConfig, "dtype")),
        "compile": draw(st.booleans()),
        "kernels": draw(_choices(NumericsConfig, "kernels")),
        "threads": draw(st.integers(0, 64)),
    }


@st.composite
def exports(draw: st.DrawFn) -> dict[str, Any]:
    return {"enabled": draw(st.booleans()), "dtype": draw(_choices(ExportConfig, "dtype"))}


# Preset and stage names become parts of paths, so the language admits only safe ones
# (`buildtrain.config.checks.SAFE_NAME`); `UNSAFE_NAMES` are ones it must refuse.
NAMES = st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,11}", fullmatch=True)
UNSAFE_NAMES = st.one_of(
    st.sampled_from(["/abs", "../up", "a/b", ".hidden", "..", ".", "a\x00b", "ä", "a b", "x" * 101]),
    st.text(min_size=1, max_size=12).filter(lambda t: not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", t)),
)
FILE_NAMES = st.text(alphabet=string.ascii_lowercase + string.digits + "_-", min_size=1, max_size=8)


@attrs.frozen
class PresetSpec:
    """A preset's resolved values (preset-shaped: stages carry their full data and train) and
    its data files (path relative to the preset -> bytes)."""

    values: dict[str, Any]
    files: dict[str, bytes]

    def write_files(self, root: Path) -> None:
        for name, content in self.files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(content)

    def config(self, root: Path) -> Config:
        """The config this spec resolves to, for a preset in `root`."""
        values = self.values

        def data(table: dict[str, Any]) -> DataConfig:
            files = tuple(str(root / name) for name in table["files"])
            rest = {k: v for k, v in table.items() if k not in ("files", "synthetic", "tokenizer")}
            tokenizer = table["tokenizer"]
            if isinstance(tokenizer, dict):
                tokenizer = TokenizerConfig(**tokenizer)
            return DataConfig(
                files=files, synthetic=SyntheticConfig(**table["synthetic"]), tokenizer=tokenizer, **rest
            )

        def model(table: dict[str, Any]) -> ModelConfig:
            scaling = table.get("rope_scaling")
            return ModelConfig(**{**table, "rope_scaling": scaling and RopeScalingConfig(**scaling)})

        def train(table: dict[str, Any]) -> TrainConfig:
            return TrainConfig(**{**table, "betas": tuple(table["betas"])})

        return Config(
            name=values["name"],
            model=model(values["model"]),
            eval=EvalConfig(**{**values["eval"], "suites": tuple(values["eval"]["suites"])}),
            numerics=NumericsConfig(**values["numerics"]),
            export=ExportConfig(**values["export"]),
            stages=tuple(
                Stage(
                    name=s["name"],
                    init_from=s["init_from"],
                    data=data(s["data"]),
                    train=train(s["train"]),
                )
                for s in values["stages"]
            ),
        )


@st.composite
def preset_specs(draw: st.DrawFn, max_stages: int = 3) -> PresetSpec:
    """A valid preset that plans on this machine: small model, CPU, data files that exist."""
    file_names = draw(st.lists(FILE_NAMES, max_size=3, unique=True))
    files = {f"data/{n}.txt": draw(st.binary(max_size=64)) for n in file_names}
    count = draw(st.integers(1, max_stages))
    names = draw(st.lists(NAMES, min_size=count, max_size=count, unique=True))
    stages = []
    for index, name in enumerate(names):
        init_from = draw(st.none() | st.sampled_from(names[:index])) if index else None
        stages.append(
            {"name": name, "init_from": init_from, "data": draw(datas(list(files))), "train": draw(trains())}
        )
    for stage in stages:  # a stage keeps the tokenizer of the stage it starts from
        stage["data"]["tokenizer"] = stages[0]["data"]["tokenizer"]
    values = {
        "name": draw(NAMES),
        "model": draw(models()),
        "eval": draw(evals()),
        "numerics": draw(numerics()),
        "export": draw(exports()),
        "stages": stages,
    }
    return PresetSpec(values=values, files=files)


@st.composite
def micro_specs(draw: st.DrawFn) -> PresetSpec:
    """A valid preset small enough to run to the end in seconds: synthetic data of a few thousand
    tokens, a model of a few thousand parameters, one to three updates per stage, one thread."""
    count = draw(st.integers(1, 2))
    names = draw(st.lists(NAMES, min_size=count, max_size=count, unique=True))
    stages = []
    for index, name in enumerate(names):
        data = draw(datas([]))
        data["synthetic"].update(documents=draw(st.integers(60, 150)), lines=draw(st.integers(4, 8)))
        data.update(heldout_fraction=draw(st.floats(0.2, 0.5)), split_block=draw(st.integers(16, 32)))
        train = draw(trains())
        steps = draw(st.integers(1, 3))
        micro = draw(st.integers(1, 2))
        train.update(
            steps=steps,
            seq_len=draw(st.integers(2, 32)),
            micro_batch_size=micro,
            batch_size=micro * draw(st.integers(1, 2)),
            warmup_steps=draw(st.integers(0, steps)),
            lr=draw(st.floats(1e-5, 1e-2)),
            eps=draw(st.sampled_from([1e-8, 1e-6])),
            checkpoint_every=draw(st.integers(1, 3)),
        )
        init_from = draw(st.none() | st.sampled_from(names[:index])) if index else None
        stages.append({"name": name, "init_from": init_from, "data": data, "train": train})
    tokenizer = draw(
        st.just("bytes")
        | st.fixed_dictionaries({"kind": st.just("bpe"), "vocab_size": st.integers(258, 320)})
    )
    for stage in stages:  # shared: a stage keeps the tokenizer of the stage it starts from
        stage["data"]["tokenizer"] = tokenizer
    model = draw(models())
    model.update(  # numbers that keep three updates finite (a theta of 5e-324 would not)
        n_layers=draw(st.integers(1, 2)),
        ffn_hidden=draw(st.integers(1, 64)),
        rope_theta=draw(st.sampled_from([100.0, 10000.0, 500000.0])),
        norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        init_std=draw(st.floats(0.005, 0.1)),
    )
    evaluation = draw(evals())
    evaluation.update(
        seq_len=draw(st.integers(2, 32)),
        max_batches=draw(st.integers(1, 2)),
        every=draw(st.sampled_from([0, 2])),
    )
    values = {
        "name": draw(NAMES),
        "model": model,
        "eval": evaluation,
        # Eager: a first torch.compile on the CPU takes most of a minute.
        "numerics": {**draw(numerics()), "profile": "portable", "threads": 1, "compile": False},
        "export": draw(exports()),
        "stages": stages,
    }
    return PresetSpec(values=values, files={})


@st.composite
def configs(draw: st.DrawFn) -> Config:
    """Valid `Config` objects, built directly (no loader), with any device."""
    spec = draw(preset_specs())
    config = spec.config(Path("/data"))
    devices = tuple(choices_of(attrs.fields_dict(NumericsConfig)["device"]) or ())
    return attrs.evolve(config, numerics=NumericsConfig(**draw(numerics(devices))))


# -- from a spec to a TOML document ---------------------------------------------------------------


DERIVED = object()  # a default computed from other fields (ffn_hidden from dim): never left out


def default_of(cls: type, key: str) -> Any:
    default = attrs.fields_dict(cls)[key].default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        if default.takes_self:
            return DERIVED
        default = default.factory()
    if attrs.has(type(default)):
        return attrs.asdict(default)
    return list(default) if isinstance(default, tuple) else default


def _nested(key: str, value: Any) -> bool:
    """A nested table split key by key (synthetic); a tokenizer table is written whole."""
    return isinstance(value, dict) and key != "tokenizer"


def _written(table: dict[str, Any]) -> dict[str, Any]:
    """The keys a TOML document can hold: None (an absent table, the default) is never written."""
    return {key: value for key, value in table.items() if value is not None}


def _sparse(table: dict[str, Any], cls: type, rng: random.Random) -> dict[str, Any]:
    """`table` with some keys that equal their default left out (they resolve alike)."""
    out = {}
    for key, value in _written(table).items():
        if _nested(key, value):
            hint = typing.get_type_hints(cls)[key]
            table = hint if attrs.has(hint) else next(a for a in typing.get_args(hint) if attrs.has(a))
            value = _sparse(value, table, rng)
            # an optional table (rope_scaling) stays even when empty: left out, it would be none
            if value or table is not hint or rng.random() < 0.5:
                out[key] = value
        elif value != default_of(cls, key) or rng.random() < 0.5:
            out[key] = value
    return out


def _hoist(tables: list[dict[str, Any]], cls: type, rng: random.Random) -> tuple[dict, list[dict]]:
    """Split per-stage tables into stage defaults and per-stage overrides (deep merge restores them)."""
    reference = rng.choice(tables)
    top: dict[str, Any] = {}
    for key, value in reference.items():
        if _nested(key, value):
            nested = {k: v for k, v in value.items() if rng.random() < 0.5}
            if nested:
                top[key] = nested
        elif rng.random() < 0.5:
            top[key] = value
    overrides = []
    for table in tables:
        override: dict[str, Any] = {}
        for key, value in table.items():
            if _nested(key, value):
                hoisted = top.get(key, {})
                sub = {
                    k: v
                    for k, v in value.items()
                    if k not in hoisted or hoisted[k] != v or rng.random() < 0.2
                }
                if sub:
                    override[key] = sub
            elif key not in top or top[key] != value or rng.random() < 0.2:
                override[key] = value
        overrides.append(override)
    return top, overrides


def _drop_defaults_without_top(
    override: dict[str, Any], top: dict[str, Any], cls: type, rng: random.Random
) -> dict[str, Any]:
    """Leave out override keys that equal their default when no stage default hides the default."""
    out = {}
    for key, value in override.items():
        if _nested(key, value):
            hoisted = top.get(key, {})
            sub = {
                k: v
                for k, v in value.items()
                if k in hoisted or v != default_of(SyntheticConfig, k) or rng.random() < 0.5
            }
            if sub:
                out[key] = sub
        elif key in top or value != default_of(cls, key) or rng.random() < 0.5:
            out[key] = value
    return out


def layout(spec: PresetSpec, rng: random.Random) -> dict[str, Any]:
    """One of the TOML documents that resolve to `spec` (defaults omitted or written, stage
    settings hoisted or repeated, the main stage implicit or explicit)."""
    values = spec.values
    doc: dict[str, Any] = {}
    if values["name"] != "unnamed" or rng.random() < 0.5:
        doc["name"] = values["name"]
    for section, cls in (
        ("model", ModelConfig),
        ("eval", EvalConfig),
        ("numerics", NumericsConfig),
        ("export", ExportConfig),
    ):
        table = _sparse(values[section], cls, rng)
        if table or rng.random() < 0.5:
            doc[section] = table
    stages = values["stages"]
    only = stages[0]
    if len(stages) == 1 and only["name"] == "main" and only["init_from"] is None and rng.random() < 0.6:
        for section, cls in (("data", DataConfig), ("train", TrainConfig)):
            doc[section] = _sparse(only[section], cls, rng)
        return doc
    entries: list[dict[str, Any]] = [{"name": s["name"]} for s in stages]
    for entry, stage in zip(entries, stages, strict=True):
        if stage["init_from"] is not None:
            entry["init_from"] = stage["init_from"]
    for section, cls in (("data", DataConfig), ("train", TrainConfig)):
        top, overrides = _hoist([_written(s[section]) for s in stages], cls, rng)
        if top or rng.random() < 0.3:
            doc[section] = top
        for entry, override in zip(entries, overrides, strict=True):
            override = _drop_defaults_without_top(override, top, cls, rng)
            if override or rng.random() < 0.3:
                entry[section] = override
    doc["stages"] = entries
    return doc


def write_preset(path: Path, spec: PresetSpec, rng: random.Random) -> None:
    """Write `spec`'s data files beside `path` and the preset itself in a random spelling."""
    spec.write_files(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(emit(layout(spec, rng), rng), encoding="utf-8")


def rename_files(spec: PresetSpec, mapping: dict[str, str]) -> PresetSpec:
    """The same preset with its data files at new relative paths (same contents)."""
    values = shuffled(spec.values, random.Random(0))
    for stage in values["stages"]:
        stage["data"]["files"] = sorted(mapping[name] for name in stage["data"]["files"])
    return PresetSpec(values=values, files={mapping[k]: v for k, v in spec.files.items()})


# -- leaves and --set -----------------------------------------------------------------------------

Leaf = tuple[tuple[str | int, ...], Any]


def leaves(value: Any, prefix: tuple[str | int, ...] = ()) -> list[Leaf]:
    """Every (key path, value) of nested data; arrays of tables are indexed, other arrays are leaves."""
    if isinstance(value, dict):
        found: list[Leaf] = []
        for key, item in value.items():
            found.extend(leaves(item, (*prefix, key)))
        return found
    if _is_table_array(value):
        found = []
        for index, item in enumerate(value):
            found.extend(leaves(item, (*prefix, index)))
        return found
    return [(prefix, value)]


def set_key(path: tuple[str | int, ...]) -> str:
    """A key path as `--set` spells it: `stages[1].train.lr`."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def assignment(path: tuple[str | int, ...], value: Any, rng: random.Random) -> str:
    return f"{set_key(path)}={emit_value(value, rng)}"


def delete_leaf(doc: dict[str, Any], path: tuple[str | int, ...]) -> None:
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]


def put_leaf(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    node: Any = doc
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]
    node[path[-1]] = value


def decoy(value: Any) -> Any:
    """A different value of the same kind, for a base preset that a later layer overrides."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-base"
    if isinstance(value, list):
        return [*value, value[0]] if value else ["decoy"]
    return "decoy"


# -- garbled input --------------------------------------------------------------------------------

SCHEMA_WORDS = [
    "name",
    "extends",
    "stages",
    "init_from",
    *[f.name for cls in (DataConfig, ModelConfig, TrainConfig, EvalConfig) for f in attrs.fields(cls)],
    *[f.name for cls in (NumericsConfig, ExportConfig, SyntheticConfig) for f in attrs.fields(cls)],
    "data",
    "model",
    "train",
    "eval",
    "numerics",
    "export",
    "synthetic",
]

KEYS = st.one_of(st.sampled_from(SCHEMA_WORDS), st.text(max_size=8))
SCALARS = st.one_of(
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**400]),  # beyond TOML's 64-bit integers
    st.floats(),  # NaN and infinities included: TOML has them
    st.text(max_size=12),
    st.sampled_from(["synthetic", "files", "cpu", "cuda", "native", "swiglu", "../x.toml", "*.txt"]),
    st.dates(),
    st.datetimes(timezones=st.none() | st.just(datetime.UTC)),
    st.times(),
)
TOML_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(KEYS, children, max_size=4),
    max_leaves=12,
)
TOML_DOCS = st.dictionaries(KEYS, TOML_VALUES, max_size=6)


@st.composite
def mutated_docs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid preset document with a few leaves replaced, added or removed: wrong types,
    unknown keys, bad ranges deep inside otherwise valid structure."""
    spec = draw(preset_specs(max_stages=2))
    doc = layout(spec, random.Random(draw(st.integers(0, 2**16))))
    for _ in range(draw(st.integers(1, 4))):
        found = leaves(doc)
        action = draw(st.sampled_from(["replace", "add", "delete"]))
        if action == "add" or not found:
            parent = draw(st.sampled_from([(), *{p[:-1] for p, _ in found if p[:-1]}]))
            put_leaf(doc, (*parent, draw(KEYS)), draw(TOML_VALUES))
            continue
        path, _ = draw(st.sampled_from(found))
        if action == "delete":
            delete_leaf(doc, path)
        else:
            put_leaf(doc, path, draw(TOML_VALUES))
    return doc


TOMLISH = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "[model]",
                "[[stages]]",
                "[train]",
                "[data.synthetic]",
                "name = 'x'",
                "dim = 64",
                "lr = 3e-4",
                "extends = 'x.toml'",
                'files = ["*.txt"]',
                "n_heads = 3",
                "train = { lr = -1 }",
                "init_from = 'nope'",
                "= 1",
                "[",
                "a.b.c = [1, [2, {x = 3}]]",
                '"unterminated',
                "x = 1979-05-27",
                "# comment",
                "x = " + "[" * 500 + "]" * 500,
                "x = 1" + "0" * 5000,
                "",
            ]
        ),
        st.text(alphabet="[]{}=.,'\"#\\ \n\tabcdx019_-+e", max_size=30),
        st.text(max_size=20),
    ),
    max_size=12,
).map("\n".join)


# -- layered presets with mistakes ----------------------------------------------------------------

# Keys whose values the cross-field rules read or guard, and a few others; values that are right,
# out of range, of the wrong type or in conflict with each other.
RULE_KEYS: dict[str, list[Any]] = {
    "model.dim": [-1, 0, 30, 32, 64],
    "model.n_heads": [0, 2, 3, 4, 8, "x"],
    "model.n_kv_heads": [0, 1, 2, 3, 1.5],
    "model.mlp": ["swiglu", "relu"],
    "train.steps": [-1, 0, 5, 10, 200, "many"],
    "train.warmup_steps": [-1, 0, 8, 20, 300],
    "train.batch_size": [0, 4, 6, 16, "x"],
    "train.micro_batch_size": [0, 2, 4, 16],
    "train.lr": [-1.0, 1e-3, "fast"],
    "train.lrr": [1e-3],  # an unknown key
    "data.source": ["synthetic", "files", "bogus"],
    "data.files": [[], ["a.txt"], "a.txt"],
    "data.synthetic.seed": [-1, 3],
    "eval.every": [-1, 5],
}
STAGE_SECTIONS = ("train.", "data.")


@attrs.frozen
class LayeredPreset:
    """A base preset, the preset that extends it, and `--set` overrides, each setting some keys."""

    base: dict[str, Any]
    preset: dict[str, Any]
    overrides: tuple[tuple[str, Any], ...]  # (key as --set spells it, value)


@st.composite
def layered_presets(draw: st.DrawFn) -> LayeredPreset:
    def assignments(stages: int) -> list[tuple[str, Any]]:
        keys = st.sampled_from(sorted(RULE_KEYS))
        out = []
        for key in draw(st.lists(keys, max_size=4)):
            if stages and key.startswith(STAGE_SECTIONS) and draw(st.booleans()):
                key = f"stages[{draw(st.integers(0, stages - 1))}].{key}"
            out.append((key, draw(st.sampled_from(RULE_KEYS[key.rpartition("].")[2]]))))
        return out

    def document(pairs: list[tuple[str, Any]], stages: int) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if stages:
            doc["stages"] = [{"name": name} for name in "ab"[:stages]]
        for key, value in pairs:
            path: list[str | int] = []
            for part in key.split("."):
                if part.startswith("stages["):
                    path += ["stages", int(part[7:-1])]
                else:
                    path.append(part)
            put_leaf(doc, tuple(path), value)
        return doc

    stages = draw(st.sampled_from([0, 2]))
    return LayeredPreset(
        base=document(assignments(0), 0),
        preset=document(assignments(stages), stages),
        overrides=tuple(assignments(stages)),
    )
