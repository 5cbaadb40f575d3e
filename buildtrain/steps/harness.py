"""`lm_eval` suites: an lm-evaluation-harness task on local data, run through the harness's Python
API (`simple_evaluate`) with buildtrain's model behind the harness's `LM` interface.

The task YAML and its data are the suite's two sources, checked against the plan: the YAML is
read as plain YAML (a `!function` tag, code, is refused) and its `dataset_kwargs.data_files` is
pointed at a private copy of the data file for the split it evaluates, so the harness reads the
bytes the plan names and nothing else. Nothing is downloaded: the offline switches of
`datasets` and the Hub are set, and the datasets cache lives in the step's work folder (inside
the store), before the harness is imported.

The model answers the harness as buildtrain's own suites score: `loglikelihood` by the token rule
of `suites.py` (so a multiple-choice task gives the numbers of the harness's HF back end on the
`hf/` export), `generate_until` greedily (`generate`), from the context cut from the left so that
it and `max_gen_toks` new tokens fit the model's context, ending at the end-of-document token and
cut at the first of the task's `until` strings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import StepFailed
from buildtrain.steps.suites import Codec, pair_ids, scored_sequence, subset_indices


@attrs.frozen(kw_only=True)
class Scorer:
    """What the harness's LM calls into: the model, its tokenizer and how to run it."""

    model: Any
    codec: Codec
    window: int  # the model's context in tokens
    batch_size: int
    device: Any
    autocast: Any = None


def task_config(raw: bytes, where: str, data: Path) -> dict[str, Any]:
    """The task YAML as a config dict whose evaluated split reads `data`."""
    import yaml

    try:
        config = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise StepFailed(
            f"{where}: not a plain task YAML ({str(exc).splitlines()[0]}); lm_eval suites take no !function"
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise StepFailed(f"{where}: a harness task YAML names its task (task: name)")
    split = config.get("test_split") or config.get("validation_split")
    if not isinstance(split, str):
        raise StepFailed(f"{where}: test_split (or validation_split) names the split the suite's file holds")
    kwargs = dict(config.get("dataset_kwargs") or {})
    config["dataset_kwargs"] = {**kwargs, "data_files": {split: str(data)}}
    return config


def run_task(
    scorer: Scorer, task: bytes, task_where: str, data: bytes, work: Path, subset: float, seed: int
) -> dict[str, Any]:
    """The task's metrics (the harness's names, without their filter suffix) and question count."""
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(work / "datasets-cache"),
        HF_HOME=str(work / "hf-home"),
    )
    copy = work / "suite-data.jsonl"
    copy.write_bytes(data)  # the bytes checked against the plan
    config = task_config(task, task_where, copy)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    count = sum(1 for line in data.splitlines() if line.strip())
    samples = None if subset >= 1.0 else {config["task"]: subset_indices(count, subset, seed)}
    results = simple_evaluate(
        model=harness_lm(scorer),
        tasks=[config],
        task_manager=TaskManager(include_defaults=False),
        samples=samples,
        bootstrap_iters=0,
        log_samples=False,
    )
    scores = results["results"][config["task"]]
    metrics = {
        key.split(",")[0]: value
        for key, value in scores.items()
        if "," in key and "_stderr" not in key and isinstance(value, (int, float))
    }
    return {"task": config["task"], "questions": results["n-samples"][config["task"]]["effective"], **metrics}


def harness_lm(scorer: Scorer) -> Any:
    """An instance of the harness's `LM` answering with `scorer` (the class is made here: the
    harness is imported only by a step that runs one of its tasks)."""
    from lm_eval.api.model import LM

    class BuildtrainLM(LM):
        def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
            return loglikelihood(scorer, [request.args for request in requests])

        def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
            raise StepFailed(
                "lm_eval suites score loglikelihood and generate_until tasks; perplexity tasks are not supported"
            )

        def generate_until(self, requests: list[Any]) -> list[str]:
            return [generate_until(scorer, *request.args) for request in requests]

    return BuildtrainLM()


def loglikelihood(scorer: Scorer, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(log-likelihood, whether greedy decoding gives it) of each (context, continuation)."""
    from buildtrain.steps.choice import scored

    sequences = []
    for context, continuation in pairs:
        before, after = pair_ids(context, continuation, scorer.codec.encode, scorer.codec.end)
        inputs, _ = scored_sequence(before, after, scorer.window)
        sequences.append((inputs, after))
    return scored(scorer.model, sequences, scorer.batch_size, scorer.device, scorer.autocast)


def generate_until(scorer: Scorer, context: str, options: dict[str, Any]) -> str:
    """The greedy continuation of `context`, cut at the first of `options["until"]`."""
    from buildtrain.steps.train.generate import generate

    until = options.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    budget = int(options.get("max_gen_toks", 256))
    if budget >= scorer.window:
        raise StepFailed(
            f"the task asks for {budget} new tokens (max_gen_toks) in a model of {scorer.window}; "
            "set generation_kwargs.max_gen_toks below it in the task YAML"
        )
    codec = scorer.codec
    prompt = (codec.encode(context) or [codec.end])[-(scorer.window - budget) :]
    text = codec.decode(
        generate(scorer.model, prompt, budget, temperature=0.0, top_k=0, seed=0, stop=codec.end)
    )
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text
