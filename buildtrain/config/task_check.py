"""An `lm_eval` suite's task read against its data at plan time, as the harness will read them, so
that a task the harness cannot run stops `bt plan` (naming the file, the line and the key), not
the eval step after training.

What the harness does with a task is mirrored here without importing it (`bt plan` imports no
heavy dependency): the split the file holds, the output type, the metric entries, the generation
budget against the model's context, and each record through the task's templates (rendered in
the same bounded sandbox the eval step renders them in, `config/templates.py`), with a
multiple-choice record's choices and gold answer. Not mirrored: the harness's metric registry
(a metric name it lacks fails at run time).
"""

from __future__ import annotations

import ast
import re
from typing import Any

from buildtrain.errors import StepFailed

OUTPUT_TYPES = ("loglikelihood", "multiple_choice", "generate_until")  # the harness's, less rolling
DEFAULT_OUTPUT_TYPE = "generate_until"  # the harness's TaskConfig default
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
DEFAULT_MAX_GEN_TOKS = 256  # the harness's (and `steps/eval/harness.generate_until`'s) default budget


def check_task_data(
    config: dict[str, Any], where: str, records: list[tuple[int, dict[str, Any]]], data: str, context: int
) -> None:
    """StepFailed naming the task file (`where`) or the data file's line (`data:N`) and the key
    when the harness could not run `config` on `records` ((line, object) of the data file) in a
    model of `context` tokens."""
    _check_settings(config, where, context)
    features = list(dict.fromkeys(key for _, record in records for key in record))
    templates = _templates(config, where, features)
    output_type = config.get("output_type") or DEFAULT_OUTPUT_TYPE
    for line, record in records:
        # The harness's dataset gives every record every column (None where a line lacks it).
        doc = {key: record.get(key) for key in features}
        rendered = {key: _value(key, value, doc, f"{data}:{line}") for key, value in templates.items()}
        if output_type == "multiple_choice":
            _check_choice(rendered, f"{data}:{line}")


def _check_splits(config: dict[str, Any], where: str) -> None:
    """The file holds one split (`steps/eval/harness.task_config`); the harness reads every split the
    task names, few-shot ones while it builds the task, so any other is missing there."""
    split = config.get("test_split") or config.get("validation_split")
    if not isinstance(split, str):
        raise StepFailed(
            f"{where}: test_split: missing; name the split the suite's file holds (test_split: test)"
        )
    for key in SPLIT_KEYS:
        if config.get(key) is not None and config[key] != split:
            raise StepFailed(
                f"{where}: {key}: {config[key]!r} is no split of the suite's file, which holds {split!r} "
                "only; remove it (few-shot examples then come from that split)"
            )
    shots = config.get("num_fewshot")
    if shots is not None and (isinstance(shots, bool) or not isinstance(shots, int) or shots < 0):
        raise StepFailed(f"{where}: num_fewshot: expected a whole number >= 0")


def _check_settings(config: dict[str, Any], where: str, context: int) -> None:
    _check_splits(config, where)
    output_type = config.get("output_type") or DEFAULT_OUTPUT_TYPE
    if output_type == "loglikelihood_rolling":
        raise StepFailed(
            f"{where}: output_type: loglikelihood_rolling (perplexity) is not supported; use "
            f"{', '.join(OUTPUT_TYPES)}"
        )
    if output_type not in OUTPUT_TYPES:
        raise StepFailed(f"{where}: output_type: {output_type!r} is none of {', '.join(OUTPUT_TYPES)}")
    if output_type == "multiple_choice" and config.get("doc_to_choice") is None:
        raise StepFailed(f"{where}: doc_to_choice: a multiple_choice task names its choices (doc_to_choice)")
    metrics = config.get("metric_list")
    if metrics is not None and (
        not isinstance(metrics, list)
        or not all(isinstance(m, dict) and isinstance(m.get("metric"), str) for m in metrics)
    ):
        raise StepFailed(
            f"{where}: metric_list: expected a list of entries each naming its metric (- metric: acc)"
        )
    if output_type == "generate_until":
        _check_generation(config.get("generation_kwargs"), where, context)


def _check_generation(kwargs: Any, where: str, context: int) -> None:
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise StepFailed(f"{where}: generation_kwargs: expected a mapping (until: [...], max_gen_toks: N)")
    budget = kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise StepFailed(f"{where}: generation_kwargs.max_gen_toks: expected a positive integer")
    if context and budget >= context:
        raise StepFailed(
            f"{where}: generation_kwargs.max_gen_toks: {budget} new tokens do not fit the model's "
            f"context of {context}; set it below {context}"
        )
    until = kwargs.get("until", [])
    if not isinstance(until, (str, list)) or not all(
        isinstance(u, str) for u in ([until] if isinstance(until, str) else until)
    ):
        raise StepFailed(f"{where}: generation_kwargs.until: expected a string or a list of strings")


