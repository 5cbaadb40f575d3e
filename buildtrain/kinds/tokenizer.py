"""The tokenizer kind: a byte-level BPE trained on a stage's text, or a given tokenizer file.

A stage whose `data.tokenizer` is a table gets a `tokenizer` step; its hash covers the tokenizer
settings and only the data settings that choose its training text (source, format, field, split),
so a change of `shard_tokens` or of training settings never retrains it, and every stage or plan
that asks for the same tokenizer on the same text shares the step. A given file enters as its
content digest and size: renaming it changes nothing, editing one byte changes the hash.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.canonical import digest
from buildtrain.config.schema import Stage, TokenizerConfig
from buildtrain.config.steps import TextSettings, TokenizerSettings, TokenizerStep
from buildtrain.errors import ConfigError
from buildtrain.kinds.kind import Derived, StepKind
from buildtrain.plan.plan import Step
from buildtrain.plan.toolchain import Machine
from buildtrain.store import objects
from buildtrain.store.layout import TOKENIZER_DESCRIPTION, TOKENIZER_FILE

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning


class TokenizerKind(StepKind):
    name = "tokenizer"
    computes = "buildtrain.steps.tokenizer.step"
    headline = "tokenizer"
    per_stage = True
    reads_sources = True

    def library_facts(self, config: Mapping[str, Any], machine: Machine) -> dict[str, str]:
        return {"tokenizers": machine.tokenizers}  # a trained vocabulary is that library's numbers

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        """The stage's tokenizer step, or None for the byte tokenizer. A stage that starts from
        another's weights keeps its tokenizer (the ids must mean the same tokens)."""
        assert stage is not None
        if stage.init_from is not None:
            if stage.data.tokenizer != planning.config.stage(stage.init_from).data.tokenizer:
                raise ConfigError(
                    [
                        f"stages.{stage.name}.data.tokenizer: differs from the tokenizer of stage "
                        f"'{stage.init_from}', whose weights it starts from; a stage keeps its parent's "
                        "tokenizer, so leave it out"
                    ]
                )
            return planning.planned(self.name, stage.init_from)
        tokenizer = stage.data.tokenizer
        if not isinstance(tokenizer, TokenizerConfig):
            return None
        settings = TokenizerSettings.of(tokenizer)
        if tokenizer.kind == "file":
            given = planning.tokenizer_files[stage.name]  # the planner digests every tokenizer file
            config = TokenizerStep(tokenizer=settings).to_config()
            inputs = {"sources": [{"blake3": given.blake3, "size": given.size}]}
        else:
            config = TokenizerStep(tokenizer=settings, text=TextSettings.of(stage.data)).to_config()
            inputs = {"sources": planning.sources_input(stage.name)}
        toolchain = self.toolchain(config, planning.config.numerics, machine=planning.machine)
        return Step.create(f"{self.name}:{stage.name}", self.name, config, inputs, toolchain)

    def derive_digests(self, output: Path) -> list[Derived]:
        """The tokenizer digest from its file's blake3 and its description."""
        described = json.loads((output / TOKENIZER_DESCRIPTION).read_bytes())
        value = digest("tokenizer", {"file": objects.sealed_files(output)[TOKENIZER_FILE], **described})
        return [Derived(name="tokenizer", value=value, file=TOKENIZER_DESCRIPTION)]


KIND = TokenizerKind()
