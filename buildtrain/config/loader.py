"""From preset files to a typed, validated, fully resolved `Config`.

`load_preset(path, overrides)` is the one way in. It reads the TOML, follows `extends`, applies
`--set` overrides, structures every section with the strict converter, runs every validator, and
raises one `ConfigError` listing all problems it found, each as `file: key.path: message`. It
remembers which file (or `--set`) gave each key, so a problem is reported where it can be fixed.
"""

from __future__ import annotations

import difflib
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import tomli
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)

from buildtrain.config.checks import name_problem
from buildtrain.config.convert import converter, describe
from buildtrain.config.schema import (
    SECTIONS,
    STAGE_KEYS,
    TOP_LEVEL_KEYS,
    Config,
    DataConfig,
    Stage,
    TrainConfig,
)
from buildtrain.errors import ConfigError

KeyPath = tuple[str | int, ...]
SET_SOURCE = "--set"
# A chain of `extends` deeper than this is a mistake (or a cycle through links), not a design.
MAX_EXTENDS_DEPTH = 32


@attrs.frozen
class Problem:
    """One thing wrong with a preset, located by file and key path."""

    source: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.key}: {self.message}" if self.key else f"{self.source}: {self.message}"


@attrs.frozen
class LoadedPreset:
    """A resolved config and where each of its keys came from (for messages, never hashed)."""

    config: Config
    path: Path
    provenance: Mapping[KeyPath, str]

    def source_of(self, key: KeyPath) -> str:
        return source_of(self.provenance, key, display(self.path))


