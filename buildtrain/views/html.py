"""`bt report`: one self-contained HTML page comparing plans, and PNG figures beside it.

Self-contained means the file alone is the report: inline SVG charts and inline CSS, no script, no
font or image fetched from anywhere, so it opens offline, attaches to an email and archives with a
paper. Each plan's steps show which ones its last run executed and which were cache hits (shared
with another plan of the sweep, or built before).
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from buildtrain.config.suites import accuracy
from buildtrain.plan.card import load_card
from buildtrain.store.evals import output_curves
from buildtrain.store.store import Store
from buildtrain.views.curves import Curve, plan_curve
from buildtrain.views.figures import FIGURES, suites_svg, svg, write_pngs
from buildtrain.views.table import (
    HEADINGS,
    RESULT_COLUMNS,
    SHORT,
    cell,
    metrics_rows,
    most_telling,
    short_names,
)

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 13px; }
th, td { padding: 3px 9px; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f6f6f6; } td.text, th.text { text-align: left; } td, th { white-space: nowrap; }
div.scroll { overflow-x: auto; max-width: 100%; } p.note { color: #666; font-size: 13px; }
code { font: 12px ui-monospace, monospace; } .executed { color: #a35200; } .cached { color: #2a7d2a; }
figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
"""


# A mixed store's plans differ in dozens of keys: the table shows the ones that tell them apart
# best (all are in `bt ls --metrics --json`), a legend label at most a few, clipped to a width
# that leaves the plot its room (longer labels collapsed matplotlib's layout to nothing).
MAX_CONFIG_COLUMNS = 4
MAX_LABEL_VALUES = 3
MAX_LABEL = 48


def legend_label(plan_hash: str, values: dict[str, Any], name: str | None = None) -> str:
    """`0bc9f7c8 lr=0.01 n_layers=2`: the short hash, the plan's name where the plans' names
    differ, and what sets this plan apart, each key by its shortest unique suffix."""
    short = short_names(list(values))
    parts = [f"{short[key]}={value}" for key, value in values.items()]
    return " ".join([plan_hash[:8], *([name] if name else []), *parts])


