"""The eval step: evaluate the final weights, with results content-addressed in the store.

The held-out loss, then each benchmark suite of `[eval] suites`, scored by the module its kind
names (`config/suites/`: `choice.py`, `exact.py`, `harness.py` here), with its overlap with the
training documents (`overlap.py`), and with `checkpoints_every` each suite again at the train
step's kept checkpoints: each scored as soon as training seals it, in a process beside the train
step (`evaluate_checkpoint`), and whatever that left is scored here. Every result is keyed in the
evaluation cache (`cache.py`) by what determines it, so weights evaluated before are not
evaluated again, and the model is loaded only for what the cache lacks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.config.steps import EvalStep, SuiteStep
from buildtrain.config.suites import suite_kind
from buildtrain.steps.context import StepContext, final_weights, read_json
from buildtrain.steps.eval.cache import (
    assemble,
    cache_key,
    checkpoint_weights_digest,
    complete_from_cache,
    curve_keys,
    suite_keys,
    write_result,
)
from buildtrain.steps.sources import Source
from buildtrain.store import objects
from buildtrain.store.layout import CHECKPOINTS, RESULT, checkpoint_update

if TYPE_CHECKING:
    from buildtrain.config.schema import NumericsConfig

# The executor completes an evaluation found in the cache without starting a process (kinds/eval.py).
complete_from_store = complete_from_cache


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    key, identity = cache_key(ctx.step, ctx.inputs["weights"], ctx.inputs["data"])
    wanted = [(key, identity), *suite_keys(ctx.step, ctx.inputs)]
    points = curve_keys(ctx.step, ctx.inputs)  # the suites at kept checkpoints (checkpoints_every)
    keys = [k for k, _ in wanted] + [k for _, _, k, _ in points]
    cached = [ctx.results.lookup(k) if ctx.results is not None else None for k in keys]
    for each, hit in zip(keys, cached, strict=True):
        if hit is not None:
            ctx.log.info("eval_cache_hit", key=each)
    results, curve = cached[: len(wanted)], cached[len(wanted) :]
    if any(hit is None for hit in results):  # the model is loaded only for what is not cached
        results = _evaluate(ctx, wanted, results)
    if any(hit is None for hit in curve):
        curve = _curve(ctx, points, curve)
    final = read_json(ctx.inputs["weights"] / RESULT).get("steps", 0)  # an imported checkpoint: none
    digests = write_result(assemble(results, points, curve, final), out)  # type: ignore[arg-type]
    if ctx.results is not None:  # the step holds its lock
        for each, result in zip(keys, [*results, *curve], strict=True):
            ctx.results.record(each, result)  # type: ignore[arg-type]
    return digests


def evaluate_checkpoint(
    ctx: StepContext, folders: list[Path], before_scoring: Callable[[], None] = lambda: None
) -> int:
    """Each suite at one kept checkpoint of the train step, sealed while it trains (evaluation
    beside training; `ctx.inputs` lacks the weights, not built yet). The checkpoint is read from
    the first of `folders` that holds it (the train step's work folder, then its output, which
    holds the same files once it is published). What the cache lacks is scored with the weights
    loaded once and recorded at once, each result under its own key: a process killed midway
    loses only the result it was computing, and no result is computed twice. Returns how many
    were scored (0 also where the checkpoint is gone or damaged: the eval step scores it)."""
    config = EvalStep.from_config(ctx.step.config)
    for folder in folders:
        if not folder.is_dir():
            continue
        try:
            return _at_checkpoint(ctx, config, folder, before_scoring)
        except FileNotFoundError:  # moved into the output (training ended) while it was read
            continue
    ctx.log.warning("eval_checkpoint_gone", checkpoint=folders[0].name, message="left to the eval step")
    return 0


def _at_checkpoint(
    ctx: StepContext, config: EvalStep, folder: Path, before_scoring: Callable[[], None]
) -> int:
    update = checkpoint_update(folder.name)
    problems = objects.verify(folder)
    if problems:
        if not folder.is_dir():
            raise FileNotFoundError(folder)
        ctx.log.warning("eval_checkpoint_refused", checkpoint=folder.name, problem=problems[0])
        return 0
    assert ctx.results is not None
    weights = checkpoint_weights_digest(folder, ctx.step.config.get("lora"))
    wanted = [
        (index, key, identity)
        for index, (key, identity) in enumerate(suite_keys(ctx.step, ctx.inputs, weights))
        if ctx.results.lookup(key) is None
    ]
    if not wanted:
        ctx.log.info("eval_cache_hit", checkpoint=folder.name)
        return 0
    loaded = load(config, ctx.inputs["data"], folder, ctx.numerics)
    files = suite_files(config, ctx.sources)
    for index, key, identity in wanted:
        before_scoring()
        suite = config.suites[index]
        result = score_suite(loaded, config, suite, files[index], ctx.inputs, ctx.work / suite.name)
        ctx.log.info("eval_suite", suite=suite.name, step=update, beside=True, **result)
        ctx.results.record(key, {"identity": identity, "result": result})
    return len(wanted)


def suite_files(config: EvalStep, sources: list[Source]) -> list[list[Source]]:
    """Each suite's sources (data, then a harness task), from the step's in plan order."""
    found, at = [], iter(sources)
    for suite in config.suites:
        found.append([next(at) for _ in suite_kind(suite.kind).sources])
    return found


def _curve(
    ctx: StepContext, points: list[tuple[int, int, str, dict[str, Any]]], cached: list[dict[str, Any] | None]
) -> list[dict[str, Any]]:
    """Each point of the suites' curves: cached ones as they are, the rest scored on the weights
    of their checkpoint (loaded once per checkpoint)."""
    config = EvalStep.from_config(ctx.step.config)
    files = suite_files(config, ctx.sources)
    results, loaded, loaded_at = list(cached), None, None
    for at, (update, index, _, identity) in enumerate(points):
        if results[at] is not None:
            continue
        if loaded is None or loaded_at != update:
            weights = ctx.inputs["weights"] / CHECKPOINTS / f"step-{update:06d}"  # either layout
            loaded, loaded_at = load(config, ctx.inputs["data"], weights, ctx.numerics), update
        suite = config.suites[index]
        work = ctx.work / "harness" / f"{suite.name}-{update}"
        result = score_suite(loaded, config, suite, files[index], ctx.inputs, work)
        ctx.log.info("eval_suite", suite=suite.name, step=update, **result)
        results[at] = {"identity": identity, "result": result}
    return results  # type: ignore[return-value]


def _evaluate(
    ctx: StepContext, wanted: list[tuple[str, dict[str, Any]]], cached: list[dict[str, Any] | None]
) -> list[dict[str, Any]]:
    """Each result of `wanted` (held-out first, then the suites): cached ones as they are, the
    rest computed with the weights loaded once."""
    from buildtrain.steps.train.batches import TokenStream
    from buildtrain.steps.train.heldout import evaluate

    config = EvalStep.from_config(ctx.step.config)
    loaded = load(config, ctx.inputs["data"], final_weights(ctx.inputs["weights"]), ctx.numerics)
    results = list(cached)
    if results[0] is None:
        from buildtrain.steps.data.index import records_end

        split = loaded.index["splits"]["heldout"]
        heldout = TokenStream(ctx.inputs["data"], split)
        masks = TokenStream(ctx.inputs["data"], split, "masks") if "masks" in split else None  # chat
        model, device, autocast = loaded.model, loaded.device, loaded.autocast
        result = evaluate(model, heldout, config.eval, device, autocast, masks, records_end(loaded.index))
        ctx.log.info("eval", **result)
        results[0] = {"identity": wanted[0][1], "result": result}
    final = read_json(ctx.inputs["weights"] / RESULT).get(
        "steps", 0
    )  # an imported checkpoint: none  # the update the final weights are of
    for at, (suite, files) in enumerate(
        zip(config.suites, suite_files(config, ctx.sources), strict=True), start=1
    ):
        if results[at] is None:
            work = ctx.work / "harness" / suite.name
            result = score_suite(loaded, config, suite, files, ctx.inputs, work)
            ctx.log.info("eval_suite", suite=suite.name, step=final, **result)
            results[at] = {"identity": wanted[at][1], "result": result}
    return results  # type: ignore[return-value]


@attrs.frozen(kw_only=True)
class Loaded:
    """Weights loaded to evaluate: the model, where it runs, and the data step's index."""

    model: Any
    device: Any
    autocast: Any
    index: dict[str, Any]


