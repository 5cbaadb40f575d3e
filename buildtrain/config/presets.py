"""Reading preset files: TOML from regular files only, `extends` followed and merged, and the
provenance of every key (which file set it).

Inputs are untrusted: anything that is not a regular UTF-8 TOML file, an `extends` cycle or a
chain too deep is a problem to report, never a hang or a traceback.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import tomli

from buildtrain.config.convert import describe
from buildtrain.config.problems import Fatal, Problem, display
from buildtrain.config.provenance import Provenance, merge_base, merge_layer

# A chain of `extends` deeper than this is a mistake (or a cycle through links), not a design.
MAX_EXTENDS_DEPTH = 32


@attrs.define
class Layered:
    """A preset merged from its layers, with the provenance of its keys and the layers in the order
    they were applied (see `provenance`). Built up by `read_preset` and `apply_override`."""

    raw: dict[str, Any]
    provenance: Provenance
    layers: list[str]


def read_preset(path: Path) -> Layered:
    """A preset file merged over the presets it extends; raises `Fatal` if it cannot be read."""
    layers: list[str] = []
    raw, provenance = _load_with_extends(path, (), layers)
    return Layered(raw=raw, provenance=provenance, layers=layers)


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; every other value (arrays included) is replaced by the later one."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def limit_message(exc: BaseException) -> str:
    """The first clause of an error from a parser limit (huge integers, deep nesting)."""
    return str(exc).partition(":")[0] or type(exc).__name__


def kind_of(mode: int) -> str:
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
            raise IsADirectoryError(0, f"{kind_of(info.st_mode)}, not a preset file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(fd)


def _read_toml(path: Path) -> dict[str, Any]:
    label = display(path)

    def problem(message: str, where: str = label) -> Fatal:
        return Fatal([Problem(where, (), message)])

    try:
        raw = _read_regular(path)
    except FileNotFoundError:
        raise problem("file not found") from None
    except IsADirectoryError as exc:
        raise problem(f"is {exc.strerror}") from None
    except OSError as exc:
        raise problem(f"cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # a path the OS cannot take (an embedded NUL)
        raise problem(f"cannot read: {exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise problem(f"not UTF-8 text (byte {exc.start})") from None
    try:
        return tomli.loads(text)
    except tomli.TOMLDecodeError as exc:
        line, column = getattr(exc, "lineno", None), getattr(exc, "colno", None)
        where = f"{label}:{line}:{column}" if line else label
        raise problem(f"invalid TOML: {getattr(exc, 'msg', str(exc))}", where) from None
    except (ValueError, RecursionError) as exc:  # limits tomli lets through: huge integers, deep nesting
        raise problem(f"invalid TOML: {limit_message(exc)}") from None


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


def _extends_of(raw: dict[str, Any], label: str) -> list[str]:
    extends = raw.pop("extends", [])
    if isinstance(extends, str):
        extends = [extends]
    if not isinstance(extends, list) or not all(isinstance(e, str) for e in extends):
        message = f"expected a path or a list of paths, got {describe(extends)}"
        raise Fatal([Problem(label, ("extends",), message)])
    return extends


def _load_with_extends(
    path: Path, chain: tuple[Path, ...], layers: list[str]
) -> tuple[dict[str, Any], Provenance]:
    """The file at `path` merged over what it extends; `chain` is the files that led here (to
    find cycles); every file merged is appended to `layers` after the files it extends."""
    path = path.resolve()
    label = display(path)
    if path in chain:
        cycle = " -> ".join(display(p) for p in (*chain[chain.index(path) :], path))
        raise Fatal([Problem(display(chain[-1]), ("extends",), f"cycle: {cycle}")])
    if len(chain) >= MAX_EXTENDS_DEPTH:
        message = f"chain deeper than {MAX_EXTENDS_DEPTH} presets (reached {label}); flatten it"
        raise Fatal([Problem(display(chain[0]), ("extends",), message)])
    raw = _read_toml(path)
    _absolute_globs(raw.get("data"), path.parent)
    for stage in raw.get("stages", []) if isinstance(raw.get("stages"), list) else []:
        if isinstance(stage, dict):
            _absolute_globs(stage.get("data"), path.parent)

    merged: dict[str, Any] = {}
    provenance: Provenance = {}
    problems: list[Problem] = []
    for base_name in _extends_of(raw, label):
        base_path = path.parent / os.path.expanduser(base_name)
        try:
            mode = base_path.stat().st_mode
        except (OSError, ValueError):
            message = f"'{base_name}' not found (looked for {base_path})"
            problems.append(Problem(label, ("extends",), message))
            continue
        if not stat.S_ISREG(mode):
            message = f"'{base_name}' is {kind_of(mode)}, not a preset file ({base_path})"
            problems.append(Problem(label, ("extends",), message))
            continue
        try:
            base, base_provenance = _load_with_extends(base_path, (*chain, path), layers)
        except Fatal as exc:
            problems.extend(exc.problems)
            continue
        merged = deep_merge(merged, base)
        merge_base(provenance, base, base_provenance)
    if problems:
        raise Fatal(problems)
    layers.append(label)
    merge_layer(provenance, raw, label)
    return deep_merge(merged, raw), provenance