def plan_labels(keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Each plan's label: its most telling values that are set (no `key=None`), clipped."""
    telling = most_telling(keys, rows)
    names_differ = len({row["name"] for row in rows}) > 1
    labels = {}
    for row in rows:
        values = {k: row["values"][k] for k in telling if row["values"].get(k) is not None}
        chosen = dict(list(values.items())[:MAX_LABEL_VALUES])
        label = legend_label(row["hash"], chosen, row["name"] if names_differ else None)
        labels[row["hash"]] = label if len(label) <= MAX_LABEL else label[: MAX_LABEL - 1] + "…"
    return labels


def latest_record(experiments: Path, plan_hash: str) -> dict[str, Any] | None:
    """summary.json of the newest run record of a plan (folders are named TIMESTAMP-HASHPREFIX)."""
    if not experiments.is_dir():
        return None
    folders = sorted(experiments.glob(f"*-{plan_hash[:12]}*"), reverse=True)
    for folder in folders:
        try:
            return json.loads((folder / "summary.json").read_bytes())
        except (OSError, ValueError):
            continue
    return None


def _table(all_keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """The results table with the most telling config columns, in a box that scrolls sideways
    by itself when the page is narrower than the table."""
    telling = set(most_telling(all_keys, rows)[:MAX_CONFIG_COLUMNS])
    keys = [k for k in all_keys if k in telling]
    short = short_names(keys)
    head = "".join(
        [
            "<th class='text'>plan</th><th class='text'>name</th>",
            *(f"<th title='{html.escape(k)}'>{html.escape(short[k])}</th>" for k in keys),
            *(
                f"<th{' class=text' if c == 'status' else ''}>{html.escape(HEADINGS[c])}</th>"
                for c in RESULT_COLUMNS
            ),
        ]
    )
    body = []
    for row in rows:
        cells = [
            f"<td class='text'><code>{row['hash'][:SHORT]}</code></td>",
            f"<td class='text'>{html.escape(row['name'])}</td>",
        ]
        cells += [f"<td>{html.escape(cell(row['values'].get(k)))}</td>" for k in keys]
        cells += [
            f"<td{' class=text' if c == 'status' else ''}>{html.escape(cell(row.get(c)))}</td>"
            for c in RESULT_COLUMNS
        ]
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = len(all_keys) - len(keys)
    note = (
        f"<p class='note'>{more} more config keys differ between these plans; "
        "<code>bt ls --metrics --json</code> lists them all. Point at a heading for its full key.</p>"
        if more
        else ""
    )
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return f"<div class='scroll'>{table}</div>{note}"


def _steps(store: Store, row: dict[str, Any], record: dict[str, Any] | None, plan_label: str) -> str:
    card = load_card(store, row["hash"])
    if card is None:
        return "<p>damaged plan: run bt fsck</p>"
    actions = {s.get("hash"): s for s in (record or {}).get("steps", [])}
    lines = []
    for label, _, step_hash in card.steps:
        done = actions.get(step_hash)
        if done:
            action = done.get("action", "?")
            detail = f" ({done['detail']})" if done.get("detail") else ""
            took = f"{done.get('duration_s', 0):.1f} s" if action == "executed" else ""
            css = "cached" if action == "cached" else "executed"
            cell = f"<span class='{css}'>{html.escape(action + detail)}</span>"
        else:
            cell = "built" if store.outputs.has(step_hash) else "not built"
            took = ""
        lines.append(
            f"<tr><td class='text'>{html.escape(label)}</td><td class='text'><code>{step_hash[:SHORT]}</code></td>"
            f"<td class='text'>{cell}</td><td>{took}</td></tr>"
        )
    run = f"last run <code>{html.escape(record['run_id'])}</code>" if record else "never run here"
    values = plan_label.split(" ", 1)[1] if " " in plan_label else ""  # the label without its hash ...
    values = values[len(row["name"]) :].lstrip() if values.startswith(row["name"]) else values  # ... or name
    heading = html.escape(row["name"] + (f": {values}" if values else ""))
    return (
        f"<h3><code>{row['hash'][:SHORT]}</code> {heading}</h3><p>{run}</p>"
        "<table><thead><tr><th class='text'>step</th><th class='text'>hash</th>"
        f"<th class='text'>last run</th><th>time</th></tr></thead><tbody>{''.join(lines)}</tbody></table>"
    )


def _suite_series(
    store: Store, rows: Sequence[dict[str, Any]], labels: dict[str, str]
) -> list[tuple[str, list[tuple[int, float]]]]:
    """(legend label, points) of each suite curve the listed plans' eval steps recorded."""
    series = []
    for row in rows:
        card = load_card(store, row["hash"])
        evals = card.summarizing("evaluation") if card is not None else []
        if evals and store.outputs.has(evals[-1][2]):
            for name, points in output_curves(store.outputs.path(evals[-1][2])).items():
                scored = [(update, accuracy(result)) for update, result in points]
                series.append(
                    (f"{labels[row['hash']]}: {name}", [(u, v) for u, v in scored if v is not None])
                )
    return series


def build_report(
    store: Store, plan_hashes: Sequence[str], experiments: Path, png_folder: Path | None = None
) -> tuple[str, list[Path]]:
    """(the HTML page, the PNG files written) for these plans."""
    keys, rows = metrics_rows(store, plan_hashes)
    labels = plan_labels(keys, rows)
    curves: list[Curve] = []
    for row in rows:
        card = load_card(store, row["hash"])
        if card is not None:
            curves.append(plan_curve(store, card, labels[row["hash"]]))
    by_plan = {row["hash"]: row for row in rows}
    heldout = [by_plan[c.plan].get("heldout_loss") for c in curves]
    figures = "".join(f"<figure>{svg(name, curves, heldout)}</figure>" for name in FIGURES)
    series = _suite_series(store, rows, labels)
    if series:
        figures += f"<figure>{suites_svg(series)}</figure>"
    pngs = write_pngs(png_folder, curves, heldout) if png_folder is not None else []
    steps = "".join(
        _steps(store, row, latest_record(experiments, row["hash"]), labels[row["hash"]]) for row in rows
    )
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    page = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>buildtrain report: {len(rows)} plan(s)</title><style>{STYLE}</style></head><body>"
        f"<h1>buildtrain report: {len(rows)} plan(s)</h1><p>store <code>{html.escape(str(store.root))}</code>, "
        f"{stamp}</p><h2>Results</h2>{_table(keys, rows)}<h2>Curves</h2>{figures}"
        f"<h2>Steps and cache hits</h2>{steps}</body></html>\n"
    )
    return page, pngs
