"""The step kinds buildtrain knows, one module each (see `kind.py` for what a kind says).

Registry order is planning order: the kinds planned per stage, stage by stage, then the kinds
planned once per plan. Adding a kind is one module beside this file and its name in `REGISTERED`
(`tests/test_kinds.py` adds a toy kind exactly so and builds, verifies, checks and collects it).
"""

from __future__ import annotations

import importlib

from buildtrain.kinds.kind import StepKind

REGISTERED = ("import_hf", "tokenizer", "data", "train", "ngrams", "eval", "export")

KINDS: dict[str, StepKind] = {
    kind.name: kind for kind in (importlib.import_module(f"{__name__}.{name}").KIND for name in REGISTERED)
}


def kind_of(name: str) -> StepKind:
    """The kind named `name` (a stored plan's steps are checked against these on load)."""
    return KINDS[name]
