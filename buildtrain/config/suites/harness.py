"""A harness task: an lm-evaluation-harness task YAML (`task`) on local JSONL data (`file`), run
through the harness (`steps/eval/harness.py`); its numbers are the harness's, so its release enters
the eval step's hash."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from buildtrain.config.suite_files import check_data, check_task
from buildtrain.config.suites.kind import SuiteKind
from buildtrain.config.task_check import check_task_data


class HarnessTask(SuiteKind):
    name = "lm_eval"
    scores = "buildtrain.steps.eval.harness"
    scoring = 2  # 2: n-gram overlap
    sources = ("data", "task")
    library = "lm-eval"
    accuracy_keys = ("acc", "exact_match")  # what a task of either output type reports

    def check(self, files: Mapping[str, str], context: int) -> None:
        data, task = files["file"], files["task"]
        records = check_data(Path(data).read_bytes(), data)
        config = check_task(Path(task).read_bytes(), task)
        check_task_data(config, task, records, data, context)


KIND = HarnessTask()
