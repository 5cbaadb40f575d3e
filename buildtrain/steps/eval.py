"""The eval step: evaluate the final weights, with results content-addressed in the store.

A result is keyed by (suite, version, weights digest, data digest, settings), so weights that were
evaluated before are not evaluated again, whichever plan or stage produced them. The lookup needs
no torch: the executor completes a cached evaluation without starting a process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from buildtrain.plan.canonical import canonical_bytes, digest
from buildtrain.plan.plan import Step
from buildtrain.steps.context import StepContext, final_weights, read_json
from buildtrain.store.objects import sealed_digests, write_bytes_durably
from buildtrain.store.store import Store

EVAL_RESULT = "eval.json"


def cache_key(step: Step, weights_output: Path, data_output: Path) -> tuple[str, dict[str, Any]]:
    """The content address of this evaluation and the identity it is computed from."""
    config = step.config
    identity = {
        "suite": config["eval"]["suite"],
        "version": config["version"],
        "weights": sealed_digests(weights_output)["weights"],
        "data": sealed_digests(data_output)["data"],
        "settings": {k: v for k, v in config["eval"].items() if k != "suite"},
        "model": config["model"],
    }
    return digest("eval", identity), identity


def lookup(store: Store, key: str) -> dict[str, Any] | None:
    path = store.evals / f"{key}.json"
    if not path.is_file():
        return None
    try:
        body = read_json(path)
    except ValueError:
        return None
    return body if digest("eval", body.get("identity")) == key else None


def publish(store: Store, key: str, body: dict[str, Any], out: Path) -> dict[str, str]:
    """Write the result into the step output and into the content-addressed cache."""
    raw = canonical_bytes(body)
    (out / EVAL_RESULT).write_bytes(raw)
    store.evals.mkdir(parents=True, exist_ok=True)
    cached = store.evals / f"{key}.json"
    if not cached.exists():
        write_bytes_durably(cached, raw)
    return {"eval": digest("eval-result", body)}


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    import torch

    from buildtrain.config.convert import converter
    from buildtrain.config.schema import BYTE_VOCAB_SIZE, EvalConfig, ModelConfig
    from buildtrain.steps.data import DATA_INDEX
    from buildtrain.steps.heldout import evaluate
    from buildtrain.steps.train.batches import TokenStream
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.state import load_model

    key, identity = cache_key(ctx.step, ctx.inputs["weights"], ctx.inputs["data"])
    cached = lookup(ctx.store, key)
    if cached is not None:
        ctx.log.info("eval_cache_hit", key=key)
        return publish(ctx.store, key, cached, out)

    numerics = ctx.plan.config["numerics"]
    device = torch.device(numerics["device"])
    model = Transformer.build(
        converter.structure(ctx.step.config["model"], ModelConfig), BYTE_VOCAB_SIZE, torch.Generator()
    )
    load_model(model, final_weights(ctx.inputs["weights"]))  # every weight is replaced
    model.to(device)
    eval_config = converter.structure({**ctx.step.config["eval"], "every": 0}, EvalConfig)
    heldout = TokenStream(ctx.inputs["data"], read_json(ctx.inputs["data"] / DATA_INDEX)["splits"]["heldout"])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=numerics["dtype"] == "bfloat16")
    result = evaluate(model, heldout, eval_config, device, autocast)
    ctx.log.info("eval", **result)
    return publish(ctx.store, key, {"identity": identity, "result": result}, out)
