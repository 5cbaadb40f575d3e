"""What a built plan hands out: its export package copied out of the store (`bt export`) and text
generated from its weights (`bt sample`). The CLI calls these two functions and never reaches
into a step's module.

`bt export` writes only into its destination, never into the store (a copy under `steps/` would
be a foreign object there), building the copy in a fresh temporary folder beside the destination
that is removed however the copy ends: an error, Ctrl-C or SIGTERM leave nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from buildtrain.config.checks import name_problem
from buildtrain.errors import CorruptObject, Interrupted, UsageError
from buildtrain.plan.plan import Plan
from buildtrain.steps.export import built_export
from buildtrain.store import objects
from buildtrain.store.layout import SHORT
from buildtrain.store.store import Store


def export_plan(store: Store, plan: Plan, destination: Path | None) -> Path:
    """Copy a built plan's export package to `destination` (default ./export/NAME-HASH), read-only."""
    output = built_export(store, plan)
    if destination is None:
        # The plan's name was checked to be a safe file name when it was loaded; check again here,
        # where it becomes a path, so that no name can place the export outside ./export.
        problem = name_problem(plan.name)
        if problem:
            raise CorruptObject(f"plan {plan.hash[:SHORT]}: name: {problem}; run bt fsck")
        destination = Path("export") / f"{plan.name}-{plan.hash[:SHORT]}"
    if os.path.lexists(destination):
        raise UsageError(f"{destination} already exists; exports are immutable, choose another destination")
    parent = destination.absolute().parent
    if parent.resolve().is_relative_to(store.root.resolve()):
        raise UsageError(f"{destination} is inside the store {store.root}; export to a folder outside it")
    parent.mkdir(parents=True, exist_ok=True)
    with _signals_stop(destination):
        _copy(output, destination, parent)
    return destination


def _copy(output: Path, destination: Path, parent: Path) -> None:
    # A fresh temporary folder beside the destination: never one of the user's, never reused.
    temporary = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp", dir=parent))
    try:
        package = temporary / "package"
        shutil.copytree(output, package, ignore=shutil.ignore_patterns(objects.MANIFEST))
        readable = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
        for path in sorted(package.rglob("*"), reverse=True):  # hf/ after its files
            os.chmod(path, readable | (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH if path.is_dir() else 0))
        if os.path.lexists(destination):
            raise UsageError(f"{destination} appeared while exporting; nothing was written there")
        os.rename(package, destination)
    finally:
        with _signals_deferred():
            shutil.rmtree(temporary, ignore_errors=True)


@contextlib.contextmanager
def _signals_stop(destination: Path) -> Iterator[None]:
    """SIGTERM stops the copy as Ctrl-C does (an exception, so the temporary copy is removed):
    by default it would end the process on the spot and leave the partial copy behind."""

    def stop(number: int, _: Any) -> None:
        raise Interrupted(f"stopped by {signal.Signals(number).name}; nothing was written to {destination}")

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: the signal is not ours to take
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """While the temporary copy is removed, a second SIGINT or SIGTERM waits until it is gone."""
    caught: list[int] = []
    previous = {}
    with contextlib.suppress(ValueError):
        for number in (signal.SIGINT, signal.SIGTERM):
            previous[number] = signal.signal(number, lambda n, _: caught.append(n))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if caught:
            signal.raise_signal(caught[0])


def sample_text(
    store: Store, plan: Plan, *, prompt: str, tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    """The text a built plan's exported weights generate after `prompt` (the prompt not included)."""
    from buildtrain.steps.sample import SampleOptions, sample

    options = SampleOptions(prompt=prompt, tokens=tokens, temperature=temperature, top_k=top_k, seed=seed)
    return sample(store, plan, options)
