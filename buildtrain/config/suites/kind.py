"""What a kind of benchmark suite is: the one protocol every suite kind implements, once, in its
own module beside this one (`choice.py`, `exact.py`, `harness.py`, as under `steps/eval/`).

The schema, the planner, the eval kind, the evaluation cache, `bt eval` and the views ask a
suite's kind; none of them tests its name (`tests/test_suite_kinds.py`). A suite kind says:

- which files it reads (`sources`: their names in the evaluation cache's identity, in the eval
  step's order, each from the suite's config key in `SOURCE_KEYS`);
- how those files are checked when a plan is made (`check`), as the eval step will read them;
- what its scoring's version is (`scoring`: results are cached by it) and which library's release
  its numbers are (`library`: it enters the eval step's toolchain, and each result's identity);
- where its scoring computes (`scores`: a module under `steps/eval/` with `score_suite(...)`, reached
  by name as a step kind's `computes` is, and hashed into the eval kind's code digest);
- which number of its result stands for it (`accuracy`), as `bt report` and `bt run` show it.

Torch-free and cheap to import: the schema loads every suite kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

# The config key of a suite (`[[eval.suites]]`) that names each source a kind may read.
SOURCE_KEYS = {"data": "file", "task": "task"}


class SuiteKind:
    """The defaults of a suite kind that reads one JSONL file of questions."""

    name: ClassVar[str]
    scores: ClassVar[str]  # the module whose `score_suite(...)` scores a suite of this kind
    scoring: ClassVar[int]  # bump when its scoring changes what it computes (results are cached by it)
    sources: ClassVar[tuple[str, ...]] = ("data",)  # the files it reads, in the eval step's order
    library: ClassVar[str | None] = None  # the distribution whose release its numbers are
    accuracy_keys: ClassVar[tuple[str, ...]] = ()  # its result's headline number, the first present

    def config_keys(self) -> tuple[str, ...]:
        """The config keys that name its files (`file`, `task`), in source order."""
        return tuple(SOURCE_KEYS[source] for source in self.sources)

    def check(self, files: Mapping[str, str], context: int) -> None:
        """Read its files (`files`: paths by config key) as the eval step will, at plan time, so that a
        malformed line stops the plan, not the eval step after training (`context`: the eval
        step's tokens per window). Raises StepFailed naming the file and the fix, or OSError."""
        raise NotImplementedError

    def accuracy(self, result: Mapping[str, Any]) -> float | None:
        """The number that stands for a result of this kind, or None where it has none."""
        for key in self.accuracy_keys:
            value = result.get(key)
            if isinstance(value, (int, float)):
                return float(value)
        return None
