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
from buildtrain.sources.data_url import is_object_url
from buildtrain.sources.regular import NotRegularFile, kind_of, open_regular

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
    loaded = _Extends().load(path, ())
    return Layered(raw=loaded.raw, provenance=loaded.provenance, layers=list(loaded.layers))


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


def _read_regular(path: Path) -> bytes:
    """A file's bytes, refusing anything but a regular file before reading (a FIFO would block)."""
    with open_regular(path) as handle:
        return handle.read()


def _read_toml(path: Path) -> dict[str, Any]:
    label = display(path)

    def problem(message: str, where: str = label) -> Fatal:
        return Fatal([Problem(where, (), message)])

    try:
        raw = _read_regular(path)
    except FileNotFoundError:
        raise problem("file not found") from None
    except NotRegularFile as exc:
        raise problem(f"is {exc.kind}, not a preset file") from None
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
    """Data globs are relative to the file that names them, so rewrite them before merging (an
    `s3://` URL names the same objects from anywhere and is kept as written)."""
    if isinstance(section, dict) and isinstance(section.get("files"), list):
        section["files"] = [
            os.path.normpath(base / os.path.expanduser(item))
            if isinstance(item, str) and not is_object_url(item)
            else item
            for item in section["files"]
        ]
    tokenizer = section.get("tokenizer") if isinstance(section, dict) else None
    if (
        isinstance(tokenizer, dict)
        and isinstance(tokenizer.get("file"), str)
        and not is_object_url(tokenizer["file"])  # refused as it is written, by preflight
    ):  # relative like files
        tokenizer["file"] = os.path.normpath(base / os.path.expanduser(tokenizer["file"]))


def _absolute_checkpoint(section: Any, base: Path) -> None:
    """A checkpoint folder (`model.init.hf`) is relative to the file that names it, like data."""
    init = section.get("init") if isinstance(section, dict) else None
    if isinstance(init, dict) and isinstance(init.get("hf"), str) and init["hf"]:
        init["hf"] = os.path.normpath(base / os.path.expanduser(init["hf"]))


def _absolute_suite_files(section: Any, base: Path) -> None:
    """Suite files are relative to the preset that names them, like data files."""
    suites = section.get("suites") if isinstance(section, dict) else None
    for suite in suites if isinstance(suites, list) else []:
        for key in ("file", "task"):
            if isinstance(suite, dict) and isinstance(suite.get(key), str):
                suite[key] = os.path.normpath(base / os.path.expanduser(suite[key]))


def _extends_of(raw: dict[str, Any], label: str) -> list[str]:
    extends = raw.pop("extends", [])
    if isinstance(extends, str):
        extends = [extends]
    if not isinstance(extends, list) or not all(isinstance(e, str) for e in extends):
        message = f"expected a path or a list of paths, got {describe(extends)}"
        raise Fatal([Problem(label, ("extends",), message)])
    return extends


@attrs.frozen
class _Merged:
    """One preset file merged over what it extends: never mutated once made, so it can be shared."""

    raw: dict[str, Any]
    provenance: Provenance
    layers: tuple[str, ...]  # each label once, at the place of its last application
    height: int  # the longest chain of `extends` below this file (0: it extends nothing)


def _applied(*parts: tuple[str, ...]) -> tuple[str, ...]:
    """Layers applied one after another, each kept at its last application: the order `blame`
    reads (a label applied twice counts where it was applied last)."""
    order: dict[str, None] = {}
    for part in parts:
        for label in part:
            order.pop(label, None)
            order[label] = None
    return tuple(order)


class _Extends:
    """Follows `extends`, reading and merging each file once.

    A diamond (two presets extending one base) used to reload the base once per path to it:
    depth 16 took 49 s and 31 files never finished. A file's merge depends only on the files
    below it, so it is kept and reused; only the depth limit depends on the chain above, and the
    kept height of the file answers it. A failure is kept too: any failure fails the preset."""

    def __init__(self) -> None:
        self.merged: dict[Path, _Merged] = {}
        self.failed: dict[Path, list[Problem]] = {}

    def load(self, path: Path, chain: tuple[Path, ...]) -> _Merged:
        """The file at `path` merged over what it extends; `chain` is the files that led here (to
        find cycles)."""
        path = path.resolve()
        label = display(path)
        if path in chain:
            cycle = " -> ".join(display(p) for p in (*chain[chain.index(path) :], path))
            raise Fatal([Problem(display(chain[-1]), ("extends",), f"cycle: {cycle}")])
        height = self.merged[path].height if path in self.merged else 0
        if len(chain) + height >= MAX_EXTENDS_DEPTH:
            message = f"chain deeper than {MAX_EXTENDS_DEPTH} presets (reached {label}); flatten it"
            raise Fatal([Problem(display(chain[0] if chain else path), ("extends",), message)])
        if path in self.failed:
            raise Fatal(self.failed[path])
        if path not in self.merged:
            try:
                self.merged[path] = self._merge(path, chain)
            except Fatal as exc:
                self.failed[path] = exc.problems
                raise
        return self.merged[path]

    def _merge(self, path: Path, chain: tuple[Path, ...]) -> _Merged:
        label = display(path)
        raw = _read_toml(path)
        _absolute_globs(raw.get("data"), path.parent)
        _absolute_checkpoint(raw.get("model"), path.parent)
        _absolute_suite_files(raw.get("eval"), path.parent)
        for stage in raw.get("stages", []) if isinstance(raw.get("stages"), list) else []:
            if isinstance(stage, dict):
                _absolute_globs(stage.get("data"), path.parent)

        merged: dict[str, Any] = {}
        provenance: Provenance = {}
        layers: tuple[str, ...] = ()
        height = 0
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
                base = self.load(base_path, (*chain, path))
            except Fatal as exc:
                problems.extend(exc.problems)
                continue
            merged = deep_merge(merged, base.raw)
            merge_base(provenance, base.raw, base.provenance)
            layers = _applied(layers, base.layers)
            height = max(height, base.height + 1)
        if problems:
            raise Fatal(problems)
        merge_layer(provenance, raw, label)
        return _Merged(
            raw=deep_merge(merged, raw),
            provenance=provenance,
            layers=_applied(layers, (label,)),
            height=height,
        )
