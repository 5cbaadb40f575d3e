"""The train step: run the trainer for one stage, then publish its output.

Output layout (sealed by MANIFEST.json):

    result.json              final step, weights path, digests
    trace.jsonl              one line per update: loss and grad-norm bits, lr, state digests
    checkpoints/step-N/      the retained checkpoints, the last one being the final state (sharded
                             training too: whole tensors, the files of an unsharded checkpoint)
    merged.safetensors       LoRA only: the final weights with the adapters added in (result.json's weights)
    adapters.safetensors     LoRA only: the adapters alone (the export writes them for peft)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.steps import TrainStep
from buildtrain.errors import StepFailed
from buildtrain.steps.context import RESULT, StepContext, final_weights, read_json
from buildtrain.steps.data.index import DATA_INDEX, records_end
from buildtrain.steps.train import checkpoint
from buildtrain.steps.train.controls import TrainControls
from buildtrain.steps.train.schedule import checkpoint_due
from buildtrain.steps.train.setup import TrainSetup
from buildtrain.steps.train.state import MODEL, TRACE
from buildtrain.steps.train.trainer import TrainResult, train
from buildtrain.store.checkpoints import checkpoint_problems
from buildtrain.store.layout import CHECKPOINTS
from buildtrain.store.tensors import combine, safetensors_digests

RESULT_FORMAT = 1
MERGED = "merged.safetensors"  # LoRA: the weights with the adapters added in
ADAPTERS = "adapters.safetensors"  # LoRA: the adapters alone


def make_setup(ctx: StepContext) -> TrainSetup:
    """The step's config dicts, structured once: everything below reads typed values."""
    config = TrainStep.from_config(ctx.step.config)
    numerics = ctx.numerics
    data_dir = ctx.inputs["data"]
    init = ctx.inputs.get("init")
    index = read_json(data_dir / DATA_INDEX)
    return TrainSetup(
        model=config.model,
        train=config.train,
        eval=config.eval,
        device=numerics.device,
        dtype=numerics.dtype,
        compile=numerics.compile,
        data=data_dir,
        index=index,
        separate_records=records_end(index),
        init_weights=final_weights(init) if init is not None else None,
        work=ctx.work / CHECKPOINTS,
        identity={"step_hash": ctx.step.hash},
    )


def assemble_output(setup: TrainSetup, result: TrainResult, out: Path, log: Any = None) -> dict[str, str]:
    """Assemble the output folder from the retained checkpoints and the trace. Only scheduled
    checkpoints that verify and belong to this step go into the output, and the newest must be the
    last update: nothing unverified is sealed into an output, and how often a build was interrupted
    leaves no trace in it (its files are a function of the step alone)."""
    retained = []
    for at, path in checkpoint.candidates(setup.work):
        if not checkpoint_due(at, setup.train):
            continue  # taken at an interruption: the output holds what an uninterrupted build holds
        found = (
            checkpoint_problems(path, at, setup.identity)
            if at <= setup.train.steps
            else ["beyond train.steps"]
        )
        if found:
            if log is not None:
                log.warning("checkpoint_skipped", checkpoint=path.name, reason="; ".join(found))
            checkpoint.set_aside(path)
            continue
        retained.append((at, path))
        if len(retained) == setup.train.keep_checkpoints:
            break
    if not retained or retained[0][0] != setup.train.steps:
        newest = retained[0][0] if retained else "none"
        raise StepFailed(
            f"the final checkpoint of update {setup.train.steps} is missing or damaged (newest intact: {newest}); "
            "bt run again resumes from the newest intact checkpoint"
        )
    final_update, final_path = retained[0]
    for _, path in retained:
        checkpoint.publish(path, out / CHECKPOINTS / path.name)  # sharded: whole, at any world size
    entries = result.trace.whole()  # read once, here: checkpoints hold only their segments
    (out / TRACE).write_bytes(b"".join(canonical_bytes(entry) + b"\n" for entry in entries))
    weights = f"checkpoints/{final_path.name}/{MODEL}"
    adapters = None
    if setup.train.lora is not None:  # its weights and frozen weights, merged
        weights, adapters = write_merged(setup, out / CHECKPOINTS / final_path.name, out)
    weights_digest = combine(safetensors_digests(out / weights))
    final_entry = next(e for e in reversed(entries) if "state" in e)
    digests = {
        "weights": weights_digest,
        "state": final_entry["state"],
        "trace": digest("trace", entries),
    }
    body: dict[str, Any] = {
        "format": RESULT_FORMAT,
        "steps": final_update,
        "weights": weights,
        "final_loss": final_entry["loss"],
        "checkpoints": [path.name for _, path in retained],
        "digests": digests,
    }
    if adapters is not None:
        body["adapters"] = adapters
    (out / RESULT).write_bytes(canonical_bytes(body))
    return digests


def write_merged(setup: TrainSetup, final: Path, out: Path) -> tuple[str, str]:
    """A LoRA stage's output weights: the final checkpoint's (folder `final`) adapters merged
    into its frozen weights (what evaluation, a later stage and the export load), and the
    adapters alone."""
    from buildtrain.steps.train.lora import is_adapter_tensor, merged
    from buildtrain.steps.train.state import checkpoint_weights, save_tensors

    assert setup.train.lora is not None
    tensors = checkpoint_weights(final)
    save_tensors(out / MERGED, merged(tensors, setup.train.lora, setup.model))
    save_tensors(out / ADAPTERS, {k: v for k, v in tensors.items() if is_adapter_tensor(k)})
    return MERGED, ADAPTERS


def execute(ctx: StepContext, out: Path | None) -> dict[str, str] | None:
    """Train (resuming if a checkpoint exists) and publish into `out` (rank 0); None when the
    observer stopped it early, and on the other ranks."""
    setup = make_setup(ctx)
    controls = ctx.controls or TrainControls()
    result = train(setup, ctx.log, controls)
    if result.stopped or not controls.ranks.lead:
        return None  # stopped by the observer (even at the last update), or another rank publishes
    assert out is not None
    return assemble_output(setup, result, out, ctx.log)
