"""`bt fsck`: re-hash every object in the store and say what each damaged one breaks.

Objects are plans (their bytes must hash to their name), step outputs and checkpoints (every file
against its sealed manifest, the manifest against its own digest) and evaluation results (their
identity must hash to their name). A damaged object is reported with the plans and steps that
reference it; `bt run` quarantines and rebuilds a damaged output instead of loading it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from buildtrain.errors import ExitCode
from buildtrain.plan.canonical import digest
from buildtrain.store import objects
from buildtrain.store.store import Store


def _referrers(store: Store) -> dict[str, list[str]]:
    """Step hash -> 'label in plan PREFIX' for every loadable plan."""
    found: dict[str, list[str]] = {}
    for plan_hash in store.plan_hashes():
        try:
            plan = store.load_plan(plan_hash)
        except Exception:  # reported as a damaged plan below
            continue
        for step in plan.steps:
            found.setdefault(step.hash, []).append(f"{step.label} of plan {plan_hash[:12]} '{plan.name}'")
    return found


def check(store: Store) -> tuple[list[dict[str, Any]], int]:
    """(damaged objects, number of objects checked)."""
    damaged: list[dict[str, Any]] = []
    checked = 0
    referrers = _referrers(store)

    for plan_hash in store.plan_hashes():
        checked += 1
        try:
            store.load_plan(plan_hash)
        except Exception as exc:  # CorruptObject, or a plan file that no longer parses
            damaged.append(
                {
                    "object": f"plans/{plan_hash}.json",
                    "kind": "plan",
                    "problems": [str(exc)],
                    "referenced_by": [],
                }
            )

    for output in sorted(store.steps.glob("*")) if store.steps.is_dir() else []:
        checked += 1
        problems = objects.verify(output)
        if problems:
            damaged.append(
                {
                    "object": f"steps/{output.name}",
                    "kind": "step output",
                    "problems": problems,
                    "referenced_by": referrers.get(output.name, ["no stored plan"]),
                }
            )

    for folder in sorted(store.work.glob("*/checkpoints/step-*")) if store.work.is_dir() else []:
        checked += 1
        problems = objects.verify(folder)
        if problems:
            step_hash = folder.parent.parent.name
            damaged.append(
                {
                    "object": str(folder.relative_to(store.root)),
                    "kind": "checkpoint",
                    "problems": problems,
                    "referenced_by": referrers.get(step_hash, ["no stored plan"]),
                    "note": "resume skips it and falls back to an older checkpoint",
                }
            )

    for result in sorted(store.evals.glob("*.json")) if store.evals.is_dir() else []:
        checked += 1
        try:
            body = json.loads(result.read_bytes())
            ok = digest("eval", body["identity"]) == result.stem
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            damaged.append(
                {
                    "object": f"evals/{result.name}",
                    "kind": "evaluation result",
                    "problems": ["content does not match its key"],
                    "referenced_by": [],
                }
            )
    return damaged, checked


def fsck(store: Store, json_output: bool = False) -> int:
    if not store.root.is_dir():
        print(f"bt fsck: no store at {store.root}", file=sys.stderr)
        return ExitCode.OK
    damaged, checked = check(store)
    cache = store.stat_cache()
    if json_output:
        print(
            json.dumps(
                {
                    "store": str(store.root),
                    "checked": checked,
                    "damaged": damaged,
                    "stat_cache_damaged": cache.damaged,
                },
                indent=2,
            )
        )
    for item in damaged:
        print(f"damaged {item['kind']}: {item['object']}", file=sys.stderr)
        for problem in item["problems"][:5]:
            print(f"    {problem}", file=sys.stderr)
        for referrer in item["referenced_by"]:
            print(f"    used by {referrer}", file=sys.stderr)
        if item.get("note"):
            print(f"    {item['note']}", file=sys.stderr)
    if cache.damaged:
        print(
            "note: the source stat cache was damaged; it is discarded and rebuilt (no digest is trusted from it)",
            file=sys.stderr,
        )
    verdict = f"{len(damaged)} damaged" if damaged else "all intact"
    print(f"bt fsck: {checked} objects checked in {store.root}: {verdict}", file=sys.stderr)
    if damaged:
        print(
            "bt run rebuilds damaged step outputs (moved to quarantine/); bt gc removes what no plan needs",
            file=sys.stderr,
        )
    return ExitCode.CORRUPT if damaged else ExitCode.OK
