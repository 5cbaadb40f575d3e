"""The eval kind: the final stage's weights evaluated on its held-out split. Results are also
content-addressed in the store's evaluation cache, keyed by what determines them, so weights
evaluated once (by any plan) are completed from the cache without a process."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from buildtrain.config.schema import Stage
from buildtrain.config.steps import EvalStep
from buildtrain.kinds.kind import StepKind
from buildtrain.plan.plan import Step
from buildtrain.store.evals import key_of_output

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning

# Bump when an evaluation suite changes what it computes; results are cached by this version.
EVAL_SUITE_VERSIONS = {"heldout": 1}


class EvalKind(StepKind):
    name = "eval"
    computes = "buildtrain.steps.eval"
    headline = "eval"
    torch_toolchain = True
    spot_checked = False  # a spot check (--steps) covers training only
    summary = "evaluation"
    completes_from_store = "same weights evaluated before"  # found in the evaluation cache

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        config = planning.config
        final = config.final_stage.name
        version = EVAL_SUITE_VERSIONS[config.eval.suite]
        step_config = EvalStep(eval=config.eval, model=config.model, version=version).to_config()
        inputs = {
            "weights": planning.required("train", final).hash,
            "data": planning.required("data", final).hash,
        }
        toolchain = self.toolchain(step_config, config.numerics, machine=planning.machine)
        return Step.create(self.name, self.name, step_config, inputs, toolchain)

    def references(self, output: Path) -> list[str]:
        key = key_of_output(output)
        return [] if key is None else [key]


KIND = EvalKind()
