"""`lm_eval` suites: an lm-evaluation-harness task on local data, run through the harness's Python
API (`simple_evaluate`) with buildtrain's model behind the harness's `LM` interface.

The task YAML and its data are the suite's two sources, checked against the plan: the YAML is
data (`config/suite_files.check_task`: plain YAML, data keys only, at plan time and here) and its `dataset_kwargs.data_files` is
pointed at a private copy of the data file for the split it evaluates, so the harness reads the
bytes the plan names and nothing else. Nothing is downloaded: the offline switches of
`datasets` and the Hub are set, and the datasets cache lives in the step's work folder (inside
the store), before the harness is imported.

The harness renders `doc_to_text`, `doc_to_choice`, `doc_to_target` and its other templates with
a Jinja environment that is not sandboxed (`lm_eval.utils.env`): a template reaching
`cycler.__init__.__globals__.os` ran commands during `bt run`. Here its `apply_template` is
replaced, before any task is built, by a render in buildtrain's bounded sandbox
(`config/templates.py`, with the harness's own settings and filter), and a probe checks that the
replacement holds: an lm-eval release that renders elsewhere is refused, not trusted.

The model answers the harness as buildtrain's own suites score: `loglikelihood` by the token rule
of `suites.py` (so a multiple-choice task gives the numbers of the harness's HF back end on the
`hf/` export), `generate_until` greedily (`generate`), from the context cut from the left so that
it and `max_gen_toks` new tokens fit the model's context, ending at the end-of-document token and
cut at the first of the task's `until` strings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.config.suite_files import check_task
from buildtrain.config.templates import TemplateRefused, compile_template, render
from buildtrain.errors import BuildtrainError, StepFailed
from buildtrain.steps.eval.overlap import overlap_of, withheld
from buildtrain.steps.eval.suites import Codec, pair_ids, scored_sequence, subset_indices, text_codec
from buildtrain.steps.sources import read_source
from buildtrain.store.layout import DEFAULT_NGRAM

if TYPE_CHECKING:
    from buildtrain.config.steps import EvalStep, SuiteStep
    from buildtrain.steps.eval.step import Loaded
    from buildtrain.steps.sources import Source


@attrs.frozen(kw_only=True)
class Scorer:
    """What the harness's LM calls into: the model, its tokenizer and how to run it."""

    model: Any
    codec: Codec
    window: int  # the model's context in tokens
    batch_size: int
    device: Any
    autocast: Any = None


def score_suite(
    loaded: Loaded,
    config: EvalStep,
    suite: SuiteStep,
    files: list[Source],
    inputs: dict[str, Path],
    work: Path,
) -> dict[str, Any]:
    """An `lm_eval` suite (`config/suites/harness.py`: its data, then its task) run by the harness
    on the subset `config` draws, with its overlap with the training documents (`inputs`: the
    eval step's verified inputs; `work`: a folder for the harness's files)."""
    scorer = Scorer(
        model=loaded.model,
        codec=text_codec(inputs.get("tokenizer")),
        window=config.context,
        batch_size=config.eval.batch_size,
        device=loaded.device,
        autocast=loaded.autocast,
    )
    data, task = files
    rows = read_source(data)
    result = run_task(scorer, read_source(task), str(task.path), rows, work, config.subset, config.seed)
    texts = harness_texts(rows, config.subset, config.seed)
    return withheld(suite, result, overlap_of(texts, texts, inputs, suite.ngram or DEFAULT_NGRAM))


def harness_texts(data: bytes, subset: float, seed: int) -> list[str]:
    """The text of each row of a harness task's data that the harness scores (the same subset),
    every string in the row joined by spaces: what the contamination check reads of it."""
    import json

    def strings(value: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
        return [s for item in items for s in strings(item)]

    rows = [json.loads(line) for line in data.splitlines() if line.strip()]
    chosen = rows if subset >= 1.0 else [rows[i] for i in subset_indices(len(rows), subset, seed)]
    return [" ".join(strings(row)) for row in chosen]


def task_config(raw: bytes, where: str, data: Path) -> dict[str, Any]:
    """The task YAML as a config dict whose evaluated split reads `data`."""
    config = check_task(raw, where)
    split = config.get("test_split") or config.get("validation_split")
    if not isinstance(split, str):
        raise StepFailed(f"{where}: test_split (or validation_split) names the split the suite's file holds")
    kwargs = dict(config.get("dataset_kwargs") or {})
    config["dataset_kwargs"] = {**kwargs, "data_files": {split: str(data)}}
    return config


PROBE = "{{ cycler.__init__.__globals__ }}"  # what the sandbox refuses and lm-eval's own env renders


def sandbox_templates(where: str) -> None:
    """Make the harness render every task template in the bounded sandbox; StepFailed when an
    lm-eval release does not take the replacement (nothing of the task has run then)."""
    from lm_eval import utils

    compiled: dict[str, Any] = {}

    def apply_template(template: str, doc: dict[str, Any]) -> str:
        if template not in compiled:
            filters = {"regex_replace": utils.regex_replace}
            compiled[template] = compile_template(
                template, filters, undefined=_strict(), keep_trailing_newline=True
            )
        return render(compiled[template], doc)

    utils.apply_template = apply_template
    try:
        utils.apply_template(PROBE, {})
    except TemplateRefused:
        return
    raise StepFailed(
        f"{where}: this lm-eval release renders templates outside the sandbox; use lm-eval 0.4.x"
    )


def _strict() -> Any:
    from jinja2 import StrictUndefined

    return StrictUndefined


def load_tasks(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The harness's task objects for `config`, its dataset loaded: a failure names the task
    file and the reason (a dataset that does not load is no disk problem)."""
    from lm_eval.tasks import TaskManager

    try:  # {task name: task}; the harness's `get_task_dict` is deprecated for `load` since 0.4.13
        return TaskManager(include_defaults=False).load([config])["tasks"]
    except BuildtrainError:
        raise
    except TemplateRefused as exc:
        raise StepFailed(f"{where}: a template of the task: {exc}") from None
    except Exception as exc:  # the harness's and datasets' own errors, one line each
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise StepFailed(
            f"{where}: the harness cannot load the task or its data ({type(exc).__name__}: {reason}); "
            "check the task YAML against the suite's file"
        ) from None


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
    sandbox_templates(task_where)
    tasks = load_tasks(config, task_where)
    from lm_eval import simple_evaluate

    count = sum(1 for line in data.splitlines() if line.strip())
    samples = None if subset >= 1.0 else {config["task"]: subset_indices(count, subset, seed)}
    try:
        results = simple_evaluate(
            model=harness_lm(scorer),
            tasks=list(tasks.values()),
            samples=samples,
            bootstrap_iters=0,
            log_samples=False,
        )
    except TemplateRefused as exc:
        raise StepFailed(f"{task_where}: a template of the task: {exc}") from None
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
    from buildtrain.steps.eval.choice import scored

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
