"""Inside a re-executed train step: compare every update with the recorded trace as it happens.

The first update whose loss bits, gradient-norm bits, learning rate, data cursor, weights digest
or (at checkpoint steps) full-state digest differs from the record is the divergence point; the per-tensor digests at that update name the
tensors that differ. Training then continues only to the first checkpoint the record kept (at or
after the divergence), where both states are on disk, to measure how far each tensor moved; then it
stops, instead of training to the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from buildtrain.steps.train.checkpoint import checkpoint_name, read_trace
from buildtrain.steps.train.state import MODEL, OPTIMIZER, TRACE

COMPARED = ("loss", "grad_norm", "lr", "cursor", "weights", "state")
REPORTED_TENSORS = 10


class Watcher:
    def __init__(
        self, recorded: Path, report: Path, retained: list[int], stop_after: int | None, log: Any
    ) -> None:
        self.recorded = recorded
        self.report_path = report
        self.reference = {e["step"]: e for e in read_trace(recorded / TRACE) if "eval" not in e}
        self.retained = sorted(retained)
        self.stop_after = stop_after
        self.log = log
        self.divergence: dict[str, Any] | None = None
        self.compare_at: int | None = None

    @classmethod
    def from_job(cls, job: dict[str, Any], log: Any) -> Watcher:
        recorded = Path(job["recorded"])
        retained = [
            int(name.removeprefix("step-"))
            for name in json.loads((recorded / "result.json").read_bytes())["checkpoints"]
        ]
        return cls(recorded, Path(job["report"]), retained, job.get("stop_after"), log)

    def __call__(self, entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        """Called after each update; True ends training here."""
        step = entry["step"]
        if self.divergence is None:
            reference = self.reference.get(step, {})
            fields = [f for f in COMPARED if f in entry and f in reference and entry[f] != reference[f]]
            if fields or not reference:
                self._diverged(step, entry, reference, fields or ["missing from the record"])
        if self.divergence is not None:
            if self.compare_at is None or step >= self.compare_at:
                self._measure(step, tensors)
                return True
            return False
        if self.stop_after is not None and step >= self.stop_after:
            self._write({"diverged": False, "steps_compared": step})
            return True
        return False

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
        }
        later = [s for s in self.retained if s >= step]
        self.compare_at = later[0] if later else None
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
        folder = self.recorded / "checkpoints" / checkpoint_name(step)
        if self.compare_at == step and folder.is_dir():
            recorded = {f"model.{k}": v for k, v in safetensors.torch.load_file(str(folder / MODEL)).items()}
            recorded.update(
                {f"optimizer.{k}": v for k, v in safetensors.torch.load_file(str(folder / OPTIMIZER)).items()}
            )
            for name, tensor in sorted(tensors.items()):
                other = recorded.get(name)
                if other is None or other.shape != tensor.shape:
                    continue
                delta = (tensor.detach().cpu().double() - other.double()).abs().max().item()
                if delta > 0 or not torch.equal(tensor.detach().cpu(), other):
                    differences.append({"tensor": name, "max_abs_diff": delta})
            differences.sort(key=lambda d: -d["max_abs_diff"])
        self._write({"diverged": True, **self.divergence, "compared_at": step, "differences": differences})

    def _write(self, report: dict[str, Any]) -> None:
        self.report_path.write_text(json.dumps(report, indent=2), encoding="utf-8")
