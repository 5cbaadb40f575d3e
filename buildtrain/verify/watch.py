"""Inside a re-executed train step: compare every update with the recorded trace as it happens.

The first update whose loss bits, gradient-norm bits, learning rate, data cursor, weights digest
or (at checkpoint steps) full-state digest differs from the record is the divergence point; the
per-tensor digests at that update name the tensors that differ. A field present on one side only is
a difference too, and an update the record lacks is one: nothing is passed without a comparison.
Training then continues only to the first checkpoint the record kept (at or after the divergence,
and within a spot check's steps), where both states are on disk, to measure how far each tensor
moved; then it stops, instead of training to the end.

The findings are rewritten after every update, listing each update compared so far (a step killed and
resumed on purpose carries the list on), so that `bt verify` can tell "every update matched" from
"the comparison never happened": missing findings or a missing update are never a pass.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from buildtrain.steps.train.checkpoint import read_trace
from buildtrain.steps.train.observer import Observer
from buildtrain.steps.train.state import checkpoint_tensors
from buildtrain.store.layout import (
    CHECKPOINTS,
    RESULT,
    TRACE,
    checkpoint_name,
    checkpoint_update,
)

COMPARED = ("loss", "grad_norm", "lr", "cursor", "weights", "state")
REPORTED_TENSORS = 10


class Watcher(Observer):
    """The training loop's observer on rank 0 of a re-executed train step (see observer.py)."""

    def __init__(
        self, recorded: Path, findings: Path, retained: list[int], stop_after: int | None, log: Any
    ) -> None:
        self.recorded_output = recorded
        self.findings_path = findings
        self.reference = {e["step"]: e for e in read_trace(recorded / TRACE) if "eval" not in e}
        self.retained = sorted(retained)
        self.stop_after = stop_after
        self.log = log
        self.divergence: dict[str, Any] | None = None
        self.compare_at: int | None = None
        self.compared: list[int] = []
        try:  # a re-execution killed and resumed on purpose goes on with the updates compared before
            earlier = json.loads(findings.read_bytes())
        except (OSError, ValueError):
            earlier = None
        if isinstance(earlier, dict) and not earlier.get("diverged"):
            self.compared = [int(s) for s in earlier.get("compared", [])]

    @classmethod
    def from_job(cls, job: dict[str, Any], log: Any) -> Watcher:
        recorded = Path(job["recorded"])
        names = json.loads((recorded / RESULT).read_bytes())["checkpoints"]
        retained = [at for at in map(checkpoint_update, names) if at is not None]
        return cls(recorded, Path(job["findings"]), retained, job.get("stop_after"), log)

    def wants_record(self, update: int) -> bool:
        """Every update's line at once: each is compared as it is made, and the state measured
        at a divergence is that update's (one copy from the device per update, which a
        re-execution pays and `bt run` does not)."""
        return True

    def recorded(self, entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        """Compare the record of an update as it is made; True ends training here."""
        step = entry["step"]
        spot_check_over = self.stop_after is not None and step >= self.stop_after
        if self.divergence is None:
            reference = self.reference.get(step)
            if reference is None:
                self._diverged(step, entry, {}, ["missing from the record"])
            else:
                fields = [
                    f for f in COMPARED if (f in entry or f in reference) and entry.get(f) != reference.get(f)
                ]
                if fields:
                    self._diverged(step, entry, reference, fields)
                else:
                    self.compared = sorted({*self.compared, step})
        if self.divergence is not None:
            if self.compare_at is None or step >= self.compare_at or spot_check_over:
                self._measure(step, tensors)
                return True
            return False
        self._write({"diverged": False, "steps_compared": len(self.compared), "compared": self.compared})
        return spot_check_over

    def _diverged(
        self, step: int, entry: dict[str, Any], reference: dict[str, Any], fields: list[str]
    ) -> None:
        ours, theirs = entry.get("tensors", {}), reference.get("tensors", {})
        names = sorted(name for name in ours if name in theirs and theirs[name] != ours[name])
        self.divergence = {
            "step": step,
            "fields": fields,
            "tensors": names,
            "recorded": {f: reference.get(f) for f in fields if f in reference},
            "reexecuted": {f: entry.get(f) for f in fields if f in entry},
            "compared": self.compared,
        }
        later = [s for s in self.retained if s >= step]
        self.compare_at = later[0] if later else None
        # Reported at once: should the process end before the measurement, the divergence stands.
        self._write({"diverged": True, **self.divergence, "compared_at": None, "differences": []})
        self.log.warning(
            "divergence",
            step=step,
            fields=fields,
            tensors=names[:REPORTED_TENSORS],
            compare_at=self.compare_at,
        )

    def _measure(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        assert self.divergence is not None
        differences: list[dict[str, Any]] = []
        folder = self.recorded_output / CHECKPOINTS / checkpoint_name(step)
        if self.compare_at == step and folder.is_dir():
            recorded = checkpoint_tensors(folder, optimizer=True)  # either layout
            for name, tensor in sorted(tensors.items()):
                other = recorded.get(name)
                if other is None or other.shape != tensor.shape:
                    continue
                delta = (tensor.detach().cpu().double() - other.double()).abs().max().item()
                if delta > 0 or not torch.equal(tensor.detach().cpu(), other):
                    differences.append({"tensor": name, "max_abs_diff": delta})
            differences.sort(key=lambda d: -d["max_abs_diff"])
        compared_at = step if differences or self.compare_at == step else None
        self._write(
            {"diverged": True, **self.divergence, "compared_at": compared_at, "differences": differences}
        )

    def _write(self, findings: dict[str, Any]) -> None:
        """Atomically: a reader (or a resumed watcher) sees the previous findings or this one."""
        temporary = self.findings_path.with_name(f".{self.findings_path.name}.tmp")
        temporary.write_text(json.dumps(findings, indent=2), encoding="utf-8")
        os.replace(temporary, self.findings_path)
