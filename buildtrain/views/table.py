"""`bt ls --metrics`: one row per plan with the values that tell the listed plans apart and their results.

A column of config appears only where the listed plans differ (the sweep axes, in practice), so a
grid of learning rates reads as a grid of learning rates, not as sixty identical settings.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from typing import Any

from buildtrain.errors import UsageError
from buildtrain.plan.card import Card, load_card
from buildtrain.store.layout import SHORT
from buildtrain.store.store import Store
from buildtrain.views.results import plan_results

RESULT_COLUMNS = ("train_loss", "heldout_loss", "bits_per_token", "tokens_per_s", "wall_s", "status")
HEADINGS = {
    "train_loss": "train loss",
    "heldout_loss": "held-out",
    "bits_per_token": "bits/token",
    "tokens_per_s": "tokens/s",
    "wall_s": "wall s",
    "status": "status",
}


def differing(cards: Sequence[Card]) -> list[str]:
    """Config keys whose value is not the same in every listed plan (a missing key counts as a value;
    1, 1.0 and true are three values)."""
    keys = list(dict.fromkeys(k for card in cards for k in card.config))
    missing = object()

    def same(a: Any, b: Any) -> bool:
        return type(a) is type(b) and a == b

    return [
        k
        for k in keys
        if any(not same(card.config.get(k, missing), cards[0].config.get(k, missing)) for card in cards[1:])
    ]


def metrics_rows(
    store: Store, plan_hashes: Sequence[str] | None = None, name: str | None = None
) -> tuple[list[str], list[dict[str, Any]]]:
    """(differing keys, rows) for the given plans (default: every stored plan), only those whose
    name matches the shell-style pattern `name` when given; the keys differ between those."""
    hashes = list(plan_hashes) if plan_hashes is not None else store.plans.hashes()
    rows, cards = [], []
    for plan_hash in hashes:
        card = load_card(store, plan_hash)
        if name is not None and not fnmatch.fnmatchcase(card.name if card else "?", name):
            continue
        if card is None:
            rows.append({"hash": plan_hash, "name": "?", "values": {}, **dict.fromkeys(RESULT_COLUMNS)})
            rows[-1]["status"] = "damaged"
            continue
        cards.append(card)
        rows.append(
            {
                "hash": plan_hash,
                "name": card.name,
                "created": card.created,
                "card": card,
                **plan_results(store, card),
            }
        )
    keys = [k for k in differing(cards) if k != "name"]
    for row in rows:
        card = row.pop("card", None)
        row["values"] = {k: card.config.get(k) for k in keys} if card is not None else {}
    return keys, rows


def sort_rows(rows: list[dict[str, Any]], keys: Sequence[str], column: str | None) -> list[dict[str, Any]]:
    """Sorted by a result column, `name`, `created`, `hash` or a differing config key; a leading
    `-` sorts descending. Blanks go last either way."""
    if not column:
        return sorted(rows, key=lambda r: (r.get("created") or "", r["hash"]))
    descending = column.startswith("-")
    name = column.lstrip("-")
    known = ("hash", "name", "created", *RESULT_COLUMNS, *keys)
    if name not in known:
        raise UsageError(f"--sort {name}: no such column; choose one of: {', '.join(known)}")

    def value(row: dict[str, Any]) -> Any:
        return row["values"].get(name) if name in keys else row.get(name)

    present = [r for r in rows if value(r) is not None]
    blank = [r for r in rows if value(r) is None]
    try:
        present.sort(key=value, reverse=descending)
    except TypeError:  # mixed types in one column: compare as text
        present.sort(key=lambda r: str(value(r)), reverse=descending)
    return present + blank


SUITE_PREFIXES = {"acc:": "accuracy", "overlap:": "overlap"}  # a suite's columns: `acc:NAME`, ...


def suite_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """An accuracy and an overlap column per benchmark suite any listed plan evaluated, by name."""
    names = dict.fromkeys(name for row in rows for name in row.get("suites", {}))
    return [prefix + name for name in names for prefix in SUITE_PREFIXES]


def result_value(row: dict[str, Any], column: str) -> Any:
    for prefix, field in SUITE_PREFIXES.items():
        if column.startswith(prefix):
            return row.get("suites", {}).get(column[len(prefix) :], {}).get(field)
    return row.get(column)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def short_names(keys: Sequence[str], taken: Sequence[str] = ("plan", "name")) -> dict[str, str]:
    """Each key by its shortest dotted suffix that no other key ends with and that is not one of
    the table's own headings: `stages[1].train.lr` is `lr`, unless another key ends in `lr` too."""
    parts = {key: key.split(".") for key in keys}
    names = {}
    for key, dotted in parts.items():
        for length in range(1, len(dotted) + 1):
            suffix = ".".join(dotted[-length:])
            clash = suffix in taken or any(
                other != key and (other == suffix or other.endswith("." + suffix)) for other in keys
            )
            if not clash:
                break
        names[key] = suffix
    return names


