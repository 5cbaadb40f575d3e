"""Benchmark suites (`[eval] suites`): read by content, scored, cached by what determines them,
listed by `bt ls --metrics`; the laws of the subset and of the token pairs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import MICRO, REPO, actions, plan_hash, summaries
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.config.suite_files import MultipleChoice, read_multiple_choice
from buildtrain.errors import ExitCode, StepFailed
from buildtrain.steps.eval.suites import accuracy, pair_ids, subset_indices, text_codec

ARITHMETIC = REPO / "tests" / "suites" / "arithmetic.jsonl"
ARITH = '{ name = "arith", file = "arithmetic.jsonl" }'


def suite_preset(folder: Path, suites: str, name: str = "bench.toml", extra: str = "") -> Path:
    """The micro preset with these `[eval] suites`; the arithmetic suite beside it."""
    if not (folder / "arithmetic.jsonl").exists():
        shutil.copyfile(ARITHMETIC, folder / "arithmetic.jsonl")
    path = folder / name
    path.write_text(f'extends = "{MICRO}"\n\n[eval]\nsuites = [{suites}]\n{extra}')
    return path


def metrics(bt) -> list[dict]:
    listed = bt("ls", "--metrics", "--json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)


# -- end to end -------------------------------------------------------------------------------


def test_a_suite_is_scored_listed_and_never_evaluated_twice(bt, tmp_path):
    shutil.copyfile(ARITHMETIC, tmp_path / "copy.jsonl")
    both = suite_preset(tmp_path, f'{ARITH}, {{ name = "again", file = "copy.jsonl" }}', "both.toml")
    built = bt("run", str(both))
    assert built.returncode == 0, built.stderr
    (row,) = metrics(bt)
    assert set(row["suites"]) == {"arith", "again"}
    arith = row["suites"]["arith"]
    assert arith["questions"] == 24 and 0.0 <= arith["accuracy"] <= 1.0
    assert row["suites"]["again"] == arith  # the same questions on the same weights
    assert arith["overlap"] == 0  # the synthetic corpus holds no question with its answer
    table = bt("ls", "--metrics").stdout
    assert "acc:arith" in table and "acc:again" in table

    # Another plan asks for one of those suites on the same weights: its eval step is completed
    # from the evaluation cache, without a process (no model is loaded).
    one = suite_preset(tmp_path, ARITH, "one.toml")
    again = bt("run", str(one))
    assert again.returncode == 0, again.stderr
    assert actions(summaries(tmp_path / "experiments")[-1])["eval"] == "cached"
    assert "same weights evaluated before" in again.stderr
    rows = {r["hash"]: r for r in metrics(bt)}
    assert rows[plan_hash(bt("plan", str(one)))]["suites"] == {"arith": arith}

    null = bt("run", str(one))  # and a second run of a plan is a null build
    assert null.returncode == 0 and set(actions(summaries(tmp_path / "experiments")[-1]).values()) == {
        "cached"
    }
    # which still ends with the suite's score and overlap, read from the store
    assert f"suites of eval:\n  arith  accuracy {arith['accuracy']:.4f}" in null.stderr, null.stderr
    assert "; overlap 0/24 (0.0%), 13-grams" in null.stderr


def test_gc_keeps_and_fsck_checks_every_suite_entry(bt, tmp_path, store):
    preset = suite_preset(tmp_path, ARITH)
    assert bt("run", str(preset)).returncode == 0
    entries = sorted((store / "evals").iterdir())
    assert len(entries) == 2  # the held-out result and the suite's
    assert bt("gc").returncode == 0
    assert sorted((store / "evals").iterdir()) == entries
    assert bt("fsck").returncode == 0


def test_a_suite_enters_the_plan_by_content_not_by_path(bt, tmp_path):
    first = plan_hash(bt("plan", str(suite_preset(tmp_path, ARITH))))
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copyfile(ARITHMETIC, moved / "renamed.jsonl")
    renamed = '{ name = "arith", file = "elsewhere/renamed.jsonl" }'
    assert plan_hash(bt("plan", str(suite_preset(tmp_path, renamed, "moved.toml")))) == first
    with (moved / "renamed.jsonl").open("a") as handle:
        handle.write('{"context": "1+1=", "choices": ["2", "3"], "answer": 0}\n')
    assert plan_hash(bt("plan", str(suite_preset(tmp_path, renamed, "moved.toml")))) != first
    bumped = '{ name = "arith", version = 2, file = "arithmetic.jsonl" }'
    assert plan_hash(bt("plan", str(suite_preset(tmp_path, bumped, "bumped.toml")))) != first


def test_a_preset_without_suites_plans_the_eval_step_it_planned_before(bt, store):
    from buildtrain.plan.stored import load_plan
    from buildtrain.store.store import Store

    plan = load_plan(Store(store), plan_hash(bt("plan", str(MICRO))))
    (evaluation,) = [s for s in plan.steps if s.kind == "eval"]
    assert set(evaluation.config) == {"eval", "model", "version"}
    assert set(evaluation.config["eval"]) == {"suite", "seq_len", "batch_size", "max_batches"}
    assert set(evaluation.inputs) == {"weights", "data"}
    assert set(plan.config["eval"]) == {"suite", "every", "seq_len", "batch_size", "max_batches"}


@pytest.mark.parametrize(
    ("suites", "expected"),
    [
        (
            '{ name = "x" }',
            'eval.suites[0].file: a multiple_choice suite reads a file; add file = "questions.jsonl"',
        ),
        ('{ file = "arithmetic.jsonl" }', "eval.suites[0].name: is required"),
        ('{ name = "x", file = "missing.jsonl" }', "eval.suites[0].file: cannot read"),
        ('{ name = "x", file = "arithmetic.jsonl", kind = "mc" }', "eval.suites[0].kind: must be one of"),
        (f"{ARITH}, {ARITH}", "eval.suites: suite names must be unique (repeated: arith)"),
        (
            '{ name = "x", kind = "lm_eval", file = "arithmetic.jsonl" }',
            "eval.suites[0].task: an lm_eval suite runs",
        ),
        (
            '{ name = "x", task = "t.yaml", file = "arithmetic.jsonl" }',
            "eval.suites[0].task: only an lm_eval suite",
        ),
        (
            '{ name = "x", kind = "lm_eval", task = "t.yaml", file = "arithmetic.jsonl" }',
            "eval.suites[0].task: cannot read",
        ),
    ],
)
def test_a_bad_suite_is_a_one_line_preset_error(bt, tmp_path, suites, expected):
    result = bt("plan", str(suite_preset(tmp_path, suites)))
    assert result.returncode == ExitCode.USAGE
    assert f"bench.toml: {expected}" in result.stderr and "Traceback" not in result.stderr


def test_a_bad_question_stops_the_plan_naming_file_line_and_key(bt, tmp_path):
    """Found when planning (issue 45, R10), not by the eval step after training."""
    preset = suite_preset(tmp_path, ARITH)
    with (tmp_path / "arithmetic.jsonl").open("a") as handle:
        handle.write('{"context": "1+1=", "choices": ["2", "3"], "answer": 2}\n')
    result = bt("run", str(preset))
    assert result.returncode == ExitCode.USAGE  # nothing was run
    assert "arithmetic.jsonl:25: answer: expected the index of a choice, 0 to 1" in result.stderr
    assert "Traceback" not in result.stderr


# -- laws -------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.floats(0.001, 1.0), st.floats(0.001, 1.0), st.integers(0, 2**32))
def test_a_subset_is_drawn_from_its_seed_and_grows_with_its_fraction(count, a, b, seed):
    small, large = sorted((a, b))
    drawn = subset_indices(count, small, seed)
    assert drawn == sorted(set(drawn)) and all(0 <= i < count for i in drawn)
    assert len(drawn) == (count if small >= 1.0 else max(1, round(small * count)))
    assert drawn == subset_indices(count, small, seed)
    assert set(drawn) <= set(subset_indices(count, large, seed))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=20), st.text(min_size=1, max_size=20))
def test_the_pair_of_a_context_and_a_choice_is_the_whole_text_split(context, choice):
    codec = text_codec(None)
    encode, end = codec.encode, codec.end
    before, after = pair_ids(context, choice, encode, end)
    stripped = context.rstrip()
    assert after[: len(encode(context[len(stripped) :]))] == encode(context[len(stripped) :])
    if stripped:
        assert before + after == encode(context + choice)
    else:
        assert before == [end] and after == encode(context + choice)


def test_accuracy_takes_the_first_of_tied_choices_and_normalizes_by_characters():
    questions = [
        MultipleChoice(context="", choices=("a", "b"), answer=0),
        MultipleChoice(context="", choices=("a", "b"), answer=1),
        MultipleChoice(context="", choices=("x", "yyyy"), answer=1),
    ]
    result = accuracy([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -2.0]], questions)
    assert result == {"questions": 3, "acc": 1 / 3, "acc_norm": 2 / 3}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"not json", "x.jsonl:1: not JSON"),
        (b'{"context": "a", "choices": ["b", "c"]}', "expected the keys answer, choices, context"),
        (b'{"context": 1, "choices": ["b", "c"], "answer": 0}', "x.jsonl:1: context: expected a string"),
        (b'{"context": "a", "choices": ["b"], "answer": 0}', "choices: expected two or more"),
        (b'{"context": "a", "choices": ["b", "c"], "answer": true}', "answer: expected the index"),
    ],
)
def test_a_malformed_question_names_its_line_and_key(line, message):
    with pytest.raises(StepFailed, match=message.replace("(", r"\(")):
        read_multiple_choice(line + b"\n", "x.jsonl")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param(b'{"context": "' + b"x" * (64 << 20) + b'"}', "more than 1048576", id="64MB-line"),
        pytest.param(b"[" * 100000 + b"]" * 100000, "x.jsonl:1: not JSON (RecursionError", id="deep"),
        pytest.param(
            b'{"context": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}', "nests more than 16", id="nesting"
        ),
        pytest.param(
            json.dumps({"context": "a", "choices": ["a"] * 5000, "answer": 0}).encode(),
            "choices: 5000 choices, more than 100",
            id="5000-choices",  # 200k choices pass the line bound too
        ),
    ],
)
def test_a_suite_file_is_read_within_bounds(line, message):
    """Issue 45, R10: each gives one line, at once, never a traceback or minutes of scoring."""
    with pytest.raises(StepFailed) as raised:
        read_multiple_choice(line + b"\n", "x.jsonl")
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_the_shipped_suite_reads():
    questions = read_multiple_choice(ARITHMETIC.read_bytes(), ARITHMETIC)
    assert len(questions) == 24 and all(q.context.endswith("=") for q in questions)


def hf_continuations(hf: Path, contexts: list[str], tokens: int) -> list[str | None]:
    """transformers' greedy continuation of each context on the `hf/` export (its own generate),
    up to its first newline or end-of-document token; None where it reaches neither."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    found: list[str | None] = []
    for context in contexts:
        ids = torch.tensor([tokenizer(context).input_ids])
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        new = out[0, ids.shape[1] :].tolist()
        ended = tokenizer.eos_token_id in new
        text = tokenizer.decode(new[: new.index(tokenizer.eos_token_id)] if ended else new)
        found.append(text.split("\n", 1)[0] if ended or "\n" in text else None)
    return found


