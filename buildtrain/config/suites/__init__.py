"""The benchmark-suite kinds buildtrain knows, one module each (see `kind.py` for what a suite
kind says). Adding one is a module beside this file and its module's name in `REGISTERED`
(`tests/test_suite_kinds.py` adds a toy kind exactly so, and plans and scores a suite of it).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from buildtrain.config.suites.kind import SuiteKind

REGISTERED = ("choice", "exact", "harness")

SUITE_KINDS: dict[str, SuiteKind] = {
    kind.name: kind for kind in (importlib.import_module(f"{__name__}.{name}").KIND for name in REGISTERED)
}


def suite_kind(name: str) -> SuiteKind:
    """The suite kind named `name` (the schema admits only these)."""
    return SUITE_KINDS[name]


def accuracy(result: Mapping[str, Any]) -> float | None:
    """The number that stands for a suite's result (`SuiteKind.accuracy`; a result records its
    kind), or None (withheld, or of a kind this version does not know)."""
    kind = SUITE_KINDS.get(result.get("kind"))  # type: ignore[arg-type]
    return kind.accuracy(result) if kind is not None else None
