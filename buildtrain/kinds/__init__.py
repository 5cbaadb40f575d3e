"""The step kinds buildtrain knows, one module each (see `kind.py` for what a kind says).

Registry order is planning order: the kinds planned per stage, stage by stage, then the kinds
planned once per plan. Adding a kind is one module and one line here.
"""

from __future__ import annotations

from buildtrain.kinds import data, eval, export, tokenizer, train
from buildtrain.kinds.kind import StepKind

KINDS: dict[str, StepKind] = {
    kind.name: kind
    for kind in (
        tokenizer.KIND,
        data.KIND,
        train.KIND,
        eval.KIND,
        export.KIND,
    )
}


def kind_of(name: str) -> StepKind:
    """The kind named `name` (a stored plan's steps are checked against these on load)."""
    return KINDS[name]
