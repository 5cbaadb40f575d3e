"""Metrics of executed steps: TensorBoard scalars while a run goes, a small summary when a step ends.

The summary of a step (`metrics/steps/<step hash>.json`, sealed: `store/metrics.py`) is what `bt ls --metrics` and
`bt report` read instead of parsing every run's metrics.jsonl: final training loss, held-out
results, median tokens/s and the wall time of the execution that built the output. It is keyed by
step hash because a step is built once and shared by every plan that contains it (a sweep's
pretrain stage): its cost and speed belong to the step, not to whichever plan ran first. Like
eval results and stamps it is a derived record, never part of a hash; a lost one costs a blank
in a table, never a wrong number.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from buildtrain.errors import BuildtrainError
from buildtrain.executor.loop.events import EventWriter
from buildtrain.store.store import Store

TRAIN_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s")
EVAL_SCALARS = ("loss", "bits_per_token", "perplexity")
SUITE_SCALARS = ("acc", "acc_norm", "exact_match")  # a suite's result at an update (`eval_suite`)


class MetricsCollector:
    """Fed every event of a run; writes TensorBoard scalars and, per executed step, its summary."""

    def __init__(self, folder: Path, store_root: Path | None) -> None:
        self.store_root = store_root
        self.writer = EventWriter(folder)
        self._steps: dict[str, dict[str, Any]] = {}
        self._last_step: dict[str, int] = {}
        self._written: set[str] = set()  # steps whose summary this run wrote

    def event(self, line: dict[str, Any]) -> None:
        label = line.get("label")
        if not isinstance(label, str):
            return
        event = line.get("event")
        seen = self._steps.setdefault(label, {"train": [], "eval": None})
        if event == "train_step" and isinstance(line.get("step"), int):
            self._last_step[label] = line["step"]
            seen["train"].append(line)
            self.writer.scalars(line["step"], _scalars(label, line, TRAIN_SCALARS))
        elif (
            event == "eval_suite" and isinstance(line.get("step"), int) and isinstance(line.get("suite"), str)
        ):
            self.writer.scalars(line["step"], _scalars(f"{label}/{line['suite']}", line, SUITE_SCALARS))
        elif event == "eval":
            # During training an eval line carries the update; an evaluation step's own has none.
            during_training = isinstance(line.get("step"), int)
            at = line["step"] if during_training else max(self._last_step.values(), default=0)
            prefix = f"{label}/heldout" if during_training else label
            self.writer.scalars(at, _scalars(prefix, line, EVAL_SCALARS))
            if not during_training:
                seen["eval"] = {k: line[k] for k in EVAL_SCALARS if isinstance(line.get(k), (int, float))}

    def step_finished(self, result: dict[str, Any], kind: str) -> None:
        """Write the summary of a step this run executed (a cache hit keeps the builder's), once:
        when its process said the output is published, else when its result came back."""
        if self.store_root is None or result.get("action") != "executed" or result["hash"] in self._written:
            return
        self._written.add(result["hash"])
        seen = self._steps.get(result["label"], {"train": [], "eval": None})
        body: dict[str, Any] = {
            "label": result["label"],
            "kind": kind,
            "wall_s": result.get("duration_s"),
        }
        train = seen["train"]
        if train:
            speeds = [e["tokens_per_s"] for e in train if isinstance(e.get("tokens_per_s"), (int, float))]
            body["train"] = {
                "final_loss": train[-1].get("loss"),
                "final_step": train[-1].get("step"),
                "tokens_per_s": round(_median(speeds), 1) if speeds else None,
                "max_rss_mb": max((e.get("max_rss_mb") or 0 for e in train), default=None),
            }
        if seen["eval"]:
            body["eval"] = seen["eval"]
        with contextlib.suppress(OSError, BuildtrainError):  # read-only or damaged: a blank in tables
            Store(self.store_root).results.save_step_metrics(result["hash"], body)

    def close(self) -> None:
        self.writer.close()


def _scalars(prefix: str, line: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    return {
        f"{prefix}/{name}": float(line[name])
        for name in names
        if isinstance(line.get(name), (int, float)) and not isinstance(line.get(name), bool)
    }


def _median(values: list[float]) -> float:
    """statistics.median, imported here: with decimal and fractions it cost a null build ~5 ms."""
    import statistics

    return statistics.median(values)