def most_telling(keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[str]:
    """The differing keys, most telling first: each next key is the one that tells the most
    plans apart that the name and the keys before it leave alike (then: set in the most plans,
    with the most distinct values, first in the preset's order). A table cut to its first keys tells the plans apart soonest."""
    order: list[str] = []
    groups = [(row["name"],) for row in rows]
    left = list(keys)
    while left:

        def score(key: str, groups: list[tuple[Any, ...]] = groups) -> tuple[int, int, int, int]:
            values = [repr(row["values"].get(key)) for row in rows]
            split = len(set(zip(groups, values, strict=True)))
            return (-split, sum(v == "None" for v in values), -len(set(values)), left.index(key))

        best = min(left, key=score)
        groups = [(*g, repr(row["values"].get(best))) for g, row in zip(groups, rows, strict=True)]
        order.append(best)
        left.remove(best)
    return order


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# When the table is too wide: which result columns go first (the held-out loss stays longest).
DROP_ORDER = ("wall_s", "tokens_per_s", "bits_per_token", "train_loss", "status")
CLIPPED_VALUE = 14  # characters of a config value or a name in a fitted table


def _render(headers: Sequence[str], cells: Sequence[Sequence[str]], text: set[int]) -> list[str]:
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if i in text else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    return [line(headers), *(line(c) for c in cells)]


def table_text(keys: Sequence[str], rows: Sequence[dict[str, Any]], width: int | None = None) -> str:
    return fitted_table(keys, rows, width)[0]


def fitted_table(
    keys: Sequence[str], rows: Sequence[dict[str, Any]], width: int | None
) -> tuple[str, list[str]]:
    """(the table, the config keys left out) in at most `width` characters a line (None: any).

    Too wide, the table first names config keys by their short names and clips long values,
    then leaves out config columns (the least telling first: `most_telling`), then the less telling result columns
    (`DROP_ORDER`), and cuts what is still too long."""
    if not rows:
        return "no plans in this store; compile one with: bt plan PRESET", []
    shown, results = list(keys), list(RESULT_COLUMNS)
    at = results.index("heldout_loss") + 1
    results[at:at] = suite_columns(rows)  # after the held-out loss, before the speed

    def draw(compact: bool) -> list[str]:
        short = short_names(shown) if compact else {k: k for k in shown}
        clip = (lambda t: _clip(t, CLIPPED_VALUE)) if compact else (lambda t: t)
        headers = ["plan", "name", *(short[k] for k in shown), *(HEADINGS.get(c, c) for c in results)]
        cells = [
            [
                row["hash"][:SHORT],
                clip(row["name"]),
                *(clip(cell(row["values"].get(k))) for k in shown),
                *(cell(result_value(row, c)) for c in results),
            ]
            for row in rows
        ]
        text = {0, 1} | ({len(headers) - 1} if results and results[-1] == "status" else set())
        return _render(headers, cells, text)

    def fits(lines: list[str]) -> bool:
        return width is None or max(map(len, lines)) <= width

    lines = draw(compact=False)
    if not fits(lines):
        lines = draw(compact=True)
    for key in reversed(most_telling(keys, rows)):  # the least telling config column first
        if fits(lines):
            break
        shown.remove(key)
        lines = draw(compact=True)
    for column in DROP_ORDER:
        if fits(lines):
            break
        results.remove(column)
        lines = draw(compact=True)
    if width is not None:
        lines = [_clip(line, width) for line in lines]
    return "\n".join(lines), [k for k in keys if k not in shown]


def table_json(keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**row, "values": dict(row["values"])} for row in rows]  # suites: {name: {accuracy, ...}}


RESULTS = ("train_loss", "heldout_loss", "bits_per_token", "tokens_per_s")  # what only a run gives
NOT_RUN = "not run"


def has_run(row: dict[str, Any]) -> bool:
    """Whether a plan has a result of its own: a built plan, or one with a loss or a speed. The
    steps of a plan never run can still be in the store (another plan's data step), with their
    wall time: shown for it, they would be numbers it never produced."""
    return row.get("status") == "built" or any(row.get(column) is not None for column in RESULTS)


def metrics_diff(store: Store, a: str, b: str) -> list[dict[str, Any]]:
    """The results of plan a and plan b side by side (`bt diff`), with the change where both have
    one; a plan that has not run has none (every value null, its status "not run")."""
    _, rows = metrics_rows(store, [a, b] if a != b else [a])
    before, after = (row if has_run(row) else {"status": NOT_RUN} for row in (rows[0], rows[-1]))
    out = []
    for column in RESULT_COLUMNS:
        old, new = before.get(column), after.get(column)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (old, new))
        out.append({"metric": column, "before": old, "after": new, "change": new - old if numeric else None})
    return out


def metrics_diff_text(entries: Sequence[dict[str, Any]]) -> str:
    """The metrics section of `bt diff`: only the rows that either plan has a value in."""
    status = next(e for e in entries if e["metric"] == "status")
    if status["before"] == NOT_RUN and status["after"] == NOT_RUN:
        return "metrics: neither plan has been run (bt run builds them)"
    shown = [e for e in entries if e["before"] is not None or e["after"] is not None]
    lines = ["metrics:"]
    width = max(len(HEADINGS[e["metric"]]) for e in shown)
    for entry in shown:
        change = entry["change"]
        delta = f"  ({change:+.4g})" if isinstance(change, float | int) and change else ""
        lines.append(
            f"  {HEADINGS[entry['metric']]:<{width}}  {cell(entry['before'])} -> {cell(entry['after'])}{delta}"
        )
    return "\n".join(lines)
