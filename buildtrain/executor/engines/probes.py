"""What an engine's workers are, asked once and kept: `bt run PRESET --executor ray|slurm` plans for
the machine the engine's workers execute steps on, which only a task on the cluster can tell (a
null build of presets/tiny.toml spent 16 s starting a local Ray instance to ask it).

The answer is kept in the store (`cache/workers/<key>.json`), keyed by what determines it: the
engine and the workers it reaches (`Engine.cluster`: RAY_ADDRESS, or a local instance; Slurm's
configuration and partition), the device, and this machine's own toolchain (a local instance's
workers are this machine). A kept answer only ever saves a null build: before a step is built the
workers are asked again, and where they answer otherwise the plans are made again for what they
are now (`WorkerProbes.confirm`). `bt plan --executor` always asks. Never part of any hash: a
kept answer that lies plans for another toolchain, which a node refuses before it computes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import attrs
from cattrs.errors import BaseValidationError

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.convert import converter
from buildtrain.executor.engines.engine import Engine
from buildtrain.plan.toolchain import Machine
from buildtrain.store.layout import WORKER_PROBES
from buildtrain.store.store import Store


@attrs.define
class WorkerProbes:
    """A `WorkerProbe`: the machine of `engine`'s workers for a device, asked once per device;
    `fresh`: ask the engine even where the store keeps an answer (`bt plan`)."""

    engine: Engine
    store: Store
    say: Callable[[str], None]
    fresh: bool = False
    answers: dict[str, Machine | None] = attrs.Factory(dict)
    kept: set[str] = attrs.Factory(set)  # devices answered from the store, not by the workers

    def __call__(self, device: str) -> Machine | None:
        if device not in self.answers:
            found = None if self.fresh else self._kept(device)
            if found is not None:
                self.kept.add(device)
            else:
                found = self._ask(device)
            self.answers[device] = found
            self._tell(found, "" if device not in self.kept else " (as they answered before)")
        return self.answers[device]

    def confirm(self) -> bool:
        """Ask the workers for each device answered from the store; True when any answer
        changed (the plans made from it are then made again)."""
        changed = False
        for device in sorted(self.kept):
            asked = self._ask(device)
            changed |= asked != self.answers[device]
            self.answers[device] = asked
        self.kept.clear()
        if changed:
            self.say(f"the {self.engine.name} workers' toolchain changed since asked before: planning again")
        return changed

    def _ask(self, device: str) -> Machine | None:
        found = self.engine.worker_machine(device, self.store)
        if found is not None:
            self.store.replace_file(self._path(device), canonical_bytes(attrs.asdict(found)))
        return found

    def _kept(self, device: str) -> Machine | None:
        """The answer kept for `device`, or None (absent, unreadable, or not a machine)."""
        try:
            body = json.loads(self._path(device).read_bytes())
            return converter.structure(body, Machine)
        except (OSError, ValueError, TypeError, BaseValidationError):  # a cache: ask the workers again
            return None

    def _path(self, device: str) -> Path:
        here = attrs.asdict(Machine.here(cuda=False))
        key = digest("worker-probe", {"cluster": self.engine.cluster(), "device": device, "here": here})
        return self.store.root / WORKER_PROBES / f"{key}.json"

    def _tell(self, found: Machine | None, how: str) -> None:
        if found is not None:
            gpu = f", {found.gpu['gpu']}" if found.gpu.get("gpu") else ""
            self.say(
                f"planning for the {self.engine.name} workers: torch {found.torch}, {found.cpu['arch']} "
                f"{found.cpu['isa']}{gpu}, {found.cores} cores{how}"
            )
