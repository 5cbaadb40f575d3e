"""The eval kind: the final stage's weights evaluated on its held-out split and on the preset's
benchmark suites. Results are also content-addressed in the store's evaluation cache, keyed by
what determines them, so weights evaluated once (by any plan) are completed from the cache
without a process. Only with suites does the step read more: the suites' files (sources, by
content), the tokenizer step's output, the document digests of the data steps that trained the
weights and the n-gram filters of the ngrams steps that read the same text; without them it plans exactly as it did before suites existed."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.canonical import digest
from buildtrain.config.schema import Config, Stage
from buildtrain.config.steps import EvalStep, SuiteStep
from buildtrain.config.suites import SUITE_KINDS, suite_kind
from buildtrain.kinds.kind import Derived, StepKind
from buildtrain.plan.plan import Step
from buildtrain.plan.toolchain import Machine, library_version
from buildtrain.store.evals import keys_of_output
from buildtrain.store.layout import EVAL_RESULT

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning

# Bump when an evaluation suite changes what it computes; results are cached by this version.
EVAL_SUITE_VERSIONS = {"heldout": 1}


DOCUMENTS = "documents:"  # inputs naming the data steps whose documents a suite is checked against
NGRAMS = "ngrams:"  # inputs naming the ngrams steps that recorded those documents' n-grams


def lineage(config: Config) -> list[str]:
    """The stages whose training made the final weights: the final one and its ancestors, first first."""
    names, stage = [], config.final_stage
    while True:
        names.insert(0, stage.name)
        if stage.init_from is None:
            return names
        stage = config.stage(stage.init_from)


class EvalKind(StepKind):
    name = "eval"
    computes = "buildtrain.steps.eval.step"
    headline = "eval"
    torch_toolchain = True
    spot_checked = False  # a spot check (--steps) covers training only
    summary = "evaluation"
    completes_from_store = "same weights evaluated before"  # found in the evaluation cache
    reads_sources = True  # the suites' files, located by content before it runs
    checkpoints_of = "weights"  # the suites at kept checkpoints (eval.checkpoints_every), beside training
    # Each suite kind and its scoring, reached by name from `computes`: their code is this kind's too.
    also_computes = tuple(sorted({m for k in SUITE_KINDS.values() for m in (type(k).__module__, k.scores)}))

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        config = planning.config
        final = config.final_stage.name
        version = EVAL_SUITE_VERSIONS[config.eval.suite]
        suites = tuple(
            SuiteStep(name=s.name, version=s.version, kind=s.kind, max_overlap=s.max_overlap, ngram=s.ngram)
            for s in config.eval.suites
        )
        step_config = EvalStep(
            eval=config.eval,
            model=config.model,
            version=version,
            suites=suites,
            subset=config.eval.subset,
            seed=config.eval.seed,
            context=config.final_stage.train.seq_len,
            checkpoints_every=config.eval.checkpoints_every,
            lora=config.final_stage.train.lora,
        ).to_config()
        inputs: dict[str, Any] = {
            "weights": planning.weights(final).hash,
            "data": planning.required("data", final).hash,
        }
        if suites:  # questions are text: the step encodes them with the plan's tokenizer
            files = [f for suite in planning.suite_files for f in suite]  # data, then a harness task
            inputs["sources"] = [{"blake3": f.blake3, "size": f.size} for f in files]
            tokenizer = planning.planned("tokenizer", final)
            if tokenizer is not None:
                inputs["tokenizer"] = tokenizer.hash
            for name in lineage(config):  # the documents its weights were trained on, their n-grams
                inputs[f"{DOCUMENTS}{name}"] = planning.required("data", name).hash
                inputs[f"{NGRAMS}{name}"] = planning.required("ngrams", name).hash
        toolchain = self.toolchain(step_config, config.numerics, machine=planning.machine)
        return Step.create(self.name, self.name, step_config, inputs, toolchain)

    def checkpoints_evaluated(self, config: Mapping[str, Any], kept: list[int]) -> list[int]:
        # The final weights are the step's own result, scored after training with the held-out loss.
        every = config.get("checkpoints_every", 0) if config.get("suites") else 0
        return sorted(u for u in kept[1:] if every and u % every == 0)

    def library_facts(self, config: Mapping[str, Any], machine: Machine) -> dict[str, str]:
        # A harness task's numbers are the harness's: its release enters the hash where one runs.
        kinds = [suite_kind(suite["kind"]) for suite in config.get("suites", [])]
        return {name: library_version(name) for name in sorted({k.library for k in kinds if k.library})}

    def references(self, output: Path) -> list[str]:
        return keys_of_output(output)

    def derive_digests(self, output: Path) -> list[Derived]:
        body = json.loads((output / EVAL_RESULT).read_bytes())  # the scores and their identity
        return [Derived(name="eval", value=digest("eval-result", body), file=EVAL_RESULT)]


KIND = EvalKind()
