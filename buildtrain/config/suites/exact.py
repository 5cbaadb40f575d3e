"""Exact match: JSONL of {context, target}, scored by greedy generation (`steps/eval/exact.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from buildtrain.config.suite_files import read_exact_match
from buildtrain.config.suites.kind import SuiteKind


class ExactMatch(SuiteKind):
    name = "exact_match"
    scores = "buildtrain.steps.eval.exact"
    scoring = 2  # 2: n-gram overlap
    accuracy_keys = ("exact_match",)

    def check(self, files: Mapping[str, str], context: int) -> None:
        read_exact_match(Path(files["file"]).read_bytes(), files["file"])


KIND = ExactMatch()
