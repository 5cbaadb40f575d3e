"""`bt eval`: a built plan's weights (or a kept checkpoint's) scored on one of its suites, ad hoc.

The result is the eval step's, keyed and stored the same way (`evals/<key>.json`): the identity
names the suite, its version, the weights' digest, the file's content, the subset and its seed,
so asking again, or a plan that asks for the same, finds it without loading a model. Only on a
miss does this process apply the plan's numerics environment and import torch.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from buildtrain.config.suites import suite_kind
from buildtrain.errors import UsageError
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.steps.context import read_json
from buildtrain.steps.eval.cache import lookup, record_entry, suite_keys
from buildtrain.store.layout import CHECKPOINTS, RESULT
from buildtrain.store.store import Store


@attrs.frozen(kw_only=True)
class Evaluated:
    suite: str
    key: str
    result: dict[str, Any]
    cached: bool  # found in the store: no model was loaded
    weights: str  # "final" or "update N"


def suite_step(plan: Plan, reference: str, subset: float | None) -> tuple[Step, Step]:
    """(the plan's eval step, an eval step for the suite `reference`, NAME or NAME@VERSION, alone)."""
    evals = [step for step in plan.steps if kind_of(step.kind).summary == "evaluation"]
    if not evals:
        raise UsageError(f"plan {plan.hash[:12]} has no eval step")
    step = evals[0]
    name, _, version = reference.partition("@")
    suites = step.config.get("suites", [])
    sources, at = list(step.inputs.get("sources", [])), 0
    for suite in suites:
        count = len(suite_kind(suite["kind"]).sources)
        if suite["name"] == name and (not version or version == str(suite["version"])):
            config = {**step.config, "suites": [suite]}
            if subset is not None:
                config["subset"] = subset
            inputs = {**step.inputs, "sources": sources[at : at + count]}
            return step, Step.create(step.label, step.kind, config, inputs, step.toolchain)
        at += count
    listed = ", ".join(f"{s['name']}@{s['version']}" for s in suites) or "none"
    raise UsageError(f"--suite {reference}: the plan's suites are {listed}; give one of them ([eval] suites)")


def kept_weights(store: Store, eval_step: Step, update: int | None) -> tuple[str | None, str, str]:
    """(the weights' digest, or None for the train step's final weights; where they are inside
    the train output; how to name them) for `--update N` (a kept checkpoint) or the final weights
    that `eval_step` scores."""
    train = eval_step.inputs["weights"]
    output = store.outputs.path(train)
    result = read_json(output / RESULT)
    if update is None:
        return None, result["weights"], "final"
    name = f"step-{update:06d}"
    if name not in result["checkpoints"]:
        kept = ", ".join(str(int(n.split("-")[1])) for n in result["checkpoints"])
        raise UsageError(
            f"--update {update}: the train step kept the checkpoints of updates {kept}; give one"
        )
    from buildtrain.steps.eval.cache import checkpoint_weights_digest

    path = f"{CHECKPOINTS}/{name}"  # the folder: eval loads either layout, and merges LoRA adapters
    return checkpoint_weights_digest(output / path, eval_step.config.get("lora")), path, f"update {update}"


def evaluate(store: Store, plan: Plan, reference: str, subset: float | None, update: int | None) -> Evaluated:
    """The suite `reference` of a built `plan` on its final weights or kept checkpoint `update`:
    from the store when there, else computed here and stored."""
    step, alone = suite_step(plan, reference, subset)
    if not store.outputs.has(step.inputs["weights"]) or not store.outputs.has(step.inputs["data"]):
        raise UsageError(
            f"plan {plan.hash[:12]}: its weights are not built yet; bt run {plan.hash[:12]} first"
        )
    from buildtrain.executor.process.inputs import verified_inputs

    inputs = verified_inputs(store, alone)  # re-hashed against their manifests, as a step's are
    digest, path, named = kept_weights(store, alone, update)
    ((key, identity),) = suite_keys(alone, inputs, digest)
    name = identity["name"]
    found = lookup(store, key)
    if found is not None:
        return Evaluated(suite=name, key=key, result=found["result"], cached=True, weights=named)
    result = _compute(store, plan, alone, inputs, inputs["weights"] / path)
    record_entry(store, key, {"identity": identity, "result": result})
    return Evaluated(suite=name, key=key, result=result, cached=False, weights=named)


def _compute(store: Store, plan: Plan, step: Step, inputs: dict[str, Any], weights: Any) -> dict[str, Any]:
    """Score the one suite of `step` in this process, under the plan's numerics environment (set
    before torch is imported, on one thread, and checked after, as a step process does)."""
    from buildtrain.config.steps import EvalStep
    from buildtrain.executor.process import numerics
    from buildtrain.executor.process.step_sources import source_paths
    from buildtrain.steps.sources import planned_sources

    settings = plan.numerics
    wanted = (settings.profile, settings.device, 1)
    os.environ.update(numerics.environment(*wanted))
    numerics.import_torch(*wanted)
    from buildtrain.steps.eval.step import load, score_suite

    config = EvalStep.from_config(step.config)
    files = planned_sources(step.inputs["sources"], source_paths(store, plan, step))
    loaded = load(config, inputs["data"], weights, settings)
    work = store.new_temp("eval")
    try:
        return score_suite(loaded, config, config.suites[0], files, inputs, work)
    finally:
        from buildtrain.store import objects

        objects.remove_tree(work)