class _Problems(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems


def display(path: Path) -> str:
    """A path as a person would like to read it: relative to the working directory if inside it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if relative.startswith("..") else relative


def key_text(key: KeyPath) -> str:
    text = ""
    for part in key:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def source_of(provenance: Mapping[KeyPath, str], key: KeyPath, default: str) -> str:
    """The file (or `--set`) that set `key` or its nearest set ancestor."""
    for length in range(len(key), 0, -1):
        found = provenance.get(key[:length])
        if found is not None:
            return found
    return default


def suggest(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def unknown_key(word: str, candidates: Iterable[str]) -> str:
    candidates = list(candidates)
    return "unknown key" + (suggest(word, candidates) or f"; valid keys here: {', '.join(candidates)}")


def _lookup(tree: Any, key: KeyPath) -> Any:
    for part in key:
        try:
            tree = tree[part]
        except (KeyError, IndexError, TypeError):
            return None
    return tree


# -- reading and merging -------------------------------------------------------------------------


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _read_regular(path: Path) -> bytes:
    """A file's bytes, refusing anything but a regular file before reading (a FIFO would block).

    Opened without blocking and checked on the open descriptor, so a swap between check and read
    cannot slip a FIFO in."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(0, f"{_kind_of(info.st_mode)}, not a preset file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(fd)


def _read_toml(path: Path) -> dict[str, Any]:
    label = display(path)
    try:
        raw = _read_regular(path)
    except FileNotFoundError:
        raise _Problems([Problem(label, "", "file not found")]) from None
    except IsADirectoryError as exc:
        raise _Problems([Problem(label, "", f"is {exc.strerror}")]) from None
    except OSError as exc:
        raise _Problems([Problem(label, "", f"cannot read: {exc.strerror or exc}")]) from None
    except ValueError as exc:  # a path the OS cannot take (an embedded NUL)
        raise _Problems([Problem(label, "", f"cannot read: {exc}")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Problems([Problem(label, "", f"not UTF-8 text (byte {exc.start})")]) from None
    try:
        return tomli.loads(text)
    except tomli.TOMLDecodeError as exc:
        message = getattr(exc, "msg", str(exc))
        line, column = getattr(exc, "lineno", None), getattr(exc, "colno", None)
        where = f"{label}:{line}:{column}" if line else label
        raise _Problems([Problem(where, "", f"invalid TOML: {message}")]) from None
    except (ValueError, RecursionError) as exc:  # limits tomli lets through: huge integers, deep nesting
        raise _Problems([Problem(label, "", f"invalid TOML: {_limit_message(exc)}")]) from None


def _limit_message(exc: BaseException) -> str:
    return str(exc).partition(":")[0] or type(exc).__name__


def _absolute_globs(section: Any, base: Path) -> None:
    """Data globs are relative to the file that names them, so rewrite them before merging."""
    if isinstance(section, dict) and isinstance(section.get("files"), list):
        section["files"] = [
            os.path.normpath(base / os.path.expanduser(item)) if isinstance(item, str) else item
            for item in section["files"]
        ]
    tokenizer = section.get("tokenizer") if isinstance(section, dict) else None
    if isinstance(tokenizer, dict) and isinstance(tokenizer.get("file"), str):  # relative like files
        tokenizer["file"] = os.path.normpath(base / os.path.expanduser(tokenizer["file"]))


def _record(provenance: dict[KeyPath, str], value: Any, prefix: KeyPath, label: str) -> None:
    provenance[prefix] = label
    if isinstance(value, dict):
        for key, item in value.items():
            _record(provenance, item, (*prefix, key), label)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _record(provenance, item, (*prefix, index), label)


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; every other value (arrays included) is replaced by the later one."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def _forget_below(provenance: dict[KeyPath, str], prefix: KeyPath) -> None:
    for key in [k for k in provenance if len(k) > len(prefix) and k[: len(prefix)] == prefix]:
        del provenance[key]


def _merge_provenance(
    provenance: dict[KeyPath, str], value: Mapping[str, Any], prefix: KeyPath, label: str
) -> None:
    for key, item in value.items():
        path = (*prefix, key)
        if not isinstance(item, Mapping):
            _forget_below(provenance, path)  # a replaced array forgets its old elements
        if isinstance(item, Mapping):
            provenance.setdefault(path, label)
            _merge_provenance(provenance, item, path, label)
        else:
            _record(provenance, item, path, label)


def _load_with_extends(path: Path, chain: tuple[Path, ...]) -> tuple[dict[str, Any], dict[KeyPath, str]]:
    path = path.resolve()
    label = display(path)
    if path in chain:
        cycle = " -> ".join(display(p) for p in (*chain[chain.index(path) :], path))
        raise _Problems([Problem(display(chain[-1]), "extends", f"cycle: {cycle}")])
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise _Problems(
            [
                Problem(
                    display(chain[0]),
                    "extends",
                    f"chain deeper than {MAX_EXTENDS_DEPTH} presets (reached {label}); flatten it",
                )
            ]
        )
    raw = _read_toml(path)
    _absolute_globs(raw.get("data"), path.parent)
    for stage in raw.get("stages", []) if isinstance(raw.get("stages"), list) else []:
        if isinstance(stage, dict):
            _absolute_globs(stage.get("data"), path.parent)

    extends = raw.pop("extends", [])
    if isinstance(extends, str):
        extends = [extends]
    if not isinstance(extends, list) or not all(isinstance(e, str) for e in extends):
        raise _Problems(
            [Problem(label, "extends", f"expected a path or a list of paths, got {describe(extends)}")]
        )

    merged: dict[str, Any] = {}
    provenance: dict[KeyPath, str] = {}
    problems: list[Problem] = []
    for base_name in extends:
        base_path = path.parent / os.path.expanduser(base_name)
        try:
            mode = base_path.stat().st_mode
        except (OSError, ValueError):
            problems.append(Problem(label, "extends", f"'{base_name}' not found (looked for {base_path})"))
            continue
        if not stat.S_ISREG(mode):
            problems.append(
                Problem(
                    label, "extends", f"'{base_name}' is {_kind_of(mode)}, not a preset file ({base_path})"
                )
            )
            continue
        try:
            base, base_provenance = _load_with_extends(base_path, (*chain, path))
        except _Problems as exc:
            problems.extend(exc.problems)
            continue
        merged = deep_merge(merged, base)
        for key in base_provenance:
            if not isinstance(_lookup(base, key), Mapping):
                _forget_below(provenance, key)  # a later base replaced this array or value
        provenance.update(base_provenance)
    if problems:
        raise _Problems(problems)
    merged = deep_merge(merged, raw)
    _merge_provenance(provenance, raw, (), label)
    return merged, provenance


# -- --set overrides ------------------------------------------------------------------------------


def parse_key_path(text: str) -> KeyPath:
    """`train.lr`, `stages[1].train.lr`, `stages.1.train.lr` or `stages.finetune.train.lr`."""
    parts: list[str | int] = []
    for piece in text.replace("[", ".[").split("."):
        if not piece:
            continue
        if piece.startswith("[") and piece.endswith("]") and piece[1:-1].isdigit():
            parts.append(int(piece[1:-1]))
        elif piece.isdigit() and parts and parts[-1] == "stages":
            parts.append(int(piece))
        else:
            parts.append(piece)
    return tuple(parts)


def parse_value(text: str) -> Any:
    """A TOML value (`3e-4`, `true`, `[1, 2]`, `"x"`); a bare word that is not TOML is a string."""
    try:
        return tomli.loads(f"value = {text}")["value"]
    except tomli.TOMLDecodeError:
        if text and all(c.isalnum() or c in "-_./*" for c in text):
            return text
        raise


def apply_override(raw: dict[str, Any], provenance: dict[KeyPath, str], assignment: str) -> None:
    key_text_, sep, value_text = assignment.partition("=")
    label = f"{SET_SOURCE} {assignment}"
    if not sep or not key_text_.strip():
        raise _Problems([Problem(label, "", "expected KEY=VALUE, for example train.lr=3e-4")])
    key = parse_key_path(key_text_.strip())
    if not key:
        raise _Problems([Problem(label, "", "expected KEY=VALUE, for example train.lr=3e-4")])
    for index, part in enumerate(key):
        if isinstance(part, int) and key[:index] != ("stages",):
            raise _Problems(
                [Problem(label, key_text(key), "only stages take an index, as in stages[1].train.lr")]
            )
    if key[0] == "extends":
        raise _Problems([Problem(label, "extends", "cannot be set with --set; write extends in the preset")])
    try:
        value = parse_value(value_text.strip())
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError, or a limit: huge integers, deep nesting
        message = getattr(exc, "msg", None) or _limit_message(exc)
        raise _Problems([Problem(label, key_text(key), f"invalid TOML value: {message}")]) from None
    if isinstance(value, list) and key and key[-1] == "files":
        value = [os.path.abspath(os.path.expanduser(v)) if isinstance(v, str) else v for v in value]

    node: Any = raw
    resolved: list[str | int] = []
    for index, part in enumerate(key[:-1]):
        if resolved == ["stages"] and isinstance(node, list):
            position = _stage_position(node, part)
            if position is None:
                names = [s.get("name") for s in node if isinstance(s, dict)]
                raise _Problems(
                    [
                        Problem(
                            label,
                            key_text(key[: index + 1]),
                            f"no stage {part!r}{suggest(str(part), [str(n) for n in names])}",
                        )
                    ]
                )
            node = node[position]
            resolved.append(position)
            continue
        if not isinstance(node, dict):
            raise _Problems([Problem(label, key_text(key), f"{key_text(tuple(resolved))} is not a table")])
        if part == "stages" and "stages" not in node:
            node["stages"] = [{"name": "main"}]
        node = node.setdefault(part, {})
        resolved.append(part)
    if not isinstance(node, dict):
        raise _Problems([Problem(label, key_text(key), f"{key_text(tuple(resolved))} is not a table")])
    node[key[-1]] = value
    full = (*resolved, key[-1])
    _forget_below(provenance, full)
    _record(provenance, value, full, label)
    for length in range(1, len(full)):  # tables this override created are its own, too
        provenance.setdefault(full[:length], label)


def _stage_position(stages: list[Any], part: str | int) -> int | None:
    if isinstance(part, int):
        return part if 0 <= part < len(stages) else None
    for position, stage in enumerate(stages):
        if isinstance(stage, dict) and stage.get("name") == part:
            return position
    return None


# -- structuring and validation -------------------------------------------------------------------


def _walk_structure_error(exc: BaseException, key: KeyPath) -> list[tuple[KeyPath, str]]:
    """Flatten cattrs' grouped errors into (key path, message) pairs."""
    if isinstance(exc, ForbiddenExtraKeysError):
        fields = [a.name for a in attrs.fields(exc.cl)]
        return [((*key, extra), unknown_key(extra, fields)) for extra in sorted(exc.extra_fields)]
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        found: list[tuple[KeyPath, str]] = []
        for sub in exc.exceptions:
            sub_key = key
            for note in getattr(sub, "__notes__", []):
                if isinstance(note, AttributeValidationNote):
                    sub_key = (*key, note.name)
                elif isinstance(note, IterableValidationNote):
                    sub_key = (*key, note.index)
            found.extend(_walk_structure_error(sub, sub_key))
        return found
    message = str(exc)
    if isinstance(exc, KeyError):
        message = "is required"
    return [(key, message)]


def check_fields(instance: Any, key: KeyPath) -> list[tuple[KeyPath, str]]:
    """Run every validator of an attrs instance and its children, collecting every failure."""
    found: list[tuple[KeyPath, str]] = []
    for field in attrs.fields(type(instance)):
        value = getattr(instance, field.name)
        if attrs.has(type(value)):
            found.extend(check_fields(value, (*key, field.name)))
            continue
        if field.validator is not None:
            try:
                field.validator(instance, field, value)
            except (ValueError, TypeError) as exc:
                found.append(((*key, field.name), str(exc)))
    return found


def _structure_section(raw: Any, cls: type, key: KeyPath) -> tuple[Any, list[tuple[KeyPath, str]]]:
    if not isinstance(raw, dict):
        return None, [(key, f"expected a table, got {describe(raw)}")]
    with attrs.validators.disabled():
        try:
            return_value = converter.structure(raw, cls)
        except Exception as exc:  # cattrs raises grouped errors; all are reported
            found = _walk_structure_error(exc, key)
        else:
            return return_value, check_fields(return_value, key)
        # Drop the keys that failed (in nested tables too) and validate the rest, so one typo does
        # not hide the other problems of the section; skip rules that read a dropped key.
        bad = {_named_prefix(k[len(key) :]) for k, _ in found if len(k) > len(key)}
        try:
            partial = converter.structure(_without(raw, bad), cls)
        except Exception:  # a nested failure that cannot be isolated: report what we have
            return None, found
    parent = str(key[-1])
    mentions = tuple(".".join([parent, *b][-2:]) for b in bad)
    rest = [
        (k, m) for k, m in check_fields(partial, key) if not any(k[len(key) :][: len(b)] == b for b in bad)
    ]
    return None, found + [(k, m) for k, m in rest if not any(name in m for name in mentions)]


def _named_prefix(key: KeyPath) -> tuple[str, ...]:
    """The part of a key path before its first array index (`betas[0]` -> `betas`)."""
    named: list[str] = []
    for part in key:
        if not isinstance(part, str):
            break
        named.append(part)
    return tuple(named)


def _without(raw: Mapping[str, Any], paths: set[tuple[str, ...]]) -> dict[str, Any]:
    """A copy of a table with the given key paths removed."""
    out = dict(raw)
    for name in {path[0] for path in paths if path}:
        deeper = {path[1:] for path in paths if path and path[0] == name}
        if () in deeper or not isinstance(out.get(name), Mapping):
            out.pop(name, None)
        else:
            out[name] = _without(out[name], deeper)
    return out


def _stage_problem_key(key: KeyPath, stage_raw: Mapping[str, Any], implicit: bool) -> KeyPath:
    """Report a problem at the stage key if the stage set it, else at the top-level default."""
    _, _, section, *rest = key
    override = stage_raw.get(section)
    set_by_stage = isinstance(override, Mapping) and (not rest or rest[0] in override)
    if set_by_stage and not implicit:
        return key
    return (section, *rest)


def _structure_config(raw: dict[str, Any]) -> tuple[Config | None, list[tuple[KeyPath, str]]]:
    problems: list[tuple[KeyPath, str]] = []
    for key in raw:
        if key not in TOP_LEVEL_KEYS:
            problems.append(((key,), unknown_key(key, TOP_LEVEL_KEYS)))

    name = raw.get("name", "unnamed")
    if not isinstance(name, str) or not name:
        problems.append((("name",), f"expected a non-empty string, got {describe(name)}"))
    elif name_problem(name):
        problems.append((("name",), str(name_problem(name))))

    sections: dict[str, Any] = {}
    for section in ("model", "eval", "numerics", "export"):
        instance, found = _structure_section(raw.get(section, {}), SECTIONS[section], (section,))
        sections[section] = instance
        problems.extend(found)

    stages_raw = raw.get("stages")
    implicit = stages_raw is None
    if implicit:
        stages_raw = [{"name": "main"}]
    if not isinstance(stages_raw, list) or not stages_raw:
        problems.append((("stages",), "expected a non-empty array of tables ([[stages]])"))
        stages_raw = []

    top = {"data": raw.get("data", {}), "train": raw.get("train", {})}
    for section, value in top.items():
        if not isinstance(value, dict):
            problems.append(((section,), f"expected a table, got {describe(value)}"))
            top[section] = {}

    stages: list[Stage] = []
    graph: list[tuple[int, str, str | None]] = []  # every stage's place, even one that failed to structure
    for index, stage_raw in enumerate(stages_raw):
        key: KeyPath = ("stages", index)
        if not isinstance(stage_raw, dict):
            problems.append((key, f"expected a table, got {describe(stage_raw)}"))
            continue
        for extra in stage_raw:
            if extra not in STAGE_KEYS:
                problems.append(((*key, extra), unknown_key(extra, STAGE_KEYS)))
        stage_name = stage_raw.get("name")
        if not isinstance(stage_name, str) or not stage_name:
            problems.append(((*key, "name"), 'each stage needs a name, for example name = "pretrain"'))
            stage_name = f"stage{index}"
        elif name_problem(stage_name):
            problems.append(((*key, "name"), str(name_problem(stage_name))))
        init_from = stage_raw.get("init_from")
        if init_from is not None and not isinstance(init_from, str):
            problems.append(((*key, "init_from"), f"expected a stage name, got {describe(init_from)}"))
            init_from = None
        graph.append((index, stage_name, init_from))
        parts: dict[str, Any] = {}
        for section, cls in (("data", DataConfig), ("train", TrainConfig)):
            override = stage_raw.get(section, {})
            if not isinstance(override, dict):
                problems.append(((*key, section), f"expected a table, got {describe(override)}"))
                override = {}
            instance, found = _structure_section(deep_merge(top[section], override), cls, (*key, section))
            parts[section] = instance
            problems.extend((_stage_problem_key(k, stage_raw, implicit), m) for k, m in found)
        if parts["data"] is not None and parts["train"] is not None:
            stages.append(
                Stage(name=stage_name, init_from=init_from, data=parts["data"], train=parts["train"])
            )

    problems.extend(_check_stage_graph(graph))
    if problems or any(v is None for v in sections.values()) or len(stages) != len(stages_raw):
        return None, problems
    return Config(name=name, stages=tuple(stages), **sections), problems


def _check_stage_graph(graph: list[tuple[int, str, str | None]]) -> list[tuple[KeyPath, str]]:
    """Unique names and earlier parents, over (index, name, init_from) of every stage table, so a
    stage with a bad setting neither hides nor shifts the problems of the stages after it."""
    problems: list[tuple[KeyPath, str]] = []
    first: dict[str, int] = {}
    for index, name, _ in graph:
        if name in first:
            problems.append(
                (("stages", index, "name"), f"'{name}' is already the name of stages[{first[name]}]")
            )
        first.setdefault(name, index)
    for index, name, init_from in graph:
        if init_from is None:
            continue
        key: KeyPath = ("stages", index, "init_from")
        if init_from not in first:
            problems.append((key, f"no stage named '{init_from}'{suggest(init_from, list(first))}"))
        elif first[init_from] >= index:
            problems.append(
                (
                    key,
                    f"stage '{init_from}' does not come before '{name}'; a stage can only start from an earlier one",
                )
            )
    return problems


def load_preset(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> LoadedPreset:
    """Read, merge, override, structure and validate a preset; raise `ConfigError` with every problem."""
    root = Path(path)
    root_label = display(root)
    try:
        raw, provenance = _load_with_extends(root, ())
        for assignment in overrides:
            apply_override(raw, provenance, assignment)
    except _Problems as exc:
        raise ConfigError([str(p) for p in exc.problems]) from None
    config, found = _structure_config(raw)
    if found:
        lines = []
        for key, message in found:
            line = str(Problem(source_of(provenance, key, root_label), key_text(key), message))
            if line not in lines:
                lines.append(line)
        raise ConfigError(lines)
    assert config is not None  # no problems means every part structured
    return LoadedPreset(config=config, path=root.resolve(), provenance=provenance)
