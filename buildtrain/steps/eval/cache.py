"""The evaluation cache: results addressed by what determines them, so weights evaluated once are
not evaluated again, whichever plan or stage produced them.

What an evaluation's identity is (`cache_key`) is decided here, from the plan's step; the entry's
file format (its key, seal and checks) is `store/evals.py`, which `bt gc` and `bt fsck` read
without importing a step. Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.suites import suite_kind
from buildtrain.store import objects
from buildtrain.store.evals import entry_problem, key_of, seal_entry
from buildtrain.store.layout import (
    CHECKPOINTS,
    DEFAULT_NGRAM,
    DOCUMENTS,
    EVAL_RESULT,
    FROZEN,
    MODEL,
    RESULT,
    SHARDS,
    ngram_file,
)
from buildtrain.store.objects import read_manifest

if TYPE_CHECKING:  # a step is handed the cache (`StoreResults`), never the store's code
    from buildtrain.plan.plan import Step
    from buildtrain.store.store import Store


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
    return key_of(identity), identity


BYTE_TOKENIZER = "bytes"  # the tokenizer of a plan with no tokenizer step (bytes are their ids)
DATA_INPUT, NGRAMS_INPUT = "documents:", "ngrams:"  # an eval step's inputs per trained-on stage


def trained_on(step: Step, inputs: Mapping[str, Path], stage: str, filter_file: str) -> list[str]:
    """The digests a suite's overlap with one stage's text follows from: its data step's
    documents and its ngrams step's filter (each only where declared: an output from before
    either declares none)."""
    found = []
    for name, file in ((DATA_INPUT + stage, DOCUMENTS), (NGRAMS_INPUT + stage, filter_file)):
        if name in step.upstream and file in read_manifest(inputs[name])["digests"]:
            found.append(_declared(inputs[name], step.inputs[name], file))
    return found


def suite_keys(
    step: Step, inputs: Mapping[str, Path], weights: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """(key, identity) of each benchmark suite of the eval step, in suite order: what the result
    depends on is the suite (name, version, scoring), the weights, the file's content, the subset
    and its seed, and how text becomes tokens (tokenizer, model context); never the plan or the
    path. `weights`: the digest of other weights than the input's final ones (a kept checkpoint,
    `bt eval --update`). Raises ValueError (or OSError) like `cache_key`."""
    config = step.config
    suites = config.get("suites", [])
    if not suites:
        return []
    weights = weights or _declared(inputs["weights"], step.inputs["weights"], "weights")
    tokenizer = BYTE_TOKENIZER
    if "tokenizer" in step.inputs:
        tokenizer = _declared(inputs["tokenizer"], step.inputs["tokenizer"], "tokenizer")
    # What the contamination check intersects: each trained-on data step's document digests
    # and its ngrams step's filter of the suite's n-grams, the same values (so the same keys) as
    # when the data step recorded the filter itself.
    stages = [k.removeprefix(DATA_INPUT) for k in sorted(step.upstream) if k.startswith(DATA_INPUT)]
    found, sources = [], iter(step.inputs["sources"])
    for suite in suites:
        filter_file = ngram_file(suite.get("ngram", DEFAULT_NGRAM))
        trained = [trained_on(step, inputs, stage, filter_file) for stage in stages]
        kind = suite_kind(suite["kind"])  # results are cached by its scoring as well as the suite's version
        files = {name: next(sources)["blake3"] for name in kind.sources}
        harness = {"harness": step.toolchain[kind.library]} if kind.library else {}  # its release
        identity = {
            **suite,
            **files,
            **harness,
            "scoring": kind.scoring,
            "weights": weights,
            "trained_on": trained,
            "subset": config["subset"],
            "seed": config["seed"],
            "tokenizer": tokenizer,
            "context": config["context"],
            "model": config["model"],
        }
        found.append((key_of(identity), identity))
    return found


def curve_keys(step: Step, inputs: Mapping[str, Path]) -> list[tuple[int, int, str, dict[str, Any]]]:
    """(update, suite index, key, identity) of each point of the suites' curves (`checkpoints_every`):
    every suite at every kept checkpoint of the train step whose update is a multiple of
    `checkpoints_every`, the final one excepted (it is the step's own result). Each point is a suite
    result like any other, keyed by its checkpoint's weights digest (computed as the train step
    computes its final one). Torch-free."""
    every = step.config.get("checkpoints_every", 0)
    if not every:
        return []
    output = inputs["weights"]
    trained = json.loads((output / RESULT).read_bytes())
    points = []
    for name in trained.get("checkpoints", []):  # an imported checkpoint's output keeps none
        update = int(name.rsplit("-", 1)[1])
        if update % every or update == trained["steps"]:
            continue
        weights = checkpoint_weights_digest(output / CHECKPOINTS / name, step.config.get("lora"))
        for index, (key, identity) in enumerate(suite_keys(step, inputs, weights)):
            points.append((update, index, key, identity))
    return sorted(points, key=lambda p: (p[0], p[1]))


def checkpoint_weights_digest(folder: Path, lora: Mapping[str, Any] | None) -> str:
    """The digest a kept checkpoint's weights are cached under, either layout. A LoRA
    checkpoint holds its frozen weights and its adapters apart; what eval scores is them merged
    by `lora` (the eval step's config), so that enters too. Torch-free."""
    from buildtrain.store.tensors import combine, safetensors_digests, sharded_digests

    if (folder / SHARDS).is_dir():
        weights = combine(sharded_digests(folder / SHARDS, "model."))
    else:
        found = safetensors_digests(folder / MODEL)
        if (folder / FROZEN).is_file():  # LoRA: the frozen weights, in a file of their own
            found.update(safetensors_digests(folder / FROZEN))
        weights = combine(found)
    return weights if lora is None else digest("lora-merged", {"weights": weights, "lora": dict(lora)})


def assemble(
    found: list[dict[str, Any]],
    points: list[tuple[int, int, str, dict[str, Any]]],
    curve: list[dict[str, Any]],
    final: int = 0,
) -> dict[str, Any]:
    """An eval step's output body: the held-out result, each suite's, and each suite's curve
    (ending with its result on the final weights, those of update `final`)."""
    body = found[0]
    if len(found) > 1:
        body = {**body, "suites": {s["identity"]["name"]: s for s in found[1:]}}
    if points:
        curves: dict[str, list[dict[str, Any]]] = {}
        for (update, _, _, identity), result in zip(points, curve, strict=True):
            curves.setdefault(identity["name"], []).append({"update": update, **result})
        for name, result in body.get("suites", {}).items():
            curves.setdefault(name, []).append({"update": final, **result})
        body = {**body, "curves": curves}
    return body


def lookup(store: Store, key: str) -> dict[str, Any] | None:
    """The cached result of `key`, only if its entry verifies (a damaged one is never used)."""
    body, _ = entry_problem(store.results.eval_path(key), key)
    return body


def write_result(body: dict[str, Any], out: Path) -> dict[str, str]:
    """An eval step's output: the result with its identity; returns the output's digests."""
    (out / EVAL_RESULT).write_bytes(canonical_bytes(body))
    return {"eval": digest("eval-result", body)}


def record_entry(store: Store, key: str, body: dict[str, Any]) -> None:
    """Seal `body` into the cache under `key`, unless a verifying entry is there already."""
    path = store.results.eval_path(key)
    if lookup(store, key) is None:
        if os.path.lexists(path):
            store.set_aside(path)
        store.replace_file(path, seal_entry(key, body))


@attrs.frozen(kw_only=True)
class StoreResults:
    """A store's evaluation cache as a step sees it (`context.ResultCache`)."""

    store: Store

    def lookup(self, key: str) -> dict[str, Any] | None:
        return lookup(self.store, key)

    def record(self, key: str, body: dict[str, Any]) -> None:
        record_entry(self.store, key, body)


def complete_from_cache(store: Store, step: Step) -> dict[str, str] | None:
    """An evaluation of the same weights, data and suites may already be in the store: no process
    needed when every result is. Called holding the step's lock; a damaged or foreign cache entry
    is set aside, never used."""
    inputs = {name: store.outputs.path(upstream) for name, upstream in step.upstream.items()}
    try:
        key, _ = cache_key(step, inputs["weights"], inputs["data"])
        keys = [key, *(k for k, _ in suite_keys(step, inputs))]
        points = curve_keys(step, inputs)
    except (OSError, ValueError, KeyError):
        return None  # an input's manifest does not verify: the step process says which
    found = []
    for each in [*keys, *(k for _, _, k, _ in points)]:
        cached, problem = entry_problem(store.results.eval_path(each), each)
        if problem is not None:
            store.set_aside(store.results.eval_path(each))
        if cached is None:
            return None
        found.append(cached)
    final = json.loads((inputs["weights"] / RESULT).read_bytes())["steps"] if points else 0
    body = assemble(found[: len(keys)], points, found[len(keys) :], final)
    out = store.new_temp("eval")
    try:
        digests = write_result(body, out)
        for each, cached in zip([*keys, *(k for _, _, k, _ in points)], found, strict=True):
            record_entry(store, each, cached)
        objects.publish(out, store.outputs.path(step.hash), digests)
    finally:
        objects.remove_tree(out)
    return digests
