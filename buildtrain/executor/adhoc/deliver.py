"""What a built plan hands out: its export package copied out of the store (`bt export`, signed
with `--sign`) and text generated from its weights (`bt sample`). The CLI calls these functions
and never reaches into a step's module.

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
from typing import TYPE_CHECKING, Any

from buildtrain.config.checks import name_problem
from buildtrain.errors import CorruptObject, Interrupted, UsageError
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan
from buildtrain.steps.sample import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE  # the CLI checks these
from buildtrain.store import objects
from buildtrain.store.layout import SHORT
from buildtrain.store.store import Store

__all__ = ["MAX_SEED", "MAX_TEMPERATURE", "MIN_TEMPERATURE", "export_plan", "sample_text"]

if TYPE_CHECKING:
    from buildtrain.steps.sample import Sampled


def built_export(store: Store, plan: Plan, wanted_for: str = "") -> Path:
    """The export output of a built plan, re-hashed against its manifest; else a clear refusal."""
    steps = [step for step in plan.steps if kind_of(step.kind).package]
    if not steps:
        raise UsageError(f"plan {plan.hash[:SHORT]} has no export step (export.enabled = false){wanted_for}")
    step = steps[0]
    if not store.outputs.has(step.hash):
        raise UsageError(f"plan {plan.hash[:SHORT]} is not built yet; run: bt run {plan.hash[:SHORT]}")
    problems = store.outputs.verify(step.hash)
    if problems:
        raise CorruptObject(
            f"the export output {step.hash[:SHORT]} does not verify: {problems[0]}; run bt fsck"
        )
    return store.outputs.path(step.hash)


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


def sign_package(package: Path, private_key: Path) -> Path:
    """`bt export --sign KEY`: the exported package signed in the OpenSSF model-signing format;
    the signature's path (beside the package). model-signing is imported only on this path."""
    from buildtrain.executor.adhoc.signed_export import sign_export

    return sign_export(package, private_key)


def _copy(output: Path, destination: Path, parent: Path) -> None:
    # A fresh temporary folder beside the destination: never one of the user's, never reused.
    temporary = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp", dir=parent))
    try:
        package = temporary / "package"
        _copy_package(output, package, destination)
        readable = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
        for path in sorted(package.rglob("*"), reverse=True):  # hf/ after its files
            os.chmod(path, readable | (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH if path.is_dir() else 0))
        if os.path.lexists(destination):
            raise UsageError(f"{destination} appeared while exporting; nothing was written there")
        os.rename(package, destination)
    finally:
        with _signals_deferred():
            shutil.rmtree(temporary, ignore_errors=True)


def _copy_package(output: Path, package: Path, destination: Path) -> None:
    """Copy an output's files (not its manifest) to `package`; the first failure stops the copy,
    named by the destination and the file (`shutil.copytree` goes on past every failure and then
    raises the list of them, which read as a Python list of tuples)."""
    for path in sorted(output.rglob("*")):
        relative = path.relative_to(output)
        if relative.as_posix() == objects.MANIFEST:
            continue
        try:
            if path.is_dir():
                (package / relative).mkdir(parents=True)
            else:
                (package / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, package / relative)
        except OSError as exc:
            message = f"{exc.strerror or exc} (writing {relative.as_posix()}); nothing was written there"
            raise OSError(exc.errno, message, str(destination)) from None


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
) -> Sampled:
    """What a built plan's exported weights generate after `prompt` (the prompt not included), and
    why generation stopped."""
    from buildtrain.steps.sample import SampleOptions, sample

    options = SampleOptions(prompt=prompt, tokens=tokens, temperature=temperature, top_k=top_k, seed=seed)
    return sample(built_export(store, plan, "; enable it to sample"), options)
