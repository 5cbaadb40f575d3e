"""`bt ls --metrics`: the values that differ, the results, sorting, and no torch on the way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_bt
from sweeps_built import BuiltSweep, built_sweep

from buildtrain.errors import ExitCode
from buildtrain.plan.card import Card
from buildtrain.views.table import differing


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
