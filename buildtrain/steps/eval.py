"""The eval step: evaluate the final weights, with results content-addressed in the store.

A result is keyed by (suite, version, weights digest, data digest, settings) in the evaluation
cache (`eval_cache.py`), so weights evaluated before are not evaluated again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from buildtrain.config.steps import EvalStep, SuiteStep
from buildtrain.steps.context import StepContext, final_weights, read_json
from buildtrain.steps.eval_cache import cache_key, complete_from_cache, suite_keys, write_result
from buildtrain.steps.sources import Source, read_source
from buildtrain.steps.suites import read_exact_match, read_multiple_choice, subset_indices, text_codec

# The executor completes an evaluation found in the cache without starting a process (kinds/eval.py).
complete_from_store = complete_from_cache


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    key, identity = cache_key(ctx.step, ctx.inputs["weights"], ctx.inputs["data"])
    wanted = [(key, identity), *suite_keys(ctx.step, ctx.inputs)]
    cached = [ctx.results.lookup(k) if ctx.results is not None else None for k, _ in wanted]
    for (each, _), hit in zip(wanted, cached, strict=True):
        if hit is not None:
            ctx.log.info("eval_cache_hit", key=each)
    results = cached
    if any(hit is None for hit in cached):  # the model is loaded only for what is not cached
        results = _evaluate(ctx, wanted, cached)
    body = results[0]
    if len(results) > 1:
        body = {**body, "suites": {r["identity"]["name"]: r for r in results[1:]}}
    digests = write_result(body, out)
    if ctx.results is not None:  # the step holds its lock
        for (each, _), result in zip(wanted, results, strict=True):
            ctx.results.record(each, result)
    return digests


def _evaluate(
    ctx: StepContext, wanted: list[tuple[str, dict[str, Any]]], cached: list[dict[str, Any] | None]
) -> list[dict[str, Any]]:
    """Each result of `wanted` (held-out first, then the suites): cached ones as they are, the
    rest computed with the weights loaded once."""
    import torch

    from buildtrain.steps.data_index import DATA_INDEX, vocab_size
    from buildtrain.steps.heldout import evaluate
    from buildtrain.steps.train.batches import TokenStream
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.state import load_model

    config = EvalStep.from_config(ctx.step.config)
    device = torch.device(ctx.numerics.device)
    index = read_json(ctx.inputs["data"] / DATA_INDEX)
    model = Transformer.build(config.model, vocab_size(index), torch.Generator())
    load_model(model, final_weights(ctx.inputs["weights"]))  # every weight is replaced
    model.to(device)
    bf16 = ctx.numerics.dtype == "bfloat16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    results = list(cached)
    if results[0] is None:
        heldout = TokenStream(ctx.inputs["data"], index["splits"]["heldout"])
        result = evaluate(model, heldout, config.eval, device, autocast)
        ctx.log.info("eval", **result)
        results[0] = {"identity": wanted[0][1], "result": result}
    for at, (suite, source) in enumerate(zip(config.suites, ctx.sources, strict=True), start=1):
        if results[at] is None:
            result = _suite(ctx, config, suite, source, model, device, autocast)
            ctx.log.info("eval_suite", suite=suite.name, **result)
            results[at] = {"identity": wanted[at][1], "result": result}
    return results  # type: ignore[return-value]


def _suite(
    ctx: StepContext,
    config: EvalStep,
    suite: SuiteStep,
    source: Source,
    model: Any,
    device: Any,
    autocast: Any,
) -> dict[str, Any]:
    """One suite scored on the subset the step's settings draw."""
    read = {"multiple_choice": read_multiple_choice, "exact_match": read_exact_match}[suite.kind]
    questions = read(read_source(source), source.path)
    chosen = [questions[i] for i in subset_indices(len(questions), config.subset, config.seed)]
    codec = text_codec(ctx.inputs.get("tokenizer"))
    if suite.kind == "exact_match":
        from buildtrain.steps import exact

        return {"kind": suite.kind, **exact.score(model, chosen, codec, config.context)}
    from buildtrain.steps.choice import score

    result = score(
        model, chosen, codec.encode, codec.end, config.context, config.eval.batch_size, device, autocast
    )
    return {"kind": suite.kind, **result}
