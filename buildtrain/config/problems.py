"""What a preset problem is and how it reads: `file: key.path: message`, like a compiler's error.

Every part of the loader (reading files, `--set`, validation, pre-flight) reports in these terms,
so the user sees one format wherever a mistake was found.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from buildtrain.errors import ConfigError

# A key as a path through the preset's tables and arrays: ("stages", 1, "train", "lr").
KeyPath = tuple[str | int, ...]


@attrs.frozen
class Problem:
    """One thing wrong with a preset, located by the file (or `--set`) to fix and the key path;
    `involves` are the keys whose values it depends on, its own first (none for a file that
    cannot be read). Two problems that read the same are one, whatever they involve."""

    source: str
    key: KeyPath
    message: str
    involves: tuple[KeyPath, ...] = attrs.field(default=(), eq=False)

    def __str__(self) -> str:
        if not self.key:
            return f"{self.source}: {self.message}"
        return f"{self.source}: {key_text(self.key)}: {self.message}"


class PresetError(ConfigError):
    """A `ConfigError` that keeps its problems structured, each reported once, in order."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.found = tuple(dict.fromkeys(problems))
        super().__init__([str(problem) for problem in self.found])


class Fatal(Exception):
    """Problems after which loading cannot go on (an unreadable file, a bad `--set`): raised
    inside the loader, turned into a `PresetError` by `load_preset`."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__(problems)
        self.problems = list(problems)


def display(path: Path) -> str:
    """A path as a person would like to read it: relative to the working directory if inside it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if relative.startswith("..") else relative


def key_text(key: KeyPath) -> str:
    """A key path as a preset or `--set` spells it: `stages[1].train.lr`."""
    text = ""
    for part in key:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def suggest(word: str, candidates: Iterable[str]) -> str:
    import difflib  # only for a mistake: importing it cost every `bt plan` about 3 ms

    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def unknown_key(word: str, candidates: Iterable[str]) -> str:
    candidates = list(candidates)
    return "unknown key" + (suggest(word, candidates) or f"; valid keys here: {', '.join(candidates)}")
