"""From preset files to a typed, validated, fully resolved `Config`.

`load_preset(path, overrides)` is the one way in. It reads the TOML and follows `extends`
(`presets`), applies `--set` overrides (`overrides`), structures and validates every section
(`resolve`, `validate`), and raises one `PresetError` listing every problem it found, each once and
blamed on the file (or `--set`) that set the keys it involves (`provenance`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from buildtrain.config.overrides import apply_override
from buildtrain.config.presets import read_preset
from buildtrain.config.problems import Fatal, KeyPath, PresetError, Problem, display
from buildtrain.config.provenance import blame, source_of
from buildtrain.config.resolve import resolve
from buildtrain.config.schema import Config


@attrs.frozen
class LoadedPreset:
    """A resolved config and where each of its keys came from (for messages, never hashed)."""

    config: Config
    path: Path
    provenance: Mapping[KeyPath, str]
    layers: tuple[str, ...]  # the files and `--set`s it was built from, in the order applied
    sweep: Any = None  # the preset's [sweep] table, read by plan/sweep.py; never part of the config

    def source_of(self, key: KeyPath) -> str:
        """The file (or `--set`) that set `key` or its nearest set ancestor."""
        return source_of(self.provenance, key, display(self.path))

    def blame(self, key: KeyPath, *involves: KeyPath) -> str:
        """The file (or `--set`) to blame for a problem at `key` that depends on `involves` too."""
        return blame(self.provenance, self.layers, key, (key, *involves), display(self.path))


def load_preset(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> LoadedPreset:
    """Read, merge, override, structure and validate a preset; raise `PresetError` with every problem."""
    root = Path(path)
    try:
        preset = read_preset(root)
        sweep = preset.raw.pop("sweep", None)  # a grid of plans, not a key of any one plan (plan/sweep.py)
        for assignment in overrides:
            apply_override(preset, assignment)
    except Fatal as exc:
        raise PresetError(exc.problems) from None
    config, found = resolve(preset.raw)
    if found:
        default = display(root)
        raise PresetError(
            Problem(
                blame(preset.provenance, preset.layers, f.key, f.involves, default),
                f.key,
                f.message,
                f.involves,
            )
            for f in found
        )
    assert config is not None  # no problems means every part structured
    return LoadedPreset(
        config=config,
        path=root.resolve(),
        provenance=preset.provenance,
        layers=tuple(preset.layers),
        sweep=sweep,
    )
