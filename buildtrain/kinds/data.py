"""The data kind: a stage's sources read, tokenized, split into train and held-out, and written as
token shards. Needs no torch; its bits depend on buildtrain's code and, where a tokenizer step's
BPE encodes the text, on the `tokenizers` release."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.canonical import digest
from buildtrain.config.schema import DataConfig, Stage
from buildtrain.config.steps import BYTES, DataSettings, DataStep
from buildtrain.kinds.kind import Derived, StepKind
from buildtrain.plan.plan import Step
from buildtrain.plan.toolchain import Machine
from buildtrain.store import objects
from buildtrain.store.layout import DATA_INDEX, DOCUMENTS, is_ngram_file
from buildtrain.store.ngram_file import filter_digest
from buildtrain.store.tensors import tensor_digest

# Bytes per token id and the digest's dtype code, by a split's "dtype" (none: uint16), as
# steps/data/shards.py writes them; loss masks are one byte per token.
SHARD_CODES = {None: (2, "u16"), "u32": (4, "u32")}
MASK_CODE = (1, "u8")

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning


def data_view(data: DataConfig) -> dict[str, Any]:
    """The data section as the plan records it (in every data step and in the plan's config)."""
    return DataSettings.of(data).to_config()


class DataKind(StepKind):
    name = "data"
    computes = "buildtrain.steps.data.step"
    headline = "data"
    per_stage = True
    reads_sources = True

    def library_facts(self, config: Mapping[str, Any], machine: Machine) -> dict[str, str]:
        # Encoding with a tokenizer step's BPE: the token ids are that library's numbers.
        facts = {} if "tokenizer" in config else {"tokenizers": machine.tokenizers}
        if config["data"].get("format") == "chat":  # records rendered by jinja2's template engine
            from importlib.metadata import version

            facts["jinja2"] = version("jinja2")
        return facts

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        assert stage is not None
        tokenizer = planning.planned("tokenizer", stage.name)
        inputs: dict[str, Any] = {"sources": planning.sources_input(stage.name)}
        # The tokenizer step's output describes its tokens; the byte tokenizer is described here.
        described = BYTES if tokenizer is None else None
        config = DataStep(data=DataSettings.of(stage.data), tokenizer=described).to_config()
        if tokenizer is not None:
            inputs["tokenizer"] = tokenizer.hash
        toolchain = self.toolchain(config, planning.config.numerics, machine=planning.machine)
        return Step.create(f"{self.name}:{stage.name}", self.name, config, inputs, toolchain)

    def derive_digests(self, output: Path) -> list[Derived]:
        """Each shard's digest from its tokens, the data digest from them, the documents' digest
        from its file: what the index and the manifest declare, computed from the bytes."""
        index = json.loads((output / DATA_INDEX).read_bytes())
        listed, found, shards = objects.sealed_files(output), [], {}
        for split, entry in index["splits"].items():
            parts = [(split, entry["shards"], SHARD_CODES[entry.get("dtype")])]
            if "masks" in entry:
                parts.append((f"{split}-mask", entry["masks"], MASK_CODE))
            for name, written, (width, code) in parts:
                shards[name] = [_shard(output, shard, width, code, listed) for shard in written]
                found += [
                    Derived(name=s["file"], value=d, file=s["file"])
                    for s, d in zip(written, shards[name], strict=True)
                ]
        found.append(Derived(name="data", value=digest("data", shards), file=DATA_INDEX))
        if DOCUMENTS in listed:
            count = (output / DOCUMENTS).stat().st_size // 8
            value = digest("documents", {"file": listed[DOCUMENTS], "count": count})
            found.append(Derived(name=DOCUMENTS, value=value, file=DOCUMENTS))
        # An output from before the ngrams kind holds its stage's filters too: still checked.
        for name in sorted(filter(is_ngram_file, listed)):
            value = filter_digest((output / name).read_bytes())
            found.append(Derived(name=name, value=value, file=name))
        return found


def _shard(output: Path, shard: Mapping[str, Any], width: int, code: str, listed: Mapping[str, str]) -> str:
    """A shard's digest from its file (one the manifest lists, of the size its tokens take)."""
    name, tokens = shard["file"], shard["tokens"]
    if name not in listed:
        raise ValueError(f"{DATA_INDEX} names shard {name!r} the output does not hold")
    raw = (output / name).read_bytes()
    if len(raw) != tokens * width:
        raise ValueError(f"{name}: {len(raw)} bytes, {tokens} tokens of {width} bytes each")
    return tensor_digest(name, code, [tokens], raw)


KIND = DataKind()
