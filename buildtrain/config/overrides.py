"""`--set KEY=VALUE`: a layer of one key over the merged preset files.

A key is a dotted path (`train.lr`); a stage is addressed by name or by index
(`stages.finetune.train.lr`, `stages[1].train.lr`, `stages.1.train.lr`). The value is TOML.
"""

from __future__ import annotations

import os
from typing import Any

import tomli

from buildtrain.config.presets import Layered, limit_message
from buildtrain.config.problems import Fatal, KeyPath, Problem, key_text, suggest
from buildtrain.config.provenance import forget_below, record
from buildtrain.sources.data_url import is_object_url

SET_SOURCE = "--set"
EXPECTED_ASSIGNMENT = "expected KEY=VALUE, for example train.lr=3e-4"


def set_label(assignment: str) -> str:
    """The layer label of one `--set`, as problems it causes are reported."""
    return f"{SET_SOURCE} {assignment}"


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


def apply_override(preset: Layered, assignment: str) -> None:
    """Set one key of the merged preset, as the last layer; raises `Fatal` if it cannot."""
    label = set_label(assignment)

    def problem(key: KeyPath, message: str) -> Fatal:
        return Fatal([Problem(label, key, message)])

    key_part, sep, value_text = assignment.partition("=")
    key = parse_key_path(key_part.strip())
    if not sep or not key:
        raise problem((), EXPECTED_ASSIGNMENT)
    for index, part in enumerate(key):
        if isinstance(part, int) and key[:index] != ("stages",):
            raise problem(key, "only stages take an index, as in stages[1].train.lr")
    if key[0] == "extends":
        raise problem(("extends",), "cannot be set with --set; write extends in the preset")
    try:
        value = parse_value(value_text.strip())
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError, or a limit: huge integers, deep nesting
        raise problem(key, f"invalid TOML value: {getattr(exc, 'msg', None) or limit_message(exc)}") from None
    if isinstance(value, list) and key[-1] == "files":
        # Globs on the command line are relative to the working directory, not to the preset.
        value = [
            os.path.abspath(os.path.expanduser(v)) if isinstance(v, str) and not is_object_url(v) else v
            for v in value
        ]

    node: Any = preset.raw
    resolved: list[str | int] = []
    for index, part in enumerate(key[:-1]):
        if resolved == ["stages"] and isinstance(node, list):
            position = _stage_position(node, part)
            if position is None:
                names = [str(s.get("name")) for s in node if isinstance(s, dict)]
                raise problem(key[: index + 1], f"no stage {part!r}{suggest(str(part), names)}")
            node = node[position]
            resolved.append(position)
            continue
        if not isinstance(node, dict):
            raise problem(key, f"{key_text(tuple(resolved))} is not a table")
        if part == "stages" and "stages" not in node:
            node["stages"] = [{"name": "main"}]  # the implicit stage, made explicit to take the key
        node = node.setdefault(part, {})
        resolved.append(part)
    if not isinstance(node, dict):
        raise problem(key, f"{key_text(tuple(resolved))} is not a table")
    node[key[-1]] = value

    full = (*resolved, key[-1])
    preset.layers.append(label)
    forget_below(preset.provenance, full)
    record(preset.provenance, value, full, label)
    for length in range(1, len(full)):  # tables this override created are its own, too
        preset.provenance.setdefault(full[:length], label)


def _stage_position(stages: list[Any], part: str | int) -> int | None:
    if isinstance(part, int):
        return part if 0 <= part < len(stages) else None
    for position, stage in enumerate(stages):
        if isinstance(stage, dict) and stage.get("name") == part:
            return position
    return None
