"""The export kind: an immutable package of the final weights, config, tokenizer, evaluation and
checksums, with a Hugging Face copy. Needs torch only to cast the weights to another dtype (a cast
is exact, so its bits depend on buildtrain's code alone)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.canonical import digest
from buildtrain.config.convert import converter
from buildtrain.config.schema import Config, Stage
from buildtrain.config.steps import BYTES, DataSettings, ExportStep
from buildtrain.kinds.kind import Derived, StepKind
from buildtrain.plan.plan import Step
from buildtrain.store import objects
from buildtrain.store.layout import CHECKSUMS, EXPORT_WEIGHTS
from buildtrain.store.tensors import combine, safetensors_digests

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning


class ExportKind(StepKind):
    name = "export"
    computes = "buildtrain.steps.export.step"
    headline = "weights"
    package = True
    spot_checked = False  # a spot check (--steps) covers training only

    def needs_torch(self, config: Mapping[str, Any]) -> bool:
        return config["export"]["dtype"] != "float32"  # casting the weights

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        config = planning.config
        if not config.export.enabled:
            return None
        final = config.final_stage
        tokenizer = planning.planned("tokenizer", final.name)
        inputs = {
            "weights": planning.weights(final.name).hash,
            "eval": planning.required("eval").hash,
        }
        if tokenizer is not None:
            inputs["tokenizer"] = tokenizer.hash
        base = planning.planned("import_hf", root_stage(config, final).name)
        if base is not None:  # hf/ keeps the checkpoint's architecture, config and tokenizer settings
            inputs["base"] = base.hash
        data = DataSettings.of(final.data)
        described = {
            "model": converter.unstructure(config.model),
            "train": converter.unstructure(final.train),
            "data": data.to_config(),
            "numerics": planning.view["numerics"],
        }
        # What the package's tokenizer is: the byte tokenizer's description, or the step's settings.
        described_tokenizer = attrs.asdict(BYTES) if tokenizer is None else data.to_config()["tokenizer"]
        step_config = ExportStep(
            export=config.export, tokenizer=described_tokenizer, described=described
        ).to_config()
        toolchain = self.toolchain(step_config, config.numerics, machine=planning.machine)
        return Step.create(self.name, self.name, step_config, inputs, toolchain)

    def derive_digests(self, output: Path) -> list[Derived]:
        """The weights from their tensors; the package from every file's blake3 (the manifest's,
        true of the bytes once verified), in the order the step listed them in BLAKE3SUMS. A
        file whose line BLAKE3SUMS does not hold is named: the package changed there."""
        files = objects.sealed_files(output)
        names = sorted((n for n in files if n != CHECKSUMS), key=PurePosixPath)  # as Path sorts
        lines = [f"{files[name]}  {name}\n" for name in names]
        written = (output / CHECKSUMS).read_text(encoding="utf-8").splitlines(keepends=True)
        changed = next((name for name, line in zip(names, lines, strict=True) if line not in written), None)
        weights = combine(safetensors_digests(output / EXPORT_WEIGHTS))
        return [
            Derived(name="weights", value=weights, file=EXPORT_WEIGHTS),
            Derived(name="package", value=digest("package", lines), file=changed or CHECKSUMS),
            Derived(name="package", value=digest("package", written), file=CHECKSUMS),  # what it ships
        ]


def root_stage(config: Config, stage: Stage) -> Stage:
    """The stage a stage's lineage starts from (the one that starts from no other stage)."""
    while stage.init_from is not None:
        stage = config.stage(stage.init_from)
    return stage


KIND = ExportKind()
