"""N-gram contamination (`steps/ngrams/`): the C hashing equals its Python reference, the
normalisation is lm-eval's, and end to end a suite cut from the training documents is found while
novel sentences are not, for exact_match, multiple_choice under max_overlap, and lm_eval."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from hypothesis import given
from hypothesis import strategies as st
from test_suites import metrics, suite_preset

from buildtrain.steps.ngrams import bloom as ngrams

VOCABULARY = [f"{a}{b}{c}" for a in "bdfgklmnprst" for b in "aeiou" for c in "nrstl"]
FILES = '[data]\nsource = "files"\nfiles = ["corpus.jsonl"]\nformat = "jsonl"\n'


def sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(VOCABULARY) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def stream(text: bytes, cuts: list[int], compiled: bool) -> np.ndarray:
    at, out, grams = 0, [], ngrams.NgramStream(compiled=compiled)
    for cut in [*sorted(cuts), len(text)]:
        out.append(grams.update(text[at:cut]).copy())
        at = max(at, cut)
    return np.concatenate([*out, grams.end()])


@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=6))
def test_the_c_hashes_equal_the_python_reference_wherever_the_text_is_cut(text, cuts):
    if ngrams._compiled() is None:
        pytest.skip("no C compiler here")
    assert np.array_equal(stream(text, cuts, True), stream(text, [], False))


def test_the_c_filter_equals_the_python_one():
    hashes = np.random.default_rng(0).integers(0, 2**63, 30_000, dtype=np.uint64)
    built = []
    for compiled in (True, False):
        recorded = ngrams.NgramFilter(compiled=compiled)
        recorded.add(hashes)
        built.append(recorded.to_bytes())
    assert built[0] == built[1]
    loaded = ngrams.LoadedFilter(built[0])
    assert loaded.contains(hashes).all()  # never a false negative
    assert loaded.contains(hashes + np.uint64(1)).sum() <= 3  # about 1e-5 each
    assert 0 < loaded.false_positive_rate() < 1e-4


def test_words_are_normalised_as_lm_eval_does_and_short_texts_are_one_ngram():
    words = " ".join(VOCABULARY[:20])
    shouted = "  ".join(w.upper() + ("," if i % 3 else "") for i, w in enumerate(VOCABULARY[:20]))
    assert len(ngrams.text_ngrams(words)) == 20 - ngrams.NGRAM + 1
    assert np.array_equal(ngrams.text_ngrams(words), ngrams.text_ngrams("\n" + shouted + " !"))
    assert np.array_equal(ngrams.text_ngrams("Don't stop"), ngrams.text_ngrams("dont STOP"))
    assert len(ngrams.text_ngrams("a b c")) == 1 and len(ngrams.text_ngrams(" ?! ")) == 0
    assert ngrams.text_ngrams("a b c")[0] not in set(ngrams.text_ngrams("a b c " + words).tolist())


def planted(folder: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """A corpus of 60 documents beside the preset, the (first half, 20-character continuation)
    of 40 of them, and 40 novel sentences."""
    rng = random.Random(46)
    documents = [" ".join(sentence(rng, rng.randrange(8, 14)) for _ in range(6)) for _ in range(60)]
    with (folder / "corpus.jsonl").open("w") as corpus:
        corpus.writelines(json.dumps({"text": d}) + "\n" for d in documents)
    halves = [(d[: len(d) // 2], d[len(d) // 2 : len(d) // 2 + 20]) for d in documents[:40]]
    return halves, [sentence(random.Random(index), 20) for index in range(40)]


def test_planted_halves_are_found_novel_sentences_are_not_and_lm_eval_reports_its_overlap(bt, tmp_path):
    halves, novel = planted(tmp_path)
    write = {
        "planted.jsonl": [{"context": c, "target": t} for c, t in halves],
        "novel.jsonl": [{"context": s[:-20], "target": s[-20:]} for s in novel],
        "planted_mc.jsonl": [{"context": c, "choices": [t, "no"], "answer": 0} for c, t in halves],
    }
    for name, rows in write.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tmp_path / "planted_mc.yaml"  # the arithmetic task, reading the planted questions
    shutil.copyfile(REPO / "tests" / "suites" / "arithmetic_mc.yaml", task)
    task.write_text(task.read_text().replace("arithmetic.jsonl", "planted_mc.jsonl"))
    suites = (
        '{ name = "planted", kind = "exact_match", file = "planted.jsonl" }, '
        '{ name = "novel", kind = "exact_match", file = "novel.jsonl" }, '
        '{ name = "strict", kind = "exact_match", file = "planted.jsonl", max_overlap = 37 }, '
        f'{{ name = "harness", kind = "lm_eval", task = "{task.name}", file = "planted_mc.jsonl" }}'
    )
    built = bt("run", str(suite_preset(tmp_path, suites, extra=FILES)))
    assert built.returncode == 0, built.stderr
    (row,) = metrics(bt)
    found = {name: suite["overlap"] for name, suite in row["suites"].items()}
    assert found["planted"] >= 38 and found["novel"] == 0 and found["harness"] >= 38, found
    assert row["suites"]["strict"]["refused"].endswith("(max_overlap 37)")
    assert row["suites"]["strict"].get("accuracy") is None
    # The end of `bt run` says so where a person looks: each suite's score and overlap, or the refusal.
    printed = built.stderr[built.stderr.index("suites of eval:") :].splitlines()[1:5]
    shown = {line.split()[0]: line for line in printed}
    assert set(shown) == {"planted", "novel", "strict", "harness"}, printed
    assert f"overlap {found['planted']}/40 ({found['planted'] / 40:.1%}), 13-grams" in shown["planted"]
    assert "accuracy " in shown["novel"] and "overlap 0/40 (0.0%)" in shown["novel"]
    assert f"refused: {row['suites']['strict']['refused']}" in shown["strict"]
    assert f"overlap {found['harness']}/40" in shown["harness"] and "acc_norm" in shown["harness"]


def test_a_suite_sets_its_n_and_the_ngrams_step_records_a_filter_for_it(bt, tmp_path, store):
    """`ngram = 8` in a suite: the ngrams steps of the stages its weights were trained on record
    8-grams (`ngrams-8.bloom`, their config saying so), and only those; planted halves are found
    with 8-grams, novel sentences are not."""
    from buildtrain.plan.stored import load_plan
    from buildtrain.store.store import Store

    halves, novel = planted(tmp_path)
    rows = {
        "planted.jsonl": [{"context": c, "target": t} for c, t in halves],
        "novel.jsonl": [{"context": s[:-20], "target": s[-20:]} for s in novel],
    }
    for name, lines in rows.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in lines))
    suites = (
        '{ name = "planted", kind = "exact_match", file = "planted.jsonl", ngram = 8 }, '
        '{ name = "novel", kind = "exact_match", file = "novel.jsonl", ngram = 8 }'
    )
    built = bt("run", str(suite_preset(tmp_path, suites, extra=FILES)))
    assert built.returncode == 0, built.stderr
    (row,) = metrics(bt)
    found = {name: suite["overlap"] for name, suite in row["suites"].items()}
    assert found["planted"] >= 38 and found["novel"] == 0, found
    assert "overlap 0/40 (0.0%), 8-grams" in built.stderr, built.stderr
    # Built by the evaluation worker while training ran, so the run's own turn finds it cached.
    beside = re.search(r"ngrams:main +running beside training", built.stderr)
    trained = re.search(r"train:main +executed", built.stderr)
    assert beside and trained and beside.start() < trained.start(), built.stderr
    assert re.search(r"ngrams:main +cached", built.stderr), built.stderr
    plan = load_plan(Store(store), row["hash"])
    (recorded,) = [s for s in plan.steps if s.kind == "ngrams"]
    assert recorded.config["ngrams"] == [8]
    output = Store(store).outputs.path(recorded.hash)
    assert not (output / "ngrams.bloom").exists() and ngrams.read_filter(output, 8).n == 8
    assert bt("fsck").returncode == 0  # the second filter's declared digest re-derives


def test_suites_never_change_the_data_step_and_their_n_reaches_the_ngrams_step(bt, tmp_path, store):
    """Whatever n its suites count, a plan plans the data step a plan without suites plans; the
    ngrams step records each n they count (none without suites)."""
    from conftest import MICRO, plan_hash

    from buildtrain.plan.stored import load_plan
    from buildtrain.store.store import Store

    def steps(preset: Path) -> tuple[dict, list]:
        plan = load_plan(Store(store), plan_hash(bt("plan", str(preset))))
        (data,) = [s for s in plan.steps if s.kind == "data"]
        recorded = [s.config["ngrams"] for s in plan.steps if s.kind == "ngrams"]
        return {"hash": data.hash, "config": data.config}, recorded

    plain, none = steps(MICRO)
    assert none == []
    arith = '{ name = "arith", file = "arithmetic.jsonl"'
    assert steps(suite_preset(tmp_path, arith + " }", "a.toml")) == (plain, [[13]])
    assert steps(suite_preset(tmp_path, arith + ", ngram = 13 }", "b.toml")) == (plain, [[13]])
    assert steps(suite_preset(tmp_path, arith + ", ngram = 8 }", "c.toml")) == (plain, [[8]])
    both = arith + ' }, { name = "other", file = "arithmetic.jsonl", ngram = 8 }'
    assert steps(suite_preset(tmp_path, both, "e.toml")) == (plain, [[8, 13]])
    refused = bt("plan", str(suite_preset(tmp_path, arith + ", ngram = 0 }", "d.toml")))
    assert refused.returncode == 2 and "eval.suites[0].ngram: must be >= 1" in refused.stderr


# What the data step's inline recorder wrote for this text before the filter moved into the ngrams
# step (computed on main at 6226546, `Recorder(extra=(8,))` over the synthetic corpus below): the
# ngrams step must write the same bytes, so old eval results keep their cache keys.
INLINE_DIGESTS = {
    "ngrams.bloom": "f542d904e2a1d674db1cc090b0f4f4b915981715a8aa967ba2a5f6a42e2d94d3",
    "ngrams-8.bloom": "0d126cfb63e1526008b945cd153ec5b68c4efbe3239de35335d776f1dbd30528",
}


def test_the_ngrams_step_writes_the_filters_the_data_step_wrote_inline(tmp_path):
    from buildtrain.config.steps import NgramsStep, SyntheticConfig, TextSettings
    from buildtrain.steps.ngrams.step import record

    text = TextSettings(
        source="synthetic",
        synthetic=SyntheticConfig(documents=300, lines=16, seed=0),
        split_block=1024,
        heldout_fraction=0.05,
        split_seed=0,
    )

    class Log:
        def info(self, *_, **__):
            pass

    digests = record(NgramsStep(text=text, ngrams=(8, 13)), [], tmp_path, Log())
    assert {k: v for k, v in digests.items() if k != "ngrams"} == INLINE_DIGESTS
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(INLINE_DIGESTS)


def test_only_a_plan_with_suites_plans_an_ngrams_step_and_training_never_waits_for_it(bt, tmp_path, store):
    from conftest import MICRO, plan_hash

    from buildtrain.plan.stored import load_plan
    from buildtrain.store.store import Store

    def plan_of(preset: Path):
        return load_plan(Store(store), plan_hash(bt("plan", str(preset))))

    assert [s for s in plan_of(MICRO).steps if s.kind == "ngrams"] == []
    plan = plan_of(suite_preset(tmp_path, '{ name = "arith", file = "arithmetic.jsonl" }'))
    kinds = [s.kind for s in plan.steps]
    (recorded,) = [s for s in plan.steps if s.kind == "ngrams"]
    (train,) = [s for s in plan.steps if s.kind == "train"]
    (evaluation,) = [s for s in plan.steps if s.kind == "eval"]
    assert kinds.index("train") < kinds.index("ngrams") < kinds.index("eval")  # training starts first
    assert recorded.hash not in train.upstream.values() and recorded.upstream == {}
    assert evaluation.upstream["ngrams:main"] == recorded.hash


def test_a_corpus_of_one_huge_document_has_no_digests_and_matches_nothing():
    """A document over MAX_DOCUMENT is not digested: a data step of one such file declares no
    digest, and the whole-document overlap with it is empty (it raised IndexError)."""
    from buildtrain.steps.data.documents import overlap

    assert overlap(np.zeros(0, dtype=np.uint64), ["one question", "another"]) == []
