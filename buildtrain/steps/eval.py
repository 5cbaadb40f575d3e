"""The eval step: evaluate the final weights, with results content-addressed in the store.

A result is keyed by (suite, version, weights digest, data digest, settings), so weights that were
evaluated before are not evaluated again, whichever plan or stage produced them. The lookup needs
no torch: the executor completes a cached evaluation without starting a process. Each cached entry
is sealed by a digest over its key, its identity and its result (`seal_entry`), and is used only if
that verifies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.plan.plan import Step
from buildtrain.steps.context import StepContext, final_weights, read_json
from buildtrain.store.objects import read_manifest
from buildtrain.store.store import Store

EVAL_RESULT = "eval.json"


def _declared(output: Path, step_hash: str, name: str) -> str:
    """A digest an input's manifest declares, from the output sealed for `step_hash` only (another
    step's output copied or linked into its place declares another step's weights)."""
    body = read_manifest(output)
    if body["name"] != step_hash or output.name != step_hash or output.is_symlink():
        raise ValueError(f"{output} was not sealed as the output of step {step_hash[:12]}")
    return body["digests"][name]


def cache_key(step: Step, weights_output: Path, data_output: Path) -> tuple[str, dict[str, Any]]:
    """The content address of this evaluation and the identity it is computed from. Raises
    ValueError (or OSError) when an input's manifest is damaged or another step's."""
    config = step.config
    identity = {
        "suite": config["eval"]["suite"],
        "version": config["version"],
        "weights": _declared(weights_output, step.inputs["weights"], "weights"),
        "data": _declared(data_output, step.inputs["data"], "data"),
        "settings": {k: v for k, v in config["eval"].items() if k != "suite"},
        "model": config["model"],
    }
    return digest("eval", identity), identity


ENTRY_FORMAT = 1


def seal_entry(key: str, body: dict[str, Any]) -> bytes:
    """The bytes of `evals/<key>.json`: the key, the identity and the result under one digest, so
    an edited value, or an entry copied under another key, does not verify."""
    sealed = {"format": ENTRY_FORMAT, "key": key, "identity": body["identity"], "result": body["result"]}
    return canonical_bytes({**sealed, "seal": digest("eval-entry", sealed)})


def entry_problem(path: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the result body, None) when `path` holds the sealed result of `key`; (None, why) when it
    is damaged or foreign; (None, None) when there is nothing there."""
    if not path.exists() and not path.is_symlink():
        return None, None
    if path.is_symlink():
        return None, "a symbolic link, not an evaluation result"
    if not path.is_file():
        return None, "not a regular file"
    try:
        raw = path.read_bytes()
        entry = json.loads(raw)
        claimed = entry.pop("seal")
        if entry.get("format") != ENTRY_FORMAT or entry.get("key") != key:
            return None, "sealed for another key (a foreign result)"
        if claimed != digest("eval-entry", entry) or canonical_bytes({**entry, "seal": claimed}) != raw:
            return None, "content does not match its seal"
        if digest("eval", entry["identity"]) != key or not isinstance(entry["result"], dict):
            return None, "identity does not match its key"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"unreadable ({type(exc).__name__})"
    return {"identity": entry["identity"], "result": entry["result"]}, None


def lookup(store: Store, key: str) -> dict[str, Any] | None:
    """The cached result of `key`, only if its entry verifies (a damaged one is never used)."""
    body, _ = entry_problem(store.evals / f"{key}.json", key)
    return body


def publish(store: Store, key: str, body: dict[str, Any], out: Path) -> dict[str, str]:
    """Write the result into the step output and into the content-addressed cache (replacing a
    damaged entry there: the caller holds the step's lock)."""
    raw = canonical_bytes(body)
    (out / EVAL_RESULT).write_bytes(raw)
    path = store.evals / f"{key}.json"
    if lookup(store, key) is None:
        if os.path.lexists(path):
            store.set_aside(path)
        store.replace_file(path, seal_entry(key, body))
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
    index = read_json(ctx.inputs["data"] / DATA_INDEX)
    vocab_size = index["tokenizer"].get("vocab_size", BYTE_VOCAB_SIZE)
    model = Transformer.build(
        converter.structure(ctx.step.config["model"], ModelConfig), vocab_size, torch.Generator()
    )
    load_model(model, final_weights(ctx.inputs["weights"]))  # every weight is replaced
    model.to(device)
    eval_config = converter.structure({**ctx.step.config["eval"], "every": 0}, EvalConfig)
    heldout = TokenStream(ctx.inputs["data"], index["splits"]["heldout"])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=numerics["dtype"] == "bfloat16")
    result = evaluate(model, heldout, eval_config, device, autocast)
    ctx.log.info("eval", **result)
    return publish(ctx.store, key, {"identity": identity, "result": result}, out)
