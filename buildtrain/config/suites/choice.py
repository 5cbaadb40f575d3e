"""Multiple choice: JSONL of {context, choices, answer}, scored by each choice's log-likelihood
(`steps/eval/choice.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from buildtrain.config.suite_files import read_multiple_choice
from buildtrain.config.suites.kind import SuiteKind


class MultipleChoice(SuiteKind):
    name = "multiple_choice"
    scores = "buildtrain.steps.eval.choice"
    scoring = 2  # 2: n-gram overlap
    accuracy_keys = ("acc",)

    def check(self, files: Mapping[str, str], context: int) -> None:
        read_multiple_choice(Path(files["file"]).read_bytes(), files["file"])


KIND = MultipleChoice()
