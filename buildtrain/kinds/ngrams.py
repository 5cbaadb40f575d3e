"""The ngrams kind: a stage's text read again and its n-grams of normalised words recorded in Bloom
filters, one per n the plan's suites count (`steps/ngrams/`), for the eval step's contamination
check. Planned only for a plan with suites, and only for the stages whose training made the final
weights (`eval.lineage`); the eval step reads it, the train step never does, so training starts
without waiting for it. Needs no torch and one thread; it comes after training in plan order, and
the local engine builds it beside training on the evaluation worker's core (`executor/loop/beside.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.canonical import digest
from buildtrain.config.schema import Config, Stage
from buildtrain.config.steps import NgramsStep, TextSettings
from buildtrain.kinds.eval import lineage
from buildtrain.kinds.kind import Derived, StepKind
from buildtrain.plan.plan import Step
from buildtrain.store import objects
from buildtrain.store.layout import DEFAULT_NGRAM, is_ngram_file
from buildtrain.store.ngram_file import filter_digest

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning


def suite_ngrams(config: Config) -> tuple[int, ...]:
    """The n-gram sizes the eval step's suites count (none: no suites, no step)."""
    return tuple(sorted({s.ngram or DEFAULT_NGRAM for s in config.eval.suites}))


class NgramsKind(StepKind):
    name = "ngrams"
    computes = "buildtrain.steps.ngrams.step"
    headline = "ngrams"
    per_stage = True
    reads_sources = True
    beside_training = True

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        assert stage is not None
        sizes = suite_ngrams(planning.config)
        if not sizes or stage.name not in lineage(planning.config):
            return None
        config = NgramsStep(text=TextSettings.of(stage.data), ngrams=sizes).to_config()
        inputs: dict[str, Any] = {"sources": planning.sources_input(stage.name)}
        toolchain = self.toolchain(config, planning.config.numerics, machine=planning.machine)
        return Step.create(f"{self.name}:{stage.name}", self.name, config, inputs, toolchain)

    def derive_digests(self, output: Path) -> list[Derived]:
        """Each filter's digest from its file, and the step's digest over them."""
        listed = objects.sealed_files(output)
        found = {
            name: filter_digest((output / name).read_bytes())
            for name in sorted(filter(is_ngram_file, listed))
        }
        derived = [Derived(name=name, value=value, file=name) for name, value in found.items()]
        return [*derived, Derived(name="ngrams", value=digest("ngrams-step", found), file=", ".join(found))]


KIND = NgramsKind()
