"""`bt ls --metrics`: the values that differ, the results, sorting, and no torch on the way."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MICRO, plan_hash, run_bt
from hypothesis import given, settings
from hypothesis import strategies as st
from mixed_built import BuiltMixed, built_mixed
from sweeps_built import BuiltSweep, built_sweep

from buildtrain.errors import ExitCode
from buildtrain.plan.card import Card
from buildtrain.views.table import RESULT_COLUMNS, cell, differing, fitted_table, short_names, table_text


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> BuiltSweep:
    return built_sweep(tmp_path_factory)


def _card(**config: object) -> Card:
    return Card(hash="0" * 64, name="x", created="?", config=dict(config), steps=())


def test_only_keys_that_differ_become_columns() -> None:
    cards = [_card(a=1, b=2, c=[1, 2]), _card(a=1, b=3, c=[1, 2]), _card(a=1, b=3, c=[1, 3], d=0)]
    assert differing(cards) == ["b", "c", "d"]
    assert differing(cards[:1]) == []


def test_the_table_shows_the_axes_and_the_results(sweep: BuiltSweep) -> None:
    result = run_bt("ls", "--metrics", "--json", store=sweep.store)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert len(rows) == 6
    for row in rows:
        assert set(row["values"]) == {"stages[1].train.lr", "stages[1].train.steps"}
        assert row["status"] == "built"
        for column in ("train_loss", "heldout_loss", "bits_per_token", "tokens_per_s", "wall_s"):
            assert isinstance(row[column], float) and row[column] > 0, (column, row)
        assert row["bits_per_token"] == pytest.approx(row["heldout_loss"] / 0.6931471805599453)
    text = run_bt("ls", "--metrics", store=sweep.store).stdout.splitlines()
    assert text[0].split()[:4] == ["plan", "name", "stages[1].train.lr", "stages[1].train.steps"]
    assert len(text) == 7


@pytest.mark.parametrize("column", ["heldout_loss", "-tokens_per_s", "stages[1].train.lr"])
def test_sorting_by_any_column(sweep: BuiltSweep, column: str) -> None:
    rows = json.loads(run_bt("ls", "--metrics", "--json", f"--sort={column}", store=sweep.store).stdout)
    name = column.lstrip("-")
    values = [row["values"][name] if name in row["values"] else row[name] for row in rows]
    assert values == sorted(values, reverse=column.startswith("-"))


def test_an_unknown_sort_column_names_the_choices(sweep: BuiltSweep) -> None:
    result = run_bt("ls", "--metrics", "--sort", "los", store=sweep.store)
    assert result.returncode == ExitCode.USAGE
    assert "--sort los: no such column; choose one of:" in result.stderr and "heldout_loss" in result.stderr


def test_diff_has_a_metrics_section(sweep: BuiltSweep) -> None:
    result = run_bt("diff", sweep.plans[0], sweep.plans[-1], store=sweep.store)
    assert result.returncode == 0, result.stderr
    assert "metrics:" in result.stdout and "held-out" in result.stdout
    body = json.loads(run_bt("diff", sweep.plans[0], sweep.plans[-1], "--json", store=sweep.store).stdout)
    assert {m["metric"] for m in body["metrics"]} >= {"train_loss", "heldout_loss", "tokens_per_s"}


def test_diff_shows_only_what_exists_and_says_when_a_plan_never_ran(micro_built, tmp_path) -> None:
    """Issue 48: two plans never run share a built data step; `bt diff` showed its wall time as
    theirs and "partial 1/4". Now: said in one line; against a built plan, only its values."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    built = micro_built[1]
    a, b = (
        plan_hash(run_bt("plan", str(MICRO), "--set", f"train.lr={lr}", store=store)) for lr in (1e-3, 2e-3)
    )
    neither = run_bt("diff", a, b, store=store)
    assert neither.returncode == 0, neither.stderr
    assert neither.stdout.splitlines()[-1] == "metrics: neither plan has been run (bt run builds them)"
    assert "wall s" not in neither.stdout and "partial" not in neither.stdout
    body = json.loads(run_bt("diff", a, b, "--json", store=store).stdout)["metrics"]
    assert all(m["before"] is None and m["after"] is None for m in body if m["metric"] != "status")
    one = run_bt("diff", a, built, store=store).stdout
    section = one[one.index("metrics:") :].splitlines()
    (ours,) = json.loads(run_bt("ls", built, "--metrics", "--json", store=store).stdout)
    assert section[1:] == [
        f"  train loss  - -> {cell(ours['train_loss'])}",
        f"  held-out    - -> {cell(ours['heldout_loss'])}",
        f"  bits/token  - -> {cell(ours['bits_per_token'])}",
        f"  tokens/s    - -> {cell(ours['tokens_per_s'])}",
        f"  wall s      - -> {cell(ours['wall_s'])}",
        "  status      not run -> built",
    ]