TEMPLATE_FIELDS = ("doc_to_text", "doc_to_target", "doc_to_choice")


def _templates(config: dict[str, Any], where: str, features: list[str]) -> dict[str, Any]:
    """Each of `TEMPLATE_FIELDS` the task sets: a column name as it is, a template compiled as
    the eval step compiles it, a literal (an index, a list of choices) as it is."""
    from buildtrain.config.templates import TemplateRefused, compile_template

    found: dict[str, Any] = {}
    for key in TEMPLATE_FIELDS:
        value = config.get(key)
        if value is None or (key == "doc_to_choice" and isinstance(value, (list, dict))):
            found[key] = value
        elif isinstance(value, str):
            if value in features:
                found[key] = ("column", value)
                continue
            try:
                found[key] = compile_template(value, FILTERS, undefined=_strict(), keep_trailing_newline=True)
            except TemplateRefused as exc:
                raise StepFailed(f"{where}: {key}: {exc}") from None
        elif isinstance(value, int) and not isinstance(value, bool) and key != "doc_to_choice":
            found[key] = value  # a fixed index (several contexts: doc_to_text)
        elif isinstance(value, list) and key == "doc_to_target":
            found[key] = value  # fixed gold indices
        else:
            raise StepFailed(
                f"{where}: {key}: expected a template, a column name or a literal (got {type(value).__name__})"
            )
    return found


def _regex_replace(string: str, pattern: str, repl: str, count: int = 0) -> str:
    return re.sub(pattern, repl, string, count=count)  # the harness's filter (`lm_eval.utils`)


FILTERS = {"regex_replace": _regex_replace}


def _strict() -> Any:
    from jinja2 import StrictUndefined

    return StrictUndefined


def _value(key: str, template: Any, doc: dict[str, Any], where: str) -> Any:
    """What the harness makes of `key` for `doc` (`ConfigurableTask.doc_to_*` in lm-eval 0.4)."""
    from buildtrain.config.templates import TemplateRefused, render

    if template is None or isinstance(template, (int, list, dict)):
        return template
    if isinstance(template, tuple):  # a column
        return doc[template[1]]
    try:
        text = render(template, doc)
    except TemplateRefused as exc:
        raise StepFailed(f"{where}: {key}: {exc}") from None
    if key == "doc_to_choice":
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            raise StepFailed(
                f"{where}: doc_to_choice: renders {text[:60]!r}, not a list of choices"
            ) from None
    return text  # digits stay text here: `_gold` reads them as the harness does


def _check_choice(rendered: dict[str, Any], where: str) -> None:
    """A multiple-choice record's choices are strings, and its gold answer is one of them."""
    choices = rendered["doc_to_choice"]
    if isinstance(choices, dict):
        choices = list(choices.values())
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise StepFailed(f"{where}: doc_to_choice: expected a list of strings (got {_shown(choices)})")
    if isinstance(rendered.get("doc_to_text"), list) or (
        isinstance(rendered.get("doc_to_text"), str) and rendered["doc_to_text"].isdigit()
    ):
        return  # several contexts, one continuation (winogrande's shape): the harness checks it
    gold = _gold(rendered.get("doc_to_target"))
    golds = gold if isinstance(gold, list) else [gold]
    for each in golds:
        if isinstance(each, bool) or (isinstance(each, int) and not 0 <= each < len(choices)):
            raise StepFailed(
                f"{where}: doc_to_target: answer {each!r} is not the index of a choice, 0 to {len(choices) - 1}"
            )
        if isinstance(each, str) and each not in choices:
            raise StepFailed(
                f"{where}: doc_to_target: {each[:60]!r} is neither an index nor one of the choices"
            )
        if not isinstance(each, (int, str)):
            raise StepFailed(f"{where}: doc_to_target: expected an index or a choice (got {_shown(each)})")


def _gold(target: Any) -> Any:
    """The harness's reading of a multiple-choice target: digits are an index, '[..]' a list."""
    if isinstance(target, str):
        if target.isdigit():
            return int(target)
        if len(target) >= 2 and target[0] == "[" and target[-1] == "]":
            try:
                return ast.literal_eval(target)
            except (ValueError, SyntaxError, RecursionError, MemoryError):
                return target
    return target


def _shown(value: Any) -> str:
    text = repr(value)
    return text[:60] + ("..." if len(text) > 60 else "")
