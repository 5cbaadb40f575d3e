"""The export step: an immutable package of final weights, config, tokenizer and checksums.

    model.safetensors   final weights (cast to export.dtype)
    config.json         model, training, data and numerics settings of the final stage
    tokenizer.json      how text becomes tokens
    eval.json           the held-out evaluation of these weights
    hf/                 the same weights and tokenizer for Hugging Face transformers (steps/export/hf.py)
    peft/               a LoRA stage's adapters, for peft on the base checkpoint
    BLAKE3SUMS          `<blake3>  <file>` per file (hf/ included), checkable with b3sum -c

`bt export PLAN DEST` copies the package out of the store, read-only (`executor/adhoc/deliver.py`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.steps import ExportStep
from buildtrain.steps.context import RESULT, StepContext, final_weights, read_json
from buildtrain.store import objects
from buildtrain.store.layout import CHECKSUMS, EVAL_RESULT, EXPORT_WEIGHTS, IMPORT_BASE
from buildtrain.store.tensors import combine, safetensors_digests

WEIGHTS = EXPORT_WEIGHTS


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    from buildtrain.steps.export.hf import HF_FOLDER, PEFT_FOLDER, write_hf, write_peft
    from buildtrain.steps.tokenizer.files import export_files

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
        base=ctx.inputs["base"] / IMPORT_BASE if "base" in ctx.inputs else None,
    )
    adapters = read_json(ctx.inputs["weights"] / RESULT).get("adapters")
    if adapters is not None:  # a LoRA stage: its adapters for peft, beside the merged weights
        write_peft(
            out / PEFT_FOLDER,
            ctx.inputs["weights"] / adapters,
            config.described["train"]["lora"],
            config.described["model"]["n_layers"],
        )
    lines = [
        f"{objects.hash_file(path)[0]}  {path.relative_to(out).as_posix()}\n"
        for path in sorted(out.rglob("*"))
        if path.is_file()
    ]
    (out / CHECKSUMS).write_text("".join(lines), encoding="utf-8")
    return {"weights": combine(safetensors_digests(out / WEIGHTS)), "package": digest("package", lines)}
