"""Consecutive steps of one numerics environment share a step process (torch is imported once),
and give the bits of a process per step: `bt verify` re-executes each step in a fresh process."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import MICRO_STAGES, plan_hash, run_bt, summaries


def events(experiments: Path, name: str) -> list[dict]:
    (record,) = [p for p in experiments.iterdir() if p.is_dir()]
    return [
        e for e in map(json.loads, (record / "train.log").read_text().splitlines()) if e.get("event") == name
    ]


def test_a_plan_imports_torch_once_and_verifies_against_a_process_per_step(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(MICRO_STAGES), store=store))
    built = run_bt("run", planned, store=store)
    assert built.returncode == 0, built.stderr
    experiments = tmp_path / "experiments"
    (summary,) = summaries(experiments)
    computing = [s["label"] for s in summary["steps"] if s["label"].startswith(("train", "eval"))]
    assert len(computing) == 3 and all(s["action"] == "executed" for s in summary["steps"])
    assert len(events(experiments, "numerics_applied")) == 1  # three torch steps, one import
    assert [e["status"] for e in events(experiments, "job_exit")] == [0] * len(summary["steps"])

    checked = run_bt("verify", planned, "--experiments", str(tmp_path / "verify"), store=store)
    assert checked.returncode == 0, checked.stdout + checked.stderr
