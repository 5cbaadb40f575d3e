"""What the plan arguments of `bt run` name: plans, presets (with their sweeps), sweeps, files of hashes.

`bt run` takes any mix of: a plan hash or unique prefix; a stored sweep's hash or prefix; a preset
path (every point of its `[sweep]`, or its one plan); a sweep file (what `bt plan --sweep` printed:
one plan hash per line, `#` comments); `-` for such a list on stdin. Plans are deduplicated and
keep their first position, so `bt run A B A` runs A and B once each.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import attrs

from buildtrain.errors import UsageError
from buildtrain.plan.plan import Plan
from buildtrain.plan.stored import load_plan
from buildtrain.plan.sweep import SweepPlans, load_sweep_plans, plan_sweep
from buildtrain.store.plans import HEX
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.plan.toolchain import WorkerProbe


@attrs.frozen
class Target:
    plan: Plan
    threads: int  # the preset's numerics.threads (0: not set, or not planned from a preset)


def is_preset(ref: str) -> bool:
    """A path ending in .toml, a path that is not there (so that planning says what is missing), or a
    file that is not a list of plan hashes."""
    if ref.endswith(".toml"):
        return True
    path = Path(ref)
    if not path.is_file():
        return os.path.sep in ref
    try:
        with path.open("rb") as file:
            head = file.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return True
    first = next(
        (line.split("#", 1)[0].strip() for line in head.splitlines() if line.split("#", 1)[0].strip()), ""
    )
    return not (first and HEX.match(first.lower()))


def _hash_lines(text: str, where: str) -> list[str]:
    refs = []
    for number, line in enumerate(text.splitlines(), 1):
        ref = line.split("#", 1)[0].strip()
        if not ref:
            continue
        if not HEX.match(ref.lower()):
            raise UsageError(
                f"{where}:{number}: {ref!r} is not a plan hash; a sweep file holds one hash per line"
            )
        refs.append(ref)
    return refs


def resolve_targets(
    refs: Sequence[str],
    store: Store,
    overrides: Sequence[str] = (),
    axes: Sequence[str] = (),
    world_size: int = 1,
    stdin: TextIO | None = None,
    workers: WorkerProbe | None = None,
) -> list[Target]:
    """The plans `refs` name, in order, each once; raises `UsageError` naming a ref that names none.
    A preset is planned for `workers` (an engine's probe), else for this machine."""
    presets = [ref for ref in refs if ref != "-" and is_preset(ref)]
    if (overrides or axes) and not presets:
        raise UsageError(
            "--set and --sweep apply to a preset; give a preset path, or plan first with bt plan"
        )
    found: dict[str, Target] = {}
    for ref in refs:
        for target in _resolve_one(ref, store, overrides, axes, world_size, stdin or sys.stdin, workers):
            found.setdefault(target.plan.hash, target)
    return list(found.values())


def _resolve_one(
    ref: str,
    store: Store,
    overrides: Sequence[str],
    axes: Sequence[str],
    world_size: int,
    stdin: TextIO,
    workers: WorkerProbe | None,
) -> list[Target]:
    if ref == "-":
        return [Target(load_plan(store, r), 0) for r in _hash_lines(stdin.read(), "stdin")]
    if is_preset(ref):
        planned = plan_sweep(ref, overrides, axes, store, world_size, workers)
        if isinstance(planned, SweepPlans):
            return [Target(p.planned.plan, p.planned.threads) for p in planned.points]
        return [Target(planned.plan, planned.threads)]
    if Path(ref).is_file():
        try:
            text = Path(ref).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{ref}: cannot read the sweep file ({exc})") from None
        return [Target(load_plan(store, r), 0) for r in _hash_lines(text, ref)]
    try:
        return [Target(load_plan(store, ref), 0)]
    except UsageError:
        plans = load_sweep_plans(store, ref) if HEX.match(ref.lower()) and len(ref) >= 4 else None
        if plans is None:
            raise
        return [Target(load_plan(store, p), 0) for p in plans]
