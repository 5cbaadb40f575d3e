"""Sweeps: one preset and a grid of `key=v1,v2` axes compile into one plan per point of the grid.

Each point is planned exactly as `bt plan PRESET --set key=value ...` would plan it, so a point's
plan hash means what it always means, and steps whose inputs the points share (a data step, a
pretrain stage) are one step in the store, built once. The sweep itself is content-addressed: its
hash covers the axes (as sets) and the set of plan hashes, so neither the order of the `--sweep`
options nor the order of an axis's values changes it. A preset declares a sweep in a `[sweep]`
table of arrays, e.g. `"train.lr" = [1e-3, 3e-3]`; `--sweep` axes replace an axis of the same key.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.convert import describe
from buildtrain.errors import ConfigError, UsageError
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.plan.planner import Planned
    from buildtrain.plan.toolchain import WorkerProbe

SWEEP_FORMAT = 1
# More points than this is a typo in an axis, not an experiment anyone will read.
MAX_POINTS = 4096
SWEEP_FIX = "write it as KEY=V1,V2,..., e.g. --sweep train.lr=1e-3,3e-3"


@attrs.frozen
class Axis:
    """One key and the values it takes, in the order given (the order of the printed hashes)."""

    key: str
    values: tuple[Any, ...]

    def assignments(self) -> list[str]:
        return [f"{self.key}={_toml(value)}" for value in self.values]


@attrs.frozen
class Point:
    assignments: tuple[str, ...]  # `key=value` overrides, applied after the user's --set
    planned: Planned


@attrs.frozen
class SweepPlans:
    hash: str
    axes: tuple[Axis, ...]
    points: tuple[Point, ...]


def _toml(value: Any) -> str:
    """A value as `--set` reads it back (TOML inline syntax; JSON is TOML for these types)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value)


def _split_values(text: str) -> list[str]:
    """Split at commas outside brackets and quotes, so `train.betas=[0.9,0.95],[0.9,0.99]` works."""
    parts, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return [part.strip() for part in parts]


def parse_axis(text: str) -> Axis:
    """`train.lr=1e-3,3e-3` -> Axis; a malformed axis is a `UsageError` that names it and the fix."""
    from buildtrain.config.overrides import parse_key_path, parse_value

    key, sep, values_text = text.partition("=")
    key = key.strip()
    if not sep or not key or not parse_key_path(key):
        raise UsageError(f"--sweep {text!r}: expected KEY=V1,V2,...; {SWEEP_FIX}")
    values = []
    for part in _split_values(values_text):
        if not part:
            raise UsageError(f"--sweep {key}: an empty value in {values_text!r}; {SWEEP_FIX}")
        try:
            values.append(parse_value(part))
        except (ValueError, RecursionError):
            raise UsageError(f"--sweep {key}: {part!r} is not a TOML value; {SWEEP_FIX}") from None
    return _axis(key, values, f"--sweep {key}")


def _axis(key: str, values: Sequence[Any], where: str) -> Axis:
    if not values:
        raise UsageError(f"{where}: no values; {SWEEP_FIX}")
    seen: set[bytes] = set()
    for value in values:
        encoded = canonical_bytes(value)
        if encoded in seen:
            raise UsageError(f"{where}: the value {_toml(value)} is given twice; give each value once")
        seen.add(encoded)
    return Axis(key, tuple(values))


def table_axes(table: Any, source: str) -> list[Axis]:
    """The axes of a preset's `[sweep]` table: dotted keys (or nested tables) whose leaves are arrays."""
    if not isinstance(table, Mapping):
        raise ConfigError([f"{source}: sweep: expected a table of KEY = [values], got {describe(table)}"])
    axes: list[Axis] = []

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for name, value in node.items():
            key = f"{prefix}.{name}" if prefix else str(name)
            if isinstance(value, Mapping):
                walk(value, key)
            elif isinstance(value, list):
                try:
                    axes.append(_axis(key, value, f"{source}: sweep.{key}"))
                except UsageError as exc:
                    raise ConfigError([str(exc)]) from None
            else:
                raise ConfigError(
                    [
                        f"{source}: sweep.{key}: expected an array of values, e.g. [1e-3, 3e-3] (got {describe(value)})"
                    ]
                )

    walk(table, "")
    return axes


def merge_axes(declared: Iterable[Axis], given: Iterable[Axis]) -> tuple[Axis, ...]:
    """The preset's axes, each replaced by a `--sweep` axis of the same key; then the new ones."""
    axes = {axis.key: axis for axis in declared}
    for axis in given:
        axes[axis.key] = axis
    return tuple(axes.values())


def grid(axes: Sequence[Axis]) -> list[tuple[str, ...]]:
    """The points of the grid: the product of the axes, as `key=value` assignments, first axis slowest."""
    return [tuple(point) for point in itertools.product(*(axis.assignments() for axis in axes))]


