"""The files of eval suites as data: their formats and bounds, read at plan time (so a malformed
line stops `bt plan`, not the eval step after training) and again by the eval step.

A line of a suite's JSONL is at most `LINE_BYTES` and nests at most `DEPTH` levels; a question
has at most `CHOICES` choices. An `lm_eval` suite's task YAML is plain YAML (no `!function`, no
other tag), holds only the keys of `TASK_KEYS`, reads its data as JSON, and its templates name
no attribute or key starting with '_' (how every escape from Jinja's sandbox begins: the harness
renders them in the sandbox too, `steps/eval/harness.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from buildtrain.config.templates import unsafe_names
from buildtrain.errors import StepFailed

LINE_BYTES = 1 << 20  # one question; the largest of common benchmarks' is under 64 KiB
DEPTH = 16  # nesting of a line's JSON: a question needs 2
CHOICES = 100  # choices of one question (200k took minutes to score); benchmarks use up to ~20
TASK_BYTES = 1 << 20
TASK_KEYS = frozenset(
    {
        "task", "task_alias", "tag", "dataset_path", "dataset_name", "dataset_kwargs", "training_split",
        "validation_split", "test_split", "fewshot_split", "description", "target_delimiter",
        "fewshot_delimiter", "num_fewshot", "output_type", "generation_kwargs", "repeats", "filter_list",
        "should_decontaminate", "doc_to_decontamination_query", "doc_to_text", "doc_to_target",
        "doc_to_choice", "gen_prefix", "metric_list", "metadata",
    }
)  # fmt: skip
TEMPLATE_KEYS = (
    "doc_to_text",
    "doc_to_target",
    "doc_to_choice",
    "gen_prefix",
    "description",
    "doc_to_decontamination_query",
)


def parse_line(line: bytes, where: str, fix: str) -> Any:
    """One JSONL line as JSON, within the bounds above; StepFailed naming the line and the fix."""
    if len(line) > LINE_BYTES:
        raise StepFailed(f"{where}: the line is {len(line)} bytes, more than {LINE_BYTES}; {fix}")
    depth = max(line.count(b"["), line.count(b"{"))
    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise StepFailed(f"{where}: not JSON ({type(exc).__name__}: {str(exc)[:200]}); {fix}") from None
    if depth > DEPTH and _depth(item) > DEPTH:
        raise StepFailed(f"{where}: the JSON nests more than {DEPTH} levels; {fix}")
    if b"\\u" in line:  # only an escape can make a lone surrogate, which no tokenizer encodes
        _check_text(item, where)
    return item


def _check_text(item: Any, where: str) -> None:
    for key, value in item.items() if isinstance(item, dict) else [(None, item)]:
        if not _encodes(value):
            raise StepFailed(
                f"{where}: {key + ': ' if key is not None else ''}a \\u escape in D800-DFFF without its "
                "pair is no text (UTF-8 cannot encode it); write the character or its escaped pair"
            )


def _encodes(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return all(_encodes(v) for v in items)


def _depth(item: Any) -> int:
    level, layer = 0, [item]
    while layer:
        level += 1
        layer = [
            v
            for x in layer
            if isinstance(x, (list, dict))
            for v in (x.values() if isinstance(x, dict) else x)
        ]
    return level - 1


@attrs.frozen(kw_only=True)
class MultipleChoice:
    """One question: a context, its choices, and the index of the right one."""

    context: str
    choices: tuple[str, ...]
    answer: int


def _question(line: bytes, where: str) -> MultipleChoice:
    """A question from one JSONL line; StepFailed naming the line, the key and the fix."""
    fix = 'each line is {"context": "...", "choices": ["...", "..."], "answer": 0}'
    item = parse_line(line, where, fix)
    if not isinstance(item, dict) or set(item) != {"context", "choices", "answer"}:
        keys = sorted(item) if isinstance(item, dict) else type(item).__name__
        raise StepFailed(f"{where}: expected the keys answer, choices, context (got {keys}); {fix}")
    context, choices, answer = item["context"], item["choices"], item["answer"]
    if not isinstance(context, str):
        raise StepFailed(f"{where}: context: expected a string; {fix}")
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise StepFailed(f"{where}: choices: expected two or more non-empty strings; {fix}")
    if len(choices) > CHOICES:
        raise StepFailed(f"{where}: choices: {len(choices)} choices, more than {CHOICES}; split the question")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise StepFailed(f"{where}: answer: expected the index of a choice, 0 to {len(choices) - 1}; {fix}")
    return MultipleChoice(context=context, choices=tuple(choices), answer=answer)


@attrs.frozen(kw_only=True)
class ExactMatch:
    """One question answered by generation: a context and the exact text that should follow."""

    context: str
    target: str


def _target(line: bytes, where: str) -> ExactMatch:
    """An exact-match question from one JSONL line; StepFailed naming the line, the key and the fix."""
    fix = 'each line is {"context": "...", "target": "..."}'
    item = parse_line(line, where, fix)
    if not isinstance(item, dict) or set(item) != {"context", "target"}:
        keys = sorted(item) if isinstance(item, dict) else type(item).__name__
        raise StepFailed(f"{where}: expected the keys context, target (got {keys}); {fix}")
    if not isinstance(item["context"], str):
        raise StepFailed(f"{where}: context: expected a string; {fix}")
    target = item["target"]
    if not isinstance(target, str) or not target or "\n" in target:
        raise StepFailed(
            f"{where}: target: expected a non-empty string without a newline (one ends generation)"
        )
    return ExactMatch(context=item["context"], target=target)


def read_multiple_choice(raw: bytes, path: Path | str) -> list[MultipleChoice]:
    """Every question of a multiple-choice suite file (blank lines are skipped)."""
    return _read(raw, path, _question)


def read_exact_match(raw: bytes, path: Path | str) -> list[ExactMatch]:
    """Every question of an exact-match suite file (blank lines are skipped)."""
    return _read(raw, path, _target)


def _read(raw: bytes, path: Path | str, parse: Callable[[bytes, str], Any]) -> list[Any]:
    questions = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if line.strip():
            questions.append(parse(line, f"{path}:{number}"))
    if not questions:
        raise StepFailed(f"{path}: the suite has no questions; write one JSON object per line")
    return questions


def check_data(raw: bytes, path: Path | str) -> list[tuple[int, dict[str, Any]]]:
    """The records of an lm_eval suite's JSONL data, each with its line: each line a JSON object."""
    records = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if line.strip():
            record = parse_line(line, f"{path}:{number}", "one JSON object per line")
            if not isinstance(record, dict):
                raise StepFailed(f"{path}:{number}: expected a JSON object; one JSON object per line")
            records.append((number, record))
    if not records:
        raise StepFailed(f"{path}: the suite has no records; write one JSON object per line")
    return records


