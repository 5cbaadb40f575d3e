"""A 3 x 2 sweep of the two-stage micro preset, built once per test session and shared read-only.

The finetune stage's learning rate (3 values) and length (2 values) vary; the data steps and the
pretrain stage are the same for all six points, so they are built once.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from conftest import MICRO_STAGES, run_bt

AXES = ("--sweep", "stages.finetune.train.lr=1e-3,3e-3,1e-2", "--sweep", "stages.finetune.train.steps=4,8")
_BUILT: dict[str, BuiltSweep] = {}


@attrs.frozen
class BuiltSweep:
    store: Path
    experiments: Path
    plans: tuple[str, ...]
    first_run_stderr: str
    second_run_stderr: str


def built_sweep(factory: pytest.TempPathFactory) -> BuiltSweep:
    """Plan the sweep, run it twice (the second is a null build); copy the store before mutating."""
    if "sweep" not in _BUILT:
        root = factory.mktemp("sweep-built")
        store = root / ".bt"
        planned = run_bt("plan", str(MICRO_STAGES), *AXES, store=store)
        assert planned.returncode == 0, planned.stderr
        (root / "sweep.txt").write_text(planned.stdout)
        first = run_bt("run", "sweep.txt", "--progress", "off", store=store, cwd=root)
        assert first.returncode == 0, first.stderr
        second = run_bt("run", "sweep.txt", "--progress", "off", store=store, cwd=root)
        assert second.returncode == 0, second.stderr
        _BUILT["sweep"] = BuiltSweep(
            store=store,
            experiments=root / "experiments",
            plans=tuple(planned.stdout.split()),
            first_run_stderr=first.stderr,
            second_run_stderr=second.stderr,
        )
    return _BUILT["sweep"]
