"""The import_hf kind: a pretrained checkpoint (`model.init = { hf = "folder" }`) converted once into
buildtrain's layout, the first weights of every stage that starts from no other stage.

Its inputs are the checkpoint's files by content (blake3, size), like a data step's files: the
folder's path and the files' names and times never enter its hash, and the stat cache makes a
second plan only stat them. Its config says which content is which file (config.json, the
shards), so the step needs no path to tell them apart. Torch-free: the conversion is a renaming
and an exact widening to float32, so its bits depend on buildtrain's code alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from buildtrain.config.schema import Stage
from buildtrain.kinds.kind import Derived, StepKind
from buildtrain.plan.plan import Step
from buildtrain.store.layout import EXPORT_WEIGHTS
from buildtrain.store.tensors import combine, safetensors_digests

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning

IMPORT_FORMAT = 1


class ImportKind(StepKind):
    name = "import_hf"
    computes = "buildtrain.steps.import_hf.step"
    headline = "weights"
    per_stage = True  # planned with the first stage that needs it; every such stage shares it
    reads_sources = True
    sources = "base checkpoint"  # bt diff: "base checkpoint changed"

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        """The import step for a stage that starts from the checkpoint (no `init_from`)."""
        assert stage is not None
        files = planning.checkpoint
        if files is None or stage.init_from is not None:
            return None
        config = {
            "format": IMPORT_FORMAT,
            "architecture": files.architecture,
            "files": {
                "base": {name: source.blake3 for name, source in sorted(files.base.items())},
                "shards": [source.blake3 for source in files.shards],
            },
        }
        every = [*files.base.values(), *files.shards]
        sources = [
            {"blake3": s.blake3, "size": s.size} for s in sorted(every, key=lambda s: (s.blake3, s.size))
        ]
        toolchain = self.toolchain(config, planning.config.numerics, machine=planning.machine)
        return Step.create(self.name, self.name, config, {"sources": sources}, toolchain)

    def derive_digests(self, output: Path) -> list[Derived]:
        weights = combine(safetensors_digests(output / EXPORT_WEIGHTS))
        return [Derived(name="weights", value=weights, file=EXPORT_WEIGHTS)]


KIND = ImportKind()