def check_task(raw: bytes, where: str) -> dict[str, Any]:
    """An lm_eval task YAML as a dict, refused (StepFailed naming the file, the key and why) when
    it is more than data: a tag, a key outside `TASK_KEYS`, data that is not JSON, a template
    that names what the sandbox refuses."""
    import yaml

    if len(raw) > TASK_BYTES:
        raise StepFailed(f"{where}: the task YAML is {len(raw)} bytes, more than {TASK_BYTES}")
    try:
        config = yaml.safe_load(raw)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StepFailed(
            f"{where}: not a plain task YAML ({first}); lm_eval suites take no !function"
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise StepFailed(f"{where}: a harness task YAML names its task (task: name)")
    extra = sorted(set(map(str, config)) - TASK_KEYS)
    if extra:
        raise StepFailed(
            f"{where}: {extra[0]}: not a key buildtrain runs (it can name code, a prompt library or another "
            "file); lm_eval suites take the data keys of a task only"
        )
    if config.get("dataset_path", "json") != "json" or set(config.get("dataset_kwargs") or {}) - {
        "data_files"
    }:
        raise StepFailed(
            f"{where}: dataset_path: an lm_eval suite reads its file as json; set dataset_path: json and only dataset_kwargs.data_files"
        )
    for key in TEMPLATE_KEYS:
        names = ", ".join(unsafe_names(config[key])) if isinstance(config.get(key), str) else ""
        if names.startswith("not a Jinja template"):
            raise StepFailed(f"{where}: {key}: {names}")
        if names:
            raise StepFailed(
                f"{where}: {key}: the template names {names}; templates render in Jinja's sandbox, which "
                "refuses names starting with '_' (code, not data); remove them"
            )
    return config
