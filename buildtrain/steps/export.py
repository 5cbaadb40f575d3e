"""The export step: an immutable package of final weights, config, tokenizer and checksums.

    model.safetensors   final weights (cast to export.dtype)
    config.json         model, training, data and numerics settings of the final stage
    tokenizer.json      how text becomes tokens
    eval.json           the held-out evaluation of these weights
    hf/                 the same weights and tokenizer for Hugging Face transformers (steps/hf_export.py)
    BLAKE3SUMS          `<blake3>  <file>` per file (hf/ included), checkable with b3sum -c

`bt export PLAN DEST` copies the package out of the store, read-only.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.checks import name_problem
from buildtrain.config.steps import ExportStep
from buildtrain.errors import CorruptObject, UsageError
from buildtrain.steps.context import StepContext, final_weights
from buildtrain.store import objects
from buildtrain.store.tensors import combine, safetensors_digests

if TYPE_CHECKING:
    from buildtrain.plan.plan import Plan
    from buildtrain.store.store import Store

WEIGHTS = "model.safetensors"
CHECKSUMS = "BLAKE3SUMS"


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    from buildtrain.steps.eval_cache import EVAL_RESULT
    from buildtrain.steps.hf_export import HF_FOLDER, write_hf
    from buildtrain.steps.tokenizer_files import export_files

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
    shutil.copyfile(ctx.inputs["eval"] / EVAL_RESULT, out / "eval.json")
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
    from buildtrain.kinds import kind_of  # (moves out of the step's module with this function)

    steps = [step for step in plan.steps if kind_of(step.kind).package]
    if not steps:
        raise UsageError(f"plan {plan.hash[:12]} has no export step (export.enabled = false){wanted_for}")
    step = steps[0]
    if not store.has_output(step.hash):
        raise UsageError(f"plan {plan.hash[:12]} is not built yet; run: bt run {plan.hash[:12]}")
    problems = store.verify_output(step.hash)
    if problems:
        raise CorruptObject(f"the export output {step.hash[:12]} does not verify: {problems[0]}; run bt fsck")
    return store.output(step.hash)


def export_to(store: Store, plan: Plan, destination: Path | None) -> Path:
    """Copy a built plan's export package to `destination` (default ./export/NAME-HASH), read-only."""
    output = built_export(store, plan)
    if destination is None:
        # The plan's name was checked to be a safe file name when it was loaded; check again here,
        # where it becomes a path, so that no name can place the export outside ./export.
        problem = name_problem(plan.name)
        if problem:
            raise CorruptObject(f"plan {plan.hash[:12]}: name: {problem}; run bt fsck")
        destination = Path("export") / f"{plan.name}-{plan.hash[:12]}"
    if os.path.lexists(destination):
        raise UsageError(f"{destination} already exists; exports are immutable, choose another destination")
    parent = destination.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    # A fresh temporary folder beside the destination: never one of the user's, never reused.
    temporary = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp", dir=parent))
    try:
        package = temporary / "package"
        _copy_package(output, package, destination)
        readable = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
        for path in sorted(package.rglob("*"), reverse=True):  # hf/ after its files
            os.chmod(path, readable | (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH if path.is_dir() else 0))
        if os.path.lexists(destination):
            raise UsageError(f"{destination} appeared while exporting; nothing was written there")
        os.rename(package, destination)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return destination


def _copy_package(output: Path, package: Path, destination: Path) -> None:
    """Copy an output's files (not its manifest) to `package`; the first failure stops the copy,
    named by the destination and the file (`shutil.copytree` goes on past every failure and then
    raises the list of them, which read as a Python list of tuples)."""
    for path in sorted(output.rglob("*")):
        relative = path.relative_to(output)
        if relative.as_posix() == objects.MANIFEST:
            continue
        try:
            if path.is_dir():
                (package / relative).mkdir(parents=True)
            else:
                (package / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, package / relative)
        except OSError as exc:
            message = f"{exc.strerror or exc} (writing {relative.as_posix()}); nothing was written there"
            raise OSError(exc.errno, message, str(destination)) from None