def test_exact_match_scores_greedy_continuations_as_transformers_generates_them(bt, tmp_path):
    sums = '{ name = "sums", kind = "exact_match", file = "sums.jsonl" }'
    shutil.copyfile(REPO / "tests" / "suites" / "sums.jsonl", tmp_path / "sums.jsonl")
    trained = "[train]\nsteps = 600\n"  # long enough for the micro model to end its answers
    first = suite_preset(tmp_path, sums, "first.toml", trained)
    assert bt("run", str(first)).returncode == 0
    assert bt("export", str(first), str(tmp_path / "package")).returncode == 0
    (row,) = metrics(bt)
    assert row["suites"]["sums"]["questions"] == 24 and 0.0 <= row["suites"]["sums"]["accuracy"] <= 1.0

    # Plant the model's own answers (what transformers generates, up to its newline or end) as the
    # targets of half the questions, and answers it does not give as the others': those match.
    contexts = [json.loads(line)["context"] for line in (tmp_path / "sums.jsonl").read_text().splitlines()]
    generated = hf_continuations(tmp_path / "package" / "hf", contexts, tokens=12)
    planted = [(c, g) for c, g in zip(contexts, generated, strict=True) if g][:6]
    assert planted, f"the model ends no answer: {generated}"
    questions = [{"context": c, "target": g} for c, g in planted]
    questions += [{"context": c, "target": g + "0x"} for c, g in planted]
    (tmp_path / "planted.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    planted_suite = '{ name = "planted", kind = "exact_match", file = "planted.jsonl" }'
    second = suite_preset(tmp_path, planted_suite, "p.toml", trained)
    assert bt("run", str(second)).returncode == 0
    rows = {r["hash"]: r for r in metrics(bt)}
    assert rows[plan_hash(bt("plan", str(second)))]["suites"]["planted"]["accuracy"] == 0.5


def test_an_exact_match_question_needs_a_one_line_target():
    from buildtrain.config.suite_files import read_exact_match

    with pytest.raises(StepFailed, match=r"s.jsonl:2: target: expected a non-empty string without a newline"):
        read_exact_match(b'{"context": "a", "target": "b"}\n{"context": "a", "target": "b\\nc"}\n', "s.jsonl")
    with pytest.raises(StepFailed, match="expected the keys context, target"):
        read_exact_match(b'{"context": "a", "answer": "b"}\n', "s.jsonl")


def test_bt_eval_scores_a_suite_ad_hoc_and_finds_it_again_without_torch(bt, tmp_path):
    import os

    plan = plan_hash(bt("plan", str(suite_preset(tmp_path, ARITH))))
    assert bt("run", plan).returncode == 0
    (row,) = metrics(bt)
    blocked = tmp_path / "no-torch" / "torch"  # a process that finds this cannot import torch
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("bt eval imported torch for a stored result")\n')
    no_torch = {"PYTHONPATH": os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", "")])}

    def evaluated(*args: str, env: dict[str, str] | None = None) -> dict:
        done = bt("eval", plan, "--suite", *args, env=env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    found = evaluated("arith", env=no_torch)  # the plan's own result, from the store
    assert found["cached"] and found["result"]["acc"] == row["suites"]["arith"]["accuracy"]
    half = evaluated("arith", "--subset", "0.5")
    assert not half["cached"] and half["result"]["questions"] == 12
    assert evaluated("arith", "--subset", "0.5", env=no_torch) == {**half, "cached": True}
    early = evaluated("arith@1", "--update", "4")
    assert not early["cached"] and early["weights"] == "update 4" and early["key"] != found["key"]
    assert evaluated("arith", "--update", "12", env=no_torch)["key"] == found["key"]  # the final weights

    refused = bt("eval", plan, "--suite", "arith@2")
    assert refused.returncode == ExitCode.USAGE and "the plan's suites are arith@1" in refused.stderr
    refused = bt("eval", plan, "--suite", "arith", "--update", "5")
    assert (
        refused.returncode == ExitCode.USAGE and "kept the checkpoints of updates 12, 8, 4" in refused.stderr
    )


def test_a_question_planted_in_the_training_data_is_reported_as_overlap(bt, tmp_path, store):
    import random

    rng = random.Random(3)
    with (tmp_path / "corpus.jsonl").open("w") as corpus:
        for _ in range(300):
            sums = [(rng.randrange(400, 999), rng.randrange(100, 999)) for _ in range(3)]
            corpus.write(json.dumps({"text": "\n".join(f"{a}+{b}={a + b}" for a, b in sums)}) + "\n")
        # A suite question with its answer, spaced and cased otherwise: the same after normalising.
        corpus.write(json.dumps({"text": "  95+25=120 \n"}) + "\n")
    data = '[data]\nsource = "files"\nfiles = ["corpus.jsonl"]\nformat = "jsonl"\n'
    preset = suite_preset(tmp_path, ARITH, extra=data)
    built = bt("run", str(preset))
    assert built.returncode == 0, built.stderr
    (row,) = metrics(bt)
    assert row["suites"]["arith"]["overlap"] == 1
    assert "overlap:arith" in bt("ls", "--metrics").stdout
    evals = [p for p in (store / "steps").iterdir() if (p / "eval.json").is_file()]
    (output,) = [p for p in evals if not (p / "BLAKE3SUMS").exists()]  # not the export package
    recorded = json.loads((output / "eval.json").read_text())["suites"]["arith"]["result"]["overlap"]
    rate = recorded.pop("false_positive_rate")  # per n-gram, from the filter's fill (steps/ngrams.py)
    assert recorded == {"count": 1, "fraction": 1 / 24, "examples": ["95+25="], "documents": 1, "ngram": 13}
    assert 0 <= rate < 1e-6
    (documents,) = [p / "documents.u64" for p in (store / "steps").iterdir() if (p / "data.json").is_file()]
    assert documents.stat().st_size == 8 * 301  # one digest per distinct document


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60), st.lists(st.integers(0, 200), max_size=6))
def test_a_document_digest_does_not_depend_on_where_its_chunks_are_cut(text, cuts):
    from buildtrain.steps.data.documents import DocumentDigest, digest_text

    raw = text.encode("utf-8")
    document, at = DocumentDigest(), 0
    for cut in sorted(min(c, len(raw)) for c in cuts):
        document.update(raw[at:cut])
        at = cut
    document.update(raw[at:])
    assert document.value() == digest_text(text)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("aB1+= \t\n"), max_size=40))
