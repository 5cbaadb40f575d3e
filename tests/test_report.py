"""`bt report`: one self-contained page with charts drawn by matplotlib, PNG figures, and a browser check."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_bt
from mixed_built import built_mixed
from sweeps_built import BuiltSweep, built_sweep

from buildtrain.views.html import MAX_CONFIG_COLUMNS, MAX_LABEL, legend_label

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> BuiltSweep:
    return built_sweep(tmp_path_factory)


@pytest.fixture(scope="module")
def report(sweep: BuiltSweep, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("report")
    env = {"BT_EXPERIMENTS": str(sweep.experiments)}
    result = run_bt(
        "report",
        *sweep.plans,
        "-o",
        str(out / "report.html"),
        "--png",
        str(out / "figures"),
        store=sweep.store,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return out, (out / "report.html").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """(folder, page, stderr) of `bt report` over plans of three presets and a --set variant."""
    built = built_mixed(tmp_path_factory)
    out = tmp_path_factory.mktemp("mixed-report")
    result = run_bt(
        "report",
        "-o",
        str(out / "report.html"),
        store=built.store,
        env={"BT_EXPERIMENTS": str(built.experiments)},
    )
    assert result.returncode == 0, result.stderr
    return out, (out / "report.html").read_text(encoding="utf-8"), result.stderr


def test_a_mixed_report_is_quiet_and_shows_only_what_tells_the_plans_apart(
    mixed: tuple[Path, str, str],
) -> None:
    _, page, stderr = mixed
    assert stderr == ""  # matplotlib's layout warnings were three UserWarning lines here
    assert "=None" not in page and "None" not in re.sub(r"<svg.*?</svg>", "", page, flags=re.S)
    headings = re.findall(r"<h3>(.*?)</h3>", page)
    assert len(headings) == 4 and all(len(re.sub("<[^>]+>", "", h)) <= 13 + MAX_LABEL for h in headings)
    table = page[page.index("<h2>Results</h2>") : page.index("<h2>Curves</h2>")]
    assert table.startswith("<h2>Results</h2><div class='scroll'><table>")  # scrolls inside itself
    config_columns = re.findall(r"<th title='([^']+)'>", table)
    assert 1 <= len(config_columns) <= MAX_CONFIG_COLUMNS and "model.norm" in config_columns
    assert "more config keys differ between these plans" in table
    for heading in ("train loss", "held-out", "bits/token", "status"):
        assert f">{heading}</th>" in table
    legends = re.findall(r"<text[^>]*>([0-9a-f]{8} [^<]*)</text>", page)
    assert legends and all(len(text) <= MAX_LABEL for text in legends)


def test_the_page_is_self_contained(report: tuple[Path, str]) -> None:
    _, page = report
    assert page.count("<svg") == 3  # loss, learning rate, held-out
    assert "<script" not in page.lower()
    # Namespaces name, they do not fetch; nothing else may point outside the file.
    outside = re.findall(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page)
    assert outside == []
    assert "<link" not in page and "@import" not in page


def test_the_page_holds_the_table_the_curves_and_the_cache_hits(
    sweep: BuiltSweep, report: tuple[Path, str]
) -> None:
    _, page = report
    for plan in sweep.plans:
        assert plan[:12] in page
    assert "stages[1].train.lr" in page and "held-out" in page
    assert page.count("train:pretrain") >= 6  # every plan's steps
    assert "<span class='cached'>cached</span>" in page  # the second run's hits
    assert "Training loss" in page and "stage boundaries" in page  # two stages, end to end
    assert "Learning rate" in page and "Held-out evaluation" in page


def test_png_figures_for_papers(report: tuple[Path, str]) -> None:
    out, _ = report
    for name in ("loss", "lr", "heldout"):
        data = (out / "figures" / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_legend_labels_name_what_sets_a_plan_apart() -> None:
    assert legend_label("0bc9f7c8c2ae" + "0" * 52, {"stages[1].train.lr": 0.01, "model.n_layers": 2}) == (
        "0bc9f7c8 lr=0.01 n_layers=2"
    )
    same_leaf = {"stages[0].train.lr": 0.1, "stages[1].train.lr": 0.2}
    assert legend_label("a" * 64, same_leaf) == "aaaaaaaa stages[0].train.lr=0.1 stages[1].train.lr=0.2"


def test_an_unknown_plan_is_one_line(sweep: BuiltSweep, tmp_path: Path) -> None:
    result = run_bt("report", "ffff0000", "-o", str(tmp_path / "r.html"), store=sweep.store)
    assert result.returncode == 2 and "no plan ffff0000" in result.stderr
    assert not (tmp_path / "r.html").exists()


def _browser_ready() -> bool:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import playwright  # noqa: F401
        from report_in_browser import find_chromium
    except ImportError:
        return False
    finally:
        sys.path.pop(0)
    return find_chromium() is not None


@pytest.mark.skipif(not _browser_ready(), reason="needs Chromium and playwright (CI has neither)")
def test_the_page_renders_in_a_real_browser(report: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = report
    shot = tmp_path / "report.png"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "report_in_browser.py"),
            str(out / "report.html"),
            "--screenshot",
            str(shot),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert shot.read_bytes().startswith(PNG_MAGIC)


def _in_browser(page: Path, shot: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts" / "report_in_browser.py"), str(page)]
    return subprocess.run(
        [*command, *(["--screenshot", str(shot)] if shot else [])],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(not _browser_ready(), reason="needs Chromium and playwright (CI has neither)")
def test_a_mixed_report_renders_with_nothing_clipped(mixed: tuple[Path, str, str], tmp_path: Path) -> None:
    out, _, _ = mixed
    result = _in_browser(out / "report.html", tmp_path / "mixed.png")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nothing clipped" in result.stdout


@pytest.mark.skipif(not _browser_ready(), reason="needs Chromium and playwright (CI has neither)")
def test_the_browser_check_fails_on_clipped_content(mixed: tuple[Path, str, str], tmp_path: Path) -> None:
    """What the first mixed report looked like: legend text past the chart's edge, a table that
    ran the page to 8,550 px."""
    _, page, _ = mixed
    legend = "<text x='700' y='20'>235a8134 max_batches=4 eval.seq_len=32 dim=32 ffn_hidden=64</text>"
    broken = page.replace("</svg>", legend + "</svg>", 1).replace("<div class='scroll'>", "<div>", 1)
    broken = broken.replace("<th class='text'>plan</th>", "<th class='text'>" + "plan " * 400 + "</th>", 1)
    (tmp_path / "broken.html").write_text(broken, encoding="utf-8")
    result = _in_browser(tmp_path / "broken.html")
    assert result.returncode == 1, result.stdout
    assert "FAIL clipped: chart 0: text '235a8134 max_batches=4" in result.stdout
    assert "px window: a " in result.stdout and "runs off the page" in result.stdout


@pytest.mark.skipif(not _browser_ready(), reason="needs Chromium and playwright (CI has neither)")
def test_the_legend_of_sixty_plans_stays_inside_its_chart(tmp_path: Path) -> None:
    """A 3.2 in chart ran a legend of 60 entries past its edge; the chart grows with its legend."""
    from conftest import MICRO

    store = tmp_path / ".bt"
    axes = (
        "--sweep",
        "train.lr=1e-3,2e-3,3e-3,4e-3,5e-3,6e-3,7e-3,8e-3,9e-3,1e-2",
        "--sweep",
        "train.steps=4,8,12",
    )
    planned = run_bt("plan", str(MICRO), *axes, "--sweep", "model.n_layers=1,2", "-q", store=store)
    assert planned.returncode == 0 and len(planned.stdout.split()) == 60, planned.stderr
    result = run_bt("report", "-o", str(tmp_path / "r.html"), store=store)  # unbuilt: labels only
    assert result.returncode == 0 and result.stderr == "", result.stderr
    checked = _in_browser(tmp_path / "r.html")
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("output", ["", ".", "out/"])
def test_an_output_that_names_no_file_is_one_usage_line(tmp_path: Path, output: str) -> None:
    done = run_bt("report", "-o", output, store=tmp_path / ".bt")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"bt report: argument -o/--output: expected a file name, got {output!r}; see bt report --help"
    ]
