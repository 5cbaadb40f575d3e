"""Plans of three presets (and one --set variant) in one store, built once per test session and
shared read-only: what a store holds after a few weeks of experiments, not one tidy sweep."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from conftest import MICRO, MICRO_STAGES, REPO, plan_hash, run_bt

WIDE = REPO / "tests" / "presets" / "wide.toml"
PLANS = (
    (MICRO,),
    (MICRO_STAGES,),
    (WIDE,),
    (MICRO, "--set", "model.norm=layernorm", "--set", "train.lr=1e-2"),
)
_BUILT: dict[str, BuiltMixed] = {}


@attrs.frozen
class BuiltMixed:
    store: Path
    experiments: Path
    plans: tuple[str, ...]


def built_mixed(factory: pytest.TempPathFactory) -> BuiltMixed:
    """Plan and build the four plans; copy the store before mutating."""
    if "mixed" not in _BUILT:
        root = factory.mktemp("mixed-built")
        store = root / ".bt"
        plans = tuple(plan_hash(run_bt("plan", str(preset), *rest, store=store)) for preset, *rest in PLANS)
        result = run_bt("run", *plans, "--progress", "off", store=store)
        assert result.returncode == 0, result.stderr
        _BUILT["mixed"] = BuiltMixed(store=store, experiments=root / "experiments", plans=plans)
    return _BUILT["mixed"]
