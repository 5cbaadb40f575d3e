"""Run records: `experiments/<UTC timestamp>-<plan hash prefix>/`, one per `bt run`, never overwritten.

config.json     the resolved config the plan was compiled from (and the preset it came from)
plan.json       the plan snapshot
train.log       every event as a JSON line (executor and step processes alike)
metrics.jsonl   training and evaluation metrics, one JSON line each
summary.json    per step: cache hit, pulled from a remote or executed, duration, output digests; and the outcome
events.out.tfevents.*  the same training and evaluation scalars for TensorBoard (executor/loop/events.py)

A record is a log, not store data, so nothing in it is fsynced (a null build syncs nothing): its
files are replaced atomically, and train.log and metrics.jsonl are flushed line by line. Nothing
decides what to build or trust from a record (outputs, checkpoints and each step's metrics summary
live in the store, durably), so a crash costs at most the newest record's tail; a record left
without a readable summary.json is no finished record, and `bt gc --records` keeps it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import attrs

from buildtrain import clock
from buildtrain.executor.loop.metrics import MetricsCollector
from buildtrain.executor.process import logs
from buildtrain.executor.process.outcome import StepResult
from buildtrain.plan.plan import Plan
from buildtrain.sources.durable import write_bytes_durably
from buildtrain.store.objects import append_flushed

METRIC_EVENTS = ("train_step", "eval", "eval_suite")


class RunRecord:
    def __init__(self, folder: Path, plan: Plan, store_root: Path | None = None) -> None:
        self.folder = folder
        self.plan = plan
        self.metrics = MetricsCollector(folder, store_root)  # TensorBoard scalars, step summaries
        self.steps: list[StepResult] = []
        self._order = {step.hash: index for index, step in enumerate(plan.steps)}  # summary order
        self._log = open(folder / "train.log", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._metrics = open(folder / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._writing = threading.Lock()

    @classmethod
    def create(
        cls, root: Path, plan: Plan, meta: dict[str, Any], store_root: Path | None = None
    ) -> RunRecord:
        root.mkdir(parents=True, exist_ok=True)
        base = f"{clock.compact()}-{plan.hash[:12]}"
        for attempt in range(1000):
            folder = root / (base if attempt == 0 else f"{base}.{attempt}")
            try:
                folder.mkdir()
                break
            except FileExistsError:
                continue
        else:
            raise RuntimeError(f"could not create a run record under {root}")
        config = {
            "name": plan.name,
            "config": plan.config,
            "preset": meta.get("preset"),
            "overrides": meta.get("overrides", []),
        }
        write_bytes_durably(folder / "config.json", json.dumps(config, indent=2).encode(), durable=False)
        write_bytes_durably(folder / "plan.json", plan.pretty(), durable=False)
        return cls(folder, plan, store_root)

    @property
    def run_id(self) -> str:
        return self.folder.name

    def event(self, event: str, **fields: Any) -> None:
        """An executor event, rendered like the step processes' lines (`process/logs.py`)."""
        self._write_line(logs.event_line(event, **fields))

    def _write_line(self, line: str) -> None:
        with self._writing:
            append_flushed(self._log, line + "\n")

    def forward(self, line: dict[str, Any]) -> None:
        with self._writing:  # a concurrent engine's steps report from threads of their own
            append_flushed(self._log, json.dumps(line, sort_keys=True) + "\n")
            if line.get("event") in METRIC_EVENTS:
                metric = {k: v for k, v in line.items() if k not in ("level",)}
                append_flushed(self._metrics, json.dumps(metric, sort_keys=True) + "\n")
                self.metrics.event(line)

    def step_built(self, label: str, step_hash: str, wall_s: float) -> None:
        """A step process of this run published the step's output: write its metrics summary now
        (the run may yet be stopped before the step's result comes back)."""
        with self._writing:
            self.metrics.step_finished(
                {"label": label, "hash": step_hash, "action": "executed", "duration_s": wall_s},
                self.plan.step(step_hash).kind,
            )

    def step_result(self, result: StepResult) -> None:
        """Recorded as each step ends (an interrupted run's summary lists what it built)."""
        with self._writing:  # a concurrent engine's steps end in threads of their own
            self.steps.append(result)
            self.metrics.step_finished(attrs.asdict(result), self.plan.step(result.hash).kind)

    def close(self, outcome: str, exit_code: int, duration: float) -> None:
        summary = {
            "run_id": self.run_id,
            "plan": self.plan.hash,
            "name": self.plan.name,
            "outcome": outcome,
            "exit_code": exit_code,
            "duration_s": round(duration, 3),
            "executed": sum(s.action == "executed" for s in self.steps),
            "cached": sum(s.action == "cached" for s in self.steps),
            "pulled": sum(s.action == "pulled" for s in self.steps),  # from a remote (team cache)
            "joined": sum(s.action == "joined" for s in self.steps),  # trained with node 0
            "steps": [attrs.asdict(s) for s in sorted(self.steps, key=lambda s: self._order[s.hash])],
            "pid": os.getpid(),
        }
        write_bytes_durably(
            self.folder / "summary.json", json.dumps(summary, indent=2).encode(), durable=False
        )
        self._log.close()
        self._metrics.close()
        self.metrics.close()
