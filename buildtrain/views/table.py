"""`bt ls --metrics`: one row per plan with the values that tell the listed plans apart and their results.

A column of config appears only where the listed plans differ (the sweep axes, in practice), so a
grid of learning rates reads as a grid of learning rates, not as sixty identical settings.
"""

from __future__ import annotations

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
    store: Store, plan_hashes: Sequence[str] | None = None
) -> tuple[list[str], list[dict[str, Any]]]:
    """(differing keys, rows) for the given plans (default: every stored plan)."""
    hashes = list(plan_hashes) if plan_hashes is not None else store.plan_hashes()
    rows, cards = [], []
    for plan_hash in hashes:
        card = load_card(store, plan_hash)
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


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def table_text(keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "no plans in this store; compile one with: bt plan PRESET"
    headers = ["plan", "name", *keys, *(HEADINGS[c] for c in RESULT_COLUMNS)]
    cells = [
        [
            row["hash"][:SHORT],
            row["name"],
            *(cell(row["values"].get(k)) for k in keys),
            *(cell(row.get(c)) for c in RESULT_COLUMNS),
        ]
        for row in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    text_columns = {0, 1, len(headers) - 1}

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if i in text_columns else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), *(line(c) for c in cells)])


def table_json(keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**row, "values": dict(row["values"])} for row in rows]


def metrics_diff(store: Store, a: str, b: str) -> list[dict[str, Any]]:
    """The results of plan a and plan b side by side (`bt diff`), with the change where both have one."""
    _, rows = metrics_rows(store, [a, b] if a != b else [a])
    before, after = rows[0], rows[-1]
    out = []
    for column in RESULT_COLUMNS:
        old, new = before.get(column), after.get(column)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (old, new))
        out.append({"metric": column, "before": old, "after": new, "change": new - old if numeric else None})
    return out


def metrics_diff_text(entries: Sequence[dict[str, Any]]) -> str:
    """The metrics section of `bt diff`; empty while neither plan has a result to compare."""
    if all(e["before"] is None and e["after"] is None for e in entries if e["metric"] != "status"):
        return ""
    lines = ["metrics:"]
    width = max(len(HEADINGS[e["metric"]]) for e in entries)
    for entry in entries:
        change = entry["change"]
        delta = f"  ({change:+.4g})" if isinstance(change, float | int) and change else ""
        lines.append(
            f"  {HEADINGS[entry['metric']]:<{width}}  {cell(entry['before'])} -> {cell(entry['after'])}{delta}"
        )
    return "\n".join(lines)
