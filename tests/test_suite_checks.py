"""Suite files are checked at `bt plan`, as the eval step will read them (issue 46, item 3): a
malformed line, a missing or mistyped key, an answer out of range, an empty file, and an lm_eval
task the harness could not run on its data each stop the plan with one line naming the file, the
line and the key (exit 2), before anything is trained."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import REPO
from test_suites import suite_preset

from buildtrain.config.suite_files import check_data, check_task
from buildtrain.config.task_check import check_task_data
from buildtrain.errors import ExitCode

SUITES = REPO / "tests" / "suites"
MC = '{"context": "1+1=", "choices": ["2", "3"], "answer": 0}'


def planned(bt, folder: Path, suites: str):
    result = bt("plan", str(suite_preset(folder, suites)))
    problems = [line for line in result.stderr.splitlines() if not line.startswith("bt plan:")]
    return result, problems


@pytest.mark.parametrize(
    ("kind", "lines", "expected"),
    [
        ("multiple_choice", ["{not json"], "q.jsonl:2: not JSON"),
        ("multiple_choice", ['{"context": "1+1=", "choices": ["2", "3"]}'], "q.jsonl:2: expected the keys answer"),
        ("multiple_choice", ['{"context": 7, "choices": ["2", "3"], "answer": 0}'], "q.jsonl:2: context: expected a string"),
        ("multiple_choice", ['{"context": "1+1=", "choices": ["2", "3"], "answer": 2}'], "q.jsonl:2: answer: expected the index of a choice, 0 to 1"),
        ("multiple_choice", ['{"context": "1+1=\\ud800", "choices": ["2", "3"], "answer": 0}'], "q.jsonl:2: context: a \\u escape in D800-DFFF"),
        ("exact_match", ['{"context": "1+1="}'], "q.jsonl:2: expected the keys context, target"),
        ("exact_match", ['{"context": "1+1=", "target": 2}'], "q.jsonl:2: target: expected a non-empty string"),
        ("exact_match", ['{"context": "1+1=", "target": "\\udc00"}'], "q.jsonl:2: target: a \\u escape"),
        ("exact_match", None, "q.jsonl: the suite has no questions"),
    ],
    ids=["json", "missing-answer", "wrong-type", "answer-range", "surrogate", "missing-target", "target-type", "em-surrogate", "empty"],
)  # fmt: skip
def test_a_bad_suite_file_stops_the_plan_naming_file_line_and_key(bt, tmp_path, kind, lines, expected):
    first = MC if kind == "multiple_choice" else '{"context": "1+1=", "target": "2"}'
    body = "\n\n" if lines is None else "\n".join([first, *lines]) + "\n"
    (tmp_path / "q.jsonl").write_text(body)
    result, problems = planned(bt, tmp_path, f'{{ name = "q", kind = "{kind}", file = "q.jsonl" }}')
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "Traceback" not in result.stderr and len(problems) == 1, result.stderr
    assert "bench.toml: eval.suites[0]: " in problems[0] and expected in problems[0], problems[0]


def task_with(folder: Path, base: str, data: str, edit: dict[str, object], drop: tuple[str, ...] = ()) -> str:
    """A shipped task YAML with `edit` applied (a key set to None is removed), reading `data`."""
    import yaml

    task = yaml.safe_load((SUITES / base).read_text())
    task.update(edit)
    for key in drop:
        task.pop(key)
    (folder / "t.yaml").write_text(yaml.safe_dump(task))
    if not (folder / data).exists():
        shutil.copyfile(SUITES / data, folder / data)
    return f'{{ name = "t", kind = "lm_eval", task = "t.yaml", file = "{data}" }}'


MCQ, GEN = ("arithmetic_mc.yaml", "arithmetic.jsonl"), ("sums_gen.yaml", "sums.jsonl")


@pytest.mark.parametrize(
    ("task", "edit", "drop", "expected"),
    [
        (MCQ, {}, ("test_split",), "t.yaml: test_split: missing"),
        (MCQ, {"validation_split": "validation"}, (), "t.yaml: validation_split: 'validation' is no split of the suite's file, which holds 'test' only"),
        (MCQ, {"fewshot_split": "train", "num_fewshot": 2}, (), "t.yaml: fewshot_split: 'train' is no split"),
        (MCQ, {"num_fewshot": -1}, (), "t.yaml: num_fewshot: expected a whole number >= 0"),
        (MCQ, {"output_type": "loglikelihood_rolling"}, (), "t.yaml: output_type: loglikelihood_rolling (perplexity) is not supported"),
        (MCQ, {"output_type": "mc"}, (), "t.yaml: output_type: 'mc' is none of"),
        (MCQ, {}, ("doc_to_choice",), "t.yaml: doc_to_choice: a multiple_choice task names its choices"),
        (MCQ, {"doc_to_text": "{{contxt}}"}, (), "arithmetic.jsonl:1: doc_to_text: UndefinedError: 'contxt' is undefined"),
        (MCQ, {"doc_to_text": "{{context"}, (), "t.yaml: doc_to_text: not a Jinja template"),
        (MCQ, {"doc_to_choice": "{{context}}"}, (), "arithmetic.jsonl:1: doc_to_choice: renders '206+75=', not a list"),
        (MCQ, {"doc_to_target": "{{answer + 3}}"}, (), "arithmetic.jsonl:1: doc_to_target: answer 5 is not the index of a choice, 0 to 2"),
        (MCQ, {"doc_to_target": "{{context}}"}, (), "arithmetic.jsonl:1: doc_to_target: '206+75=' is neither an index nor one of the choices"),
        (MCQ, {"metric_list": ["acc"]}, (), "t.yaml: metric_list: expected a list of entries"),
        (GEN, {"generation_kwargs": {"until": ["\n"], "max_gen_toks": 32}}, (), "t.yaml: generation_kwargs.max_gen_toks: 32 new tokens do not fit the model's context of 32"),
        (GEN, {"generation_kwargs": {"until": 5, "max_gen_toks": 8}}, (), "t.yaml: generation_kwargs.until: expected a string"),
        (GEN, {"doc_to_target": "{{answer}}"}, (), "sums.jsonl:1: doc_to_target: UndefinedError: 'answer' is undefined"),
    ],
    ids=["split", "other-split", "fewshot-split", "shots", "rolling", "output-type", "no-choices", "missing-key", "syntax", "choices-not-list", "gold-range", "gold-not-a-choice", "metric-list", "max-gen-toks", "until", "gen-missing-key"],
)  # fmt: skip
def test_an_lm_eval_task_the_harness_could_not_run_stops_the_plan(bt, tmp_path, task, edit, drop, expected):
    result, problems = planned(bt, tmp_path, task_with(tmp_path, *task, edit, drop))
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "Traceback" not in result.stderr and len(problems) == 1, result.stderr
    assert "bench.toml: eval.suites[0]: " in problems[0] and expected in problems[0], problems[0]


def test_a_record_lacking_a_column_others_have_renders_none_as_the_harness_does():
    """The harness's dataset gives every record every column (None where a line lacks it), so a
    template naming a column only some lines have renders 'None' there: no error, as there."""
    raw = b'{"context": "a", "target": "b", "note": "x"}\n{"context": "c", "target": "d"}\n'
    task = check_task((SUITES / "sums_gen.yaml").read_bytes(), "sums_gen.yaml")
    check_task_data(
        {**task, "doc_to_text": "{{context}}{{note}}"}, "t.yaml", check_data(raw, "d.jsonl"), "d.jsonl", 64
    )


@pytest.mark.parametrize(("base", "data"), [MCQ, GEN, ("words_mc.yaml", "words.jsonl")])
def test_the_shipped_tasks_pass_on_their_data(base, data):
    task = check_task((SUITES / base).read_bytes(), base)
    records = check_data((SUITES / data).read_bytes(), data)
    check_task_data(task, base, records, data, 64)  # raises StepFailed naming what is wrong


@pytest.mark.parametrize(
    "edit",
    [{}, {"validation_split": "validation"}, {"training_split": "train"}, {"fewshot_split": "train", "num_fewshot": 1}, {"output_type": "mc"}],
    ids=["shipped", "validation", "training", "fewshot", "output-type"],
)  # fmt: skip
def test_the_plan_refuses_a_task_exactly_when_the_harness_cannot_build_it(tmp_path, monkeypatch, edit):
    """The plan-time check against lm-eval itself (its TaskManager, on the suite's file)."""
    pytest.importorskip("lm_eval")
    import yaml

    from buildtrain.errors import StepFailed
    from buildtrain.steps.eval.harness import load_tasks, task_config

    for name, value in {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": tmp_path / "hf",
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    raw = yaml.safe_dump({**yaml.safe_load((SUITES / MCQ[0]).read_text()), **edit}).encode()
    data = SUITES / MCQ[1]
    try:
        check_task_data(
            check_task(raw, "t.yaml"), "t.yaml", check_data(data.read_bytes(), data), str(data), 64
        )
        refused = False
    except StepFailed:
        refused = True
    try:
        load_tasks(task_config(raw, "t.yaml", data), "t.yaml")
        failed = False
    except StepFailed:
        failed = True
    assert refused == failed == bool(edit)