def test_tables_and_reports_do_not_import_torch(sweep: BuiltSweep, tmp_path) -> None:
    probe = (
        "import sys\n"
        "from buildtrain.cli import main\n"
        f"assert main(['--store', {str(sweep.store)!r}, 'ls', '--metrics']) == 0\n"
        f"assert main(['--store', {str(sweep.store)!r}, 'diff', {sweep.plans[0]!r}, {sweep.plans[1]!r}]) == 0\n"
        f"assert main(['--store', {str(sweep.store)!r}, 'show', {sweep.plans[0]!r}, '--lineage']) == 0\n"
        "assert 'matplotlib' not in sys.modules, 'a table imported matplotlib'\n"
        f"assert main(['--store', {str(sweep.store)!r}, 'report', '-o', {str(tmp_path / 'r.html')!r}]) == 0\n"
        "import buildtrain.views.table, buildtrain.views.html, buildtrain.views.lineage, buildtrain.views.figures\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_damaged_card_is_recomputed_from_the_plan_not_believed(tmp_path) -> None:
    from conftest import MICRO

    from buildtrain.plan.card import card_path, load_card, read_card
    from buildtrain.plan.planner import plan_preset
    from buildtrain.store.store import Store

    store = Store(tmp_path / ".bt")
    plan = plan_preset(MICRO, [], store).plan
    path = card_path(store, plan.hash)
    good = read_card(store, plan.hash)
    assert good is not None and good.config["stages[0].train.lr"] == 3e-3  # written when planned
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw.replace(b'"micro"', b'"other"'))
    assert read_card(store, plan.hash) is None
    assert load_card(store, plan.hash) == good
    assert read_card(store, plan.hash) == good  # and kept again


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> BuiltMixed:
    return built_mixed(tmp_path_factory)


def test_short_names_are_the_shortest_unique_suffixes() -> None:
    keys = ["stages[1].train.lr", "stages[1].train.steps", "eval.seq_len", "stages[0].train.seq_len"]
    assert short_names(keys) == {
        "stages[1].train.lr": "lr",
        "stages[1].train.steps": "steps",
        "eval.seq_len": "eval.seq_len",
        "stages[0].train.seq_len": "train.seq_len",
    }


def _row(index: int, name: str, values: dict[str, object]) -> dict[str, object]:
    return {"hash": f"{index:064x}", "name": name, "values": values, **dict.fromkeys(RESULT_COLUMNS, 1.5)}


@given(
    width=st.integers(1, 300),
    names=st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=5),
    keys=st.lists(st.from_regex(r"[a-z]{1,8}(\.[a-z]{1,8}){0,3}", fullmatch=True), unique=True, max_size=12),
)
@settings(max_examples=150, deadline=None)
def test_a_fitted_table_is_never_wider_than_asked(width: int, names: list[str], keys: list[str]) -> None:
    rows = [_row(i, name, {k: f"value-{k}-{i}" * (i + 1) for k in keys}) for i, name in enumerate(names)]
    text, hidden = fitted_table(keys, rows, width)
    assert all(len(line) <= width for line in text.splitlines())
    assert set(hidden) <= set(keys)
    full, none_hidden = fitted_table(keys, rows, None)
    assert none_hidden == [] and full == table_text(keys, rows)


def test_the_table_of_a_mixed_store_fits_the_terminal_and_tells_the_plans_apart(mixed: BuiltMixed) -> None:
    wide = run_bt("ls", "--metrics", store=mixed.store)  # a pipe: every column
    assert max(len(line) for line in wide.stdout.splitlines()) > 500  # 40-odd keys differ
    result = run_bt("ls", "--metrics", store=mixed.store, env={"COLUMNS": "100"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 5 and all(len(line) <= 100 for line in lines), result.stdout
    assert {"held-out", "train loss", "norm"} <= set(lines[0].split("  ")) | set(lines[0].split())
    rest = [line.split(None, 1)[1] for line in lines[1:]]  # without the hash
    assert len(set(rest)) == 4  # the name and the columns kept still tell every plan apart
    assert "config column(s) left out to fit 100 columns" in result.stderr
    narrow = run_bt("ls", "--metrics", store=mixed.store, env={"COLUMNS": "30"})
    assert all(len(line) <= 30 for line in narrow.stdout.splitlines())


def test_ls_takes_plans_sweeps_and_a_name_filter(mixed: BuiltMixed, sweep: BuiltSweep) -> None:
    two = run_bt("ls", "--metrics", "--json", mixed.plans[0][:8], mixed.plans[2], store=mixed.store)
    assert two.returncode == 0, two.stderr
    # exactly the two named plans (in the default order, creation time then hash: plans made in
    # the same second come out by hash, so the order is not the one given)
    assert sorted(row["hash"] for row in json.loads(two.stdout)) == sorted([mixed.plans[0], mixed.plans[2]])
    named = run_bt("ls", "--metrics", "--json", "--name", "micro*", store=mixed.store)
    assert {row["name"] for row in json.loads(named.stdout)} == {"micro", "micro-stages"}
    assert len(json.loads(named.stdout)) == 3
    alone = run_bt(
        "ls", "--metrics", "--json", "--name", "wide", mixed.plans[0], mixed.plans[2], store=mixed.store
    )
    assert [row["values"] for row in json.loads(alone.stdout)] == [{}]  # nothing differs within one plan
    for metrics in ([], ["--metrics"]):
        none = run_bt("ls", *metrics, "--name", "nothing*", store=mixed.store)
        assert none.returncode == 0 and none.stdout == "", none.stdout
        assert none.stderr == "bt ls: no plan is named like 'nothing*' (bt ls lists them all)\n"
    plain = run_bt("ls", "--name", "wide", store=mixed.store)
    assert plain.returncode == 0 and len(plain.stdout.splitlines()) == 2 and "wide" in plain.stdout
    swept = run_bt("ls", "--metrics", "--json", "sweep.txt", store=sweep.store, cwd=sweep.store.parent)
    assert swept.returncode == 0, swept.stderr
    assert sorted(row["hash"] for row in json.loads(swept.stdout)) == sorted(sweep.plans)
    unknown = run_bt("ls", "--metrics", "ffff0000", store=mixed.store)
    assert unknown.returncode == ExitCode.USAGE and "no plan ffff0000" in unknown.stderr
