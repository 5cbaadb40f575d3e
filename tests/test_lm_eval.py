"""A multiple-choice suite scored by buildtrain equals lm-evaluation-harness's own computation
through its HF back end on the plan's `hf/` export: the same accuracy (within 1e-6) and the same
log-likelihood for every choice, with the byte tokenizer and with a trained BPE (whose merges
across the context/choice boundary are the whole text's on both sides). Offline: the task is a
local JSONL file with a task YAML shipped beside it (tests/suites/)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, plan_hash
from test_tokenizer import bpe_preset

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # the harness's HF back end needs it

SUITES = REPO / "tests" / "suites"


def harness(hf: Path, folder: Path, task: str) -> dict:
    """lm-eval's result for `task` (its YAML and data in `folder`) on the export in `hf`."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "harness.py"), str(hf), str(folder), task],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def buildtrain_scores(store: Path, plan: str, package: Path, suite: Path) -> list[list[float]]:
    """buildtrain's scorer on the export package: each choice's log-likelihood."""
    import torch

    from buildtrain.config.suite_files import read_multiple_choice
    from buildtrain.plan.stored import load_plan
    from buildtrain.steps.eval.choice import choice_loglikelihoods
    from buildtrain.steps.eval.suites import text_codec
    from buildtrain.steps.sample import package_model
    from buildtrain.store.store import Store

    loaded = load_plan(Store(store), plan)
    tokenizers = [s for s in loaded.steps if s.kind == "tokenizer"]
    codec = text_codec(Store(store).outputs.path(tokenizers[0].hash) if tokenizers else None)
    hf_config = json.loads((package / "hf" / "config.json").read_bytes())
    model = package_model(package, hf_config["vocab_size"])
    questions = read_multiple_choice(suite.read_bytes(), suite)
    window = hf_config["max_position_embeddings"]
    return choice_loglikelihoods(model, questions, codec.encode, codec.end, window, 4, torch.device("cpu"))


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_accuracy_equals_the_harness_hf_back_end_on_the_export(bt, tmp_path, store, tokenizer):
    name = {"bytes": "arithmetic", "bpe": "words"}[tokenizer]
    root = tmp_path / "preset"
    root.mkdir()
    base = (
        bpe_preset(root)
        if tokenizer == "bpe"
        else shutil.copy(REPO / "tests" / "presets" / "micro.toml", root)
    )
    shutil.copyfile(SUITES / f"{name}.jsonl", root / f"{name}.jsonl")
    preset = root / "bench.toml"
    preset.write_text(
        f'extends = "{Path(base).name}"\n[eval]\nsuites = [{{ name = "{name}", file = "{name}.jsonl" }}]\n'
    )
    plan = plan_hash(bt("plan", str(preset)))
    built = bt("run", plan)
    assert built.returncode == 0, built.stderr
    assert bt("export", plan, str(tmp_path / "package")).returncode == 0
    (row,) = json.loads(bt("ls", "--metrics", "--json").stdout)
    ours = row["suites"][name]

    task = tmp_path / "task"
    task.mkdir()
    shutil.copyfile(SUITES / f"{name}.jsonl", task / f"{name}.jsonl")
    shutil.copyfile(SUITES / f"{name}_mc.yaml", task / f"{name}_mc.yaml")
    theirs = harness(tmp_path / "package" / "hf", task, f"bt_{name}_mc")
    assert abs(ours["accuracy"] - theirs["acc"]) <= 1e-6
    assert abs(ours["acc_norm"] - theirs["acc_norm"]) <= 1e-6
    assert list((task / "datasets-cache").iterdir())  # the harness's datasets cache stayed in tmp_path

    scores = buildtrain_scores(store, plan, tmp_path / "package", SUITES / f"{name}.jsonl")
    assert len(scores) == len(theirs["loglikelihoods"])
    for mine, harnessed in zip(scores, theirs["loglikelihoods"], strict=True):
        assert mine == pytest.approx(harnessed, abs=1e-4)