def test_a_document_digest_ignores_ascii_case_and_spacing(text):
    from buildtrain.steps.data.documents import digest_text

    assert digest_text(text) == digest_text(" ".join(text.lower().split()))
    assert digest_text(text) == digest_text("  " + text.upper() + "\n")


def test_checkpoints_every_draws_each_suite_over_the_kept_checkpoints_and_leaves_the_weights(
    bt, tmp_path, store
):
    from conftest import step_digests

    from buildtrain.plan.stored import load_plan
    from buildtrain.store.store import Store

    curve = plan_hash(
        bt("plan", str(suite_preset(tmp_path, ARITH, "curve.toml", "checkpoints_every = 4\nsubset = 0.5\n")))
    )
    flat = plan_hash(bt("plan", str(suite_preset(tmp_path, ARITH, "flat.toml", "subset = 0.5\n"))))
    assert bt("run", curve).returncode == 0
    assert bt("run", flat).returncode == 0
    trains = [{s.hash for s in load_plan(Store(store), p).steps if s.kind == "train"} for p in (curve, flat)]
    assert trains[0] == trains[1]  # the same train step: the curve is drawn after training
    assert step_digests(store, curve)["train:main"] == step_digests(store, flat)["train:main"]

    (output,) = [p for p in (store / "steps").iterdir() if b'"curves"' in _eval_json(p)]
    body = json.loads(_eval_json(output))
    points = body["curves"]["arith"]
    assert [p["update"] for p in points] == [4, 8, 12]  # the kept checkpoints; 12 is the final weights
    assert points[-1]["result"] == body["suites"]["arith"]["result"]
    early = bt("eval", curve, "--suite", "arith", "--update", "4")  # the same result, stored once
    assert json.loads(early.stdout)["cached"] and json.loads(early.stdout)["result"] == points[0]["result"]

    report = bt("report", "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    assert "Benchmark suites at the kept checkpoints" in (tmp_path / "report.html").read_text()
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    (record,) = [r for r in (tmp_path / "experiments").iterdir() if r.name.endswith(curve[:12])]
    events = accumulator.EventAccumulator(str(record))
    events.Reload()
    assert sorted(e.step for e in events.Scalars("eval/arith/acc")) == [4, 8, 12]


def _eval_json(output: Path) -> bytes:
    path = output / "eval.json"
    return path.read_bytes() if path.is_file() and not (output / "BLAKE3SUMS").exists() else b""


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_a_document_digest_is_the_blake3_of_its_lowercased_words_joined_by_spaces(text):
    """The normalisation, stated once as bytes methods say it: ASCII case and whitespace."""
    import blake3

    from buildtrain.steps.data.documents import digest_text

    words = b" ".join(text.encode("utf-8").lower().split())
    assert digest_text(text) == int.from_bytes(blake3.blake3(words).digest(8), "little")


def test_a_document_longer_than_any_question_is_not_digested():
    from buildtrain.steps.data.documents import MAX_DOCUMENT, Recorder

    recorder = Recorder()
    stream = [("short", [b"95+25=120"]), ("long", [b"x" * MAX_DOCUMENT, b"y"])]
    for _, chunks in recorder.documents(stream):
        for _ in chunks:
            pass
    assert len(recorder.values) == 1


def test_a_suite_with_max_overlap_withholds_a_contaminated_score(bt, tmp_path):
    with (tmp_path / "corpus.jsonl").open("w") as corpus:
        for index in range(300):
            corpus.write(json.dumps({"text": f"{index}+{index}={2 * index}\n{index}+1={index + 1}"}) + "\n")
        corpus.write(json.dumps({"text": "95+25=120"}) + "\n")  # a question of the suite, with its answer
    data = '[data]\nsource = "files"\nfiles = ["corpus.jsonl"]\nformat = "jsonl"\n'
    strict = '{ name = "arith", file = "arithmetic.jsonl", max_overlap = 0 }'
    built = bt("run", str(suite_preset(tmp_path, strict, extra=data)))
    assert built.returncode == 0, built.stderr
    (row,) = metrics(bt)
    suite = row["suites"]["arith"]
    assert suite["accuracy"] is None and suite["overlap"] == 1
    assert suite["refused"] == "1 questions are in the training data (max_overlap 0)"
    refused = bt(
        "plan", str(suite_preset(tmp_path, '{ name = "a", file = "arithmetic.jsonl", max_overlap = -1 }'))
    )
    assert (
        refused.returncode == ExitCode.USAGE and "eval.suites[0].max_overlap: must be >= 0" in refused.stderr
    )