def sweep_body(axes: Sequence[Axis], points: Sequence[tuple[tuple[str, ...], str]]) -> dict[str, Any]:
    """The canonical (order-free) description of a sweep: axes as sets, points by plan hash."""
    return {
        "format": SWEEP_FORMAT,
        "axes": {
            axis.key: sorted((json.loads(canonical_bytes(v)) for v in axis.values), key=canonical_bytes)
            for axis in axes
        },
        "points": sorted(
            ({"plan": plan_hash, "set": sorted(assignments)} for assignments, plan_hash in points),
            key=lambda point: point["plan"],
        ),
    }


def sweep_hash(axes: Sequence[Axis], points: Sequence[tuple[tuple[str, ...], str]]) -> str:
    return digest("sweep", sweep_body(axes, points))


def plan_sweep(
    path: str | Path,
    overrides: Sequence[str],
    axis_texts: Sequence[str],
    store: Store,
    world_size: int = 1,
    workers: WorkerProbe | None = None,
) -> SweepPlans | Planned:
    """Plan every point of the sweep the preset declares and `--sweep` adds; a preset without
    axes is planned as its one point (each preset is loaded and validated once); `workers`: the
    engine's probe of the machine that will execute the steps (default: this one).

    Every point is validated before any is stored, so a bad axis value leaves nothing half-written.
    """
    # Here, not above: `bt run HASH` reads stored sweeps through this module and never plans (the
    # loader and the planner cost a null build about 20 ms).
    from buildtrain.config.loader import load_preset
    from buildtrain.plan.planner import plan_loaded

    given = [parse_axis(text) for text in axis_texts]
    loaded = load_preset(path, overrides)
    declared = table_axes(loaded.sweep, str(loaded.path)) if loaded.sweep is not None else []
    axes = merge_axes(declared, given)
    if not axes:
        return plan_loaded(loaded, list(overrides), store, world_size, workers)
    size = 1
    for axis in axes:
        size *= len(axis.values)
    if size > MAX_POINTS:
        raise UsageError(f"the sweep has {size} points, more than {MAX_POINTS}; give fewer values")
    points = []
    for assignments in grid(axes):  # validate all first: a bad value fails before anything is stored
        try:
            points.append(
                (assignments, [*overrides, *assignments], load_preset(path, [*overrides, *assignments]))
            )
        except ConfigError as exc:
            raise ConfigError([_as_sweep(line) for line in exc.problems]) from None
    planned = [
        Point(a, plan_loaded(point, all_overrides, store, world_size, workers))
        for a, all_overrides, point in points
    ]
    pairs = [(p.assignments, p.planned.plan.hash) for p in planned]
    result = SweepPlans(hash=sweep_hash(axes, pairs), axes=axes, points=tuple(planned))
    save_sweep(store, result)
    return result


def _as_sweep(line: str) -> str:
    """A problem found through a point's override, named as the sweep axis the user wrote."""
    return line.replace("--set ", "--sweep ", 1) if line.startswith("--set ") else line


def save_sweep(store: Store, sweep: SweepPlans) -> None:
    """Store the sweep's canonical bytes under its hash (immutable, like a plan)."""
    body = sweep_body(sweep.axes, [(p.assignments, p.planned.plan.hash) for p in sweep.points])
    path = store.plans.sweep_path(sweep.hash)
    raw = canonical_bytes(body)
    if path.is_symlink() or not path.is_file() or path.read_bytes() != raw:
        store.replace_file(path, raw)


def sweep_problem(path: Path) -> tuple[list[str], str | None]:
    """(the plan hashes of the stored sweep at `path`, None), or ([], why it is not sound): its
    bytes must hash to its name, like a plan's (`bt fsck` and `bt gc` read sweeps through this)."""
    if path.is_symlink() or not path.is_file():
        return [], "a symbolic link or a folder, not a stored sweep"
    try:
        body = json.loads(path.read_bytes())
        if digest("sweep", body) != path.name.removesuffix(".json"):
            return [], "content does not match its hash"
        plans = [point["plan"] for point in body["points"]]
        if not all(isinstance(plan, str) for plan in plans):
            raise TypeError("a point's plan is not a hash")
        return plans, None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [], f"unreadable ({exc})"


def load_sweep_plans(store: Store, ref: str) -> list[str] | None:
    """The plan hashes of the stored sweep `ref` (a hash or unique prefix); None if none matches.

    A sweep whose bytes do not match its hash is not trusted: that is a `UsageError` naming it."""
    folder = store.sweeps
    matches = (
        sorted(folder.glob(f"{ref.lower()}*.json")) if folder.is_dir() and not folder.is_symlink() else []
    )
    if len(matches) != 1:
        return None
    plans, problem = sweep_problem(matches[0])
    if problem is not None:
        raise UsageError(f"sweep {matches[0].stem[:12]} in {folder} is damaged ({problem}); plan it again")
    return plans
