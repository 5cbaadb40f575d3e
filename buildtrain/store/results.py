"""The results part of a store: what was measured of plans and steps, kept beside their outputs
and never inside one: evaluation results by key (`evals/`), plan cards and built steps' metrics
summaries (`metrics/`). The files' encodings are in `metrics.py` and `evals.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from buildtrain.store import layout, metrics
from buildtrain.store.folders import Folders


class Results:
    def __init__(self, folders: Folders) -> None:
        self._folders = folders

    def card_path(self, plan_hash: str) -> str:
        """A plain string: a table asks for thousands of these, and `os.path` is cheaper than Path."""
        return os.path.join(self._folders.cards, plan_hash + ".json")

    def step_metrics_path(self, step_hash: str) -> str:
        return os.path.join(self._folders.step_metrics, step_hash + ".json")

    def read_step_metrics(self, step_hash: str) -> dict[str, Any] | None:
        """A built step's sealed metrics summary; None when absent or not sound (a blank)."""
        return metrics.read_step_metrics(self.step_metrics_path(step_hash), step_hash)

    def save_step_metrics(self, step_hash: str, body: dict[str, Any]) -> None:
        self._folders.folder(self._folders.step_metrics)
        self._folders.replace_file(
            Path(self.step_metrics_path(step_hash)), metrics.encode({**body, "step": step_hash})
        )

    def eval_path(self, key: str) -> Path:
        return self._folders.evals / layout.json_name(key)