def test_an_lm_eval_suite_runs_a_harness_task_on_buildtrains_model(bt, tmp_path):
    """The harness's own tasks (a multiple-choice one and a generate_until one) through
    `simple_evaluate` with buildtrain's model behind its LM interface: the multiple-choice task
    gives buildtrain's own multiple_choice numbers, the generation task finds exactly the answers
    planted from transformers' greedy generate, as the harness's HF back end does."""
    from test_suites import hf_continuations, suite_preset

    for name in ("arithmetic.jsonl", "arithmetic_mc.yaml", "sums.jsonl", "sums_gen.yaml"):
        shutil.copyfile(SUITES / name, tmp_path / name)
    trained = "[train]\nsteps = 600\n"  # long enough for the micro model to end its answers
    suites = (
        '{ name = "mc", file = "arithmetic.jsonl" }, '
        '{ name = "harness-mc", kind = "lm_eval", task = "arithmetic_mc.yaml", file = "arithmetic.jsonl" }'
    )
    first = suite_preset(tmp_path, suites, "first.toml", trained)
    assert bt("run", str(first)).returncode == 0
    assert bt("export", str(first), str(tmp_path / "package")).returncode == 0
    (row,) = json.loads(bt("ls", "--metrics", "--json").stdout)
    assert row["suites"]["harness-mc"]["accuracy"] == pytest.approx(row["suites"]["mc"]["accuracy"], abs=1e-6)
    assert row["suites"]["harness-mc"]["acc_norm"] == pytest.approx(row["suites"]["mc"]["acc_norm"], abs=1e-6)

    contexts = [json.loads(line)["context"] for line in (tmp_path / "sums.jsonl").read_text().splitlines()]
    generated = hf_continuations(tmp_path / "package" / "hf", contexts, tokens=8)
    planted = [(c, g) for c, g in zip(contexts, generated, strict=True) if g][:6]
    assert planted, f"the model ends no answer: {generated}"
    questions = [{"context": c, "target": g} for c, g in planted] + [
        {"context": c, "target": g + "0x"} for c, g in planted
    ]
    (tmp_path / "planted.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    gen = '{ name = "harness-gen", kind = "lm_eval", task = "sums_gen.yaml", file = "planted.jsonl" }'
    second = suite_preset(tmp_path, gen, "second.toml", trained)
    built = bt("run", str(second))
    assert built.returncode == 0, built.stderr
    rows = {r["hash"]: r for r in json.loads(bt("ls", "--metrics", "--json").stdout)}
    ours = rows[plan_hash(bt("plan", str(second)))]["suites"]["harness-gen"]
    assert ours == {"accuracy": 0.5, "acc_norm": None, "questions": len(questions), "overlap": 0}

    task = tmp_path / "task"  # the harness's HF back end on the same task and data
    task.mkdir()
    shutil.copyfile(SUITES / "sums_gen.yaml", task / "sums_gen.yaml")
    shutil.copyfile(tmp_path / "planted.jsonl", task / "sums.jsonl")
    assert harness(tmp_path / "package" / "hf", task, "bt_sums_gen")["exact_match"] == 0.5


# -- task files are data, never code (issue 45, R3) -------------------------------------------

EXPLOIT = "{{{{ cycler.__init__.__globals__.os.system('id > {out}') }}}}{{{{context}}}}"
# The same escape with no '_' name written out: only the sandbox, at render time, can refuse it.
SPELLED = "{{{{ cycler['_' ~ '_init__']['_' ~ '_globals__']['os'].system('id > {out}') }}}}{{{{context}}}}"


def hostile_task(folder: Path, template: str) -> Path:
    text = (
        (SUITES / "arithmetic_mc.yaml")
        .read_text()
        .replace('doc_to_text: "{{context}}"', "doc_to_text: PLACE")
    )
    path = folder / "hostile.yaml"
    path.write_text(text.replace("PLACE", json.dumps(template.format(out=folder / "PWNED"))))
    return path


def test_a_task_template_that_reaches_code_is_refused_at_plan_time(bt, tmp_path):
    from test_suites import suite_preset

    task = hostile_task(tmp_path, EXPLOIT)
    suites = f'{{ name = "h", kind = "lm_eval", task = "{task.name}", file = "arithmetic.jsonl" }}'
    result = bt("plan", str(suite_preset(tmp_path, suites)))
    assert result.returncode == 2, result.stderr  # ExitCode.USAGE: nothing was run
    problems = [line for line in result.stderr.splitlines() if not line.startswith("bt plan:")]  # + a summary
    assert "Traceback" not in result.stderr and len(problems) == 1, result.stderr
    assert "hostile.yaml: doc_to_text: the template names" in result.stderr and "__globals__" in result.stderr
    assert not (tmp_path / "PWNED").exists()


def test_the_harness_renders_task_templates_in_the_sandbox(bt, tmp_path):
    """An escape the plan-time check cannot see runs nothing under `bt run`: the harness's
    templates render in buildtrain's sandbox, and the step fails with one line. (In doc_to_text
    the plan renders it on each record, in the same sandbox, and refuses it; `gen_prefix` is
    rendered by the harness only.)"""
    from test_suites import suite_preset

    task = hostile_task(tmp_path, SPELLED)
    suites = f'{{ name = "h", kind = "lm_eval", task = "{task.name}", file = "arithmetic.jsonl" }}'
    planned = bt("plan", str(suite_preset(tmp_path, suites)))
    assert planned.returncode == 2 and "arithmetic.jsonl:1: doc_to_text: SecurityError" in planned.stderr
    text = task.read_text().replace("doc_to_text: ", 'doc_to_text: "{{context}}"\ngen_prefix: ')
    task.write_text(text)
    result = bt("run", str(suite_preset(tmp_path, suites)))
    assert result.returncode == 1, result.stderr  # ExitCode.FAILED
    assert "Traceback" not in result.stderr, result.stderr
    assert "hostile.yaml: a template of the task: SecurityError" in result.stderr, result.stderr
    assert not (tmp_path / "PWNED").exists()


def test_the_sandboxed_harness_renders_honest_templates_as_lm_eval_does():
    from lm_eval import utils

    from buildtrain.steps.eval.harness import sandbox_templates

    theirs = utils.apply_template
    doc = {"context": "1 + 1 =", "choices": [" 2", " 3"], "answer": 0}
    templates = ["{{context}}", "{{choices}}", "{{answer}}\n", "{{ context | regex_replace('1', 'one') }}"]
    expected = [theirs(t, doc) for t in templates]
    sandbox_templates("task.yaml")
    assert [utils.apply_template(t, doc) for t in templates] == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("task: t\ndoc_to_text: !function utils.f\n", "not a plain task YAML"),
        ("task: t\nclass: !!python/name:os.system\n", "not a plain task YAML"),
        ("task: t\ninclude: other.yaml\n", "include: not a key buildtrain runs"),
        ("task: t\nuse_prompt: promptsource:x\n", "use_prompt: not a key"),
        ("task: t\ndataset_path: ./folder\n", "dataset_path: an lm_eval suite reads its file as json"),
        ("task: t\ndoc_to_choice: \"{{ x['__class__'] }}\"\n", "doc_to_choice: the template names __class__"),
        ("[" * 100000, "not a plain task YAML"),
    ],
    ids=["function", "python-tag", "include", "use_prompt", "dataset_path", "dunder", "nested"],
)
def test_a_task_yaml_is_data(text, fragment):
    from buildtrain.config.suite_files import check_task
    from buildtrain.errors import StepFailed

    with pytest.raises(StepFailed) as raised:
        check_task(text.encode(), "task.yaml")
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_a_dataset_that_does_not_load_is_named_as_such(tmp_path):
    """R14: a dataset that fails to load is the task's problem, not a full disk."""
    from buildtrain.errors import StepFailed
    from buildtrain.steps.eval.harness import load_tasks, task_config

    config = task_config((SUITES / "sums_gen.yaml").read_bytes(), "sums_gen.yaml", tmp_path / "missing.jsonl")
    with pytest.raises(StepFailed) as raised:
        load_tasks(config, "sums_gen.yaml")
    message = str(raised.value)
    assert (
        "sums_gen.yaml: the harness cannot load the task or its data" in message
        and "free space" not in message
    )
