"""The export step: an immutable package of final weights, config, tokenizer and checksums.

    model.safetensors   final weights (cast to export.dtype)
    config.json         model, training, data and numerics settings of the final stage
    tokenizer.json      how text becomes tokens
    eval.json           the held-out evaluation of these weights
    hf/                 the same weights and tokenizer for Hugging Face transformers (steps/hf_export.py)
    BLAKE3SUMS          `<blake3>  <file>` per file (hf/ included), checkable with b3sum -c

`bt export PLAN DEST` copies the package out of the store, read-only (`executor/deliver.py`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import attrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.convert import converter
from buildtrain.config.schema import ExportConfig
from buildtrain.errors import CorruptObject, UsageError
from buildtrain.plan.plan import Plan
from buildtrain.steps.context import StepContext, final_weights
from buildtrain.store import objects
from buildtrain.store.layout import CHECKSUMS, EVAL_RESULT, EXPORT_WEIGHTS
from buildtrain.store.store import Store
from buildtrain.store.tensors import combine, safetensors_digests

WEIGHTS = EXPORT_WEIGHTS


@attrs.frozen(kw_only=True)
class ExportStep:
    """An export step's config: what it does (`export`, `tokenizer`), and the settings it
    describes in config.json, kept exactly as the plan holds them (the package's bytes)."""

    export: ExportConfig
    tokenizer: dict[str, Any]  # the byte tokenizer's description, or the tokenizer step's settings
    described: dict[str, Any]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ExportStep:
        """From the plan's step config (`Step.config`), which stays a plain dict for the hash."""
        return cls(
            export=converter.structure(config["export"], ExportConfig),
            tokenizer=config["tokenizer"],
            described={k: v for k, v in config.items() if k != "tokenizer"},
        )


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    from buildtrain.steps.hf_export import HF_FOLDER, write_hf
    from buildtrain.steps.tokenizer import export_files

    config = ExportStep.from_config(ctx.step.config)
    source = final_weights(ctx.inputs["weights"])
    if config.export.dtype == "float32":
        shutil.copyfile(source, out / WEIGHTS)
    else:
        import safetensors.torch
        import torch

        tensors = safetensors.torch.load_file(str(source))
        safetensors.torch.save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(out / WEIGHTS))
    (out / "config.json").write_bytes(canonical_bytes(config.described))
    tokenizer_json, description = export_files(ctx.inputs, config.tokenizer)
    (out / "tokenizer.json").write_bytes(
        canonical_bytes(config.tokenizer if "tokenizer" not in ctx.inputs else description)
    )
    shutil.copyfile(ctx.inputs["eval"] / EVAL_RESULT, out / EVAL_RESULT)
    write_hf(
        out / HF_FOLDER,
        out / WEIGHTS,
        config.described["model"],
        tokenizer_json,
        description["end_of_document_token"],
        description["end_of_document"],
        config.described["train"]["seq_len"],
        config.export.dtype,
    )
    lines = [
        f"{objects.hash_file(path)[0]}  {path.relative_to(out).as_posix()}\n"
        for path in sorted(out.rglob("*"))
        if path.is_file()
    ]
    (out / CHECKSUMS).write_text("".join(lines), encoding="utf-8")
    return {"weights": combine(safetensors_digests(out / WEIGHTS)), "package": digest("package", lines)}


def built_export(store: Store, plan: Plan, wanted_for: str = "") -> Path:
    """The export output of a built plan, re-hashed against its manifest; else a clear refusal."""
    steps = [step for step in plan.steps if step.kind == "export"]
    if not steps:
        raise UsageError(f"plan {plan.hash[:12]} has no export step (export.enabled = false){wanted_for}")
    step = steps[0]
    if not store.has_output(step.hash):
        raise UsageError(f"plan {plan.hash[:12]} is not built yet; run: bt run {plan.hash[:12]}")
    problems = store.verify_output(step.hash)
    if problems:
        raise CorruptObject(f"the export output {step.hash[:12]} does not verify: {problems[0]}; run bt fsck")
    return store.output(step.hash)