def load(config: EvalStep, data: Path, weights: Path, numerics: NumericsConfig) -> Loaded:
    """The model of `config` with the weights in `weights` (a safetensors file, or a kept
    checkpoint's folder), on the device."""
    import torch

    from buildtrain.steps.data.index import DATA_INDEX, embedding_rows
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.state import checkpoint_weights, load_model, load_weights

    device = torch.device(numerics.device)
    index = read_json(data / DATA_INDEX)
    model = Transformer.build(config.model, embedding_rows(config.model, index), torch.Generator())
    if weights.is_dir() and config.lora is not None:  # a LoRA checkpoint: frozen weights and adapters
        from buildtrain.steps.train.lora import merged

        load_weights(model, merged(checkpoint_weights(weights), config.lora, config.model), weights.name)
    else:
        load_model(model, weights)  # every weight is replaced
    model.to(device)
    bf16 = numerics.dtype == "bfloat16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    return Loaded(model=model, device=device, autocast=autocast, index=index)


def score_suite(
    loaded: Loaded,
    config: EvalStep,
    suite: SuiteStep,
    files: list[Source],
    inputs: dict[str, Path],
    work: Path,
) -> dict[str, Any]:
    """One suite scored on the subset `config` draws, with its overlap with the training
    documents (`inputs`: the step's verified inputs; `work`: a folder for the harness's files),
    by its kind's scoring module (`SuiteKind.scores`)."""
    scoring = importlib.import_module(suite_kind(suite.kind).scores)
    return scoring.score_suite(loaded, config, suite, files, inputs, work)  # type: ignore[no-any-return]
