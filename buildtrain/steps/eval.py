"""The eval step: evaluate the final weights, with results content-addressed in the store.

A result is keyed by (suite, version, weights digest, data digest, settings) in the evaluation
cache (`eval_cache.py`), so weights evaluated before are not evaluated again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from buildtrain.config.steps import EvalStep
from buildtrain.steps.context import StepContext, final_weights, read_json
from buildtrain.steps.eval_cache import cache_key, complete_from_cache, write_result

# The executor completes an evaluation found in the cache without starting a process (kinds/eval.py).
complete_from_store = complete_from_cache


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    import torch

    from buildtrain.steps.data_index import DATA_INDEX, embedding_rows, records_end
    from buildtrain.steps.heldout import evaluate
    from buildtrain.steps.train.batches import TokenStream
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.state import load_model

    key, identity = cache_key(ctx.step, ctx.inputs["weights"], ctx.inputs["data"])
    cached = ctx.results.lookup(key) if ctx.results is not None else None
    if cached is not None:
        ctx.log.info("eval_cache_hit", key=key)
        return _recorded(ctx, key, cached, out)

    config = EvalStep.from_config(ctx.step.config)
    numerics = ctx.numerics
    device = torch.device(numerics.device)
    index = read_json(ctx.inputs["data"] / DATA_INDEX)
    model = Transformer.build(config.model, embedding_rows(config.model, index), torch.Generator())
    load_model(model, final_weights(ctx.inputs["weights"]))  # every weight is replaced
    model.to(device)
    split = index["splits"]["heldout"]
    heldout = TokenStream(ctx.inputs["data"], split)
    masks = TokenStream(ctx.inputs["data"], split, "masks") if "masks" in split else None  # chat records
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=numerics.dtype == "bfloat16")
    result = evaluate(model, heldout, config.eval, device, autocast, masks, records_end(index))
    ctx.log.info("eval", **result)
    return _recorded(ctx, key, {"identity": identity, "result": result}, out)


def _recorded(ctx: StepContext, key: str, body: dict[str, Any], out: Path) -> dict[str, str]:
    """Write the result into the output and into the evaluation cache (the step holds its lock)."""
    digests = write_result(body, out)
    if ctx.results is not None:
        ctx.results.record(key, body)
    return digests
