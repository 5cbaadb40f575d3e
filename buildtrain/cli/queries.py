"""The commands that read and show what is stored: `bt show`, `bt diff`, `bt ls`, `bt report` and
`bt why`. None imports torch or the executor; the tables read small per-plan cards."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from buildtrain.cli.commands import experiments, plan_named
from buildtrain.cli.common import err, store_of
from buildtrain.errors import ExitCode, UsageError
from buildtrain.plan.stored import load_plan
from buildtrain.store.store import Store


def cmd_show(args: argparse.Namespace) -> int:
    from buildtrain.views.text import show_json, show_text

    store = store_of(args)
    plan = load_plan(store, args.plan)
    if args.remote is not None:
        from buildtrain.cli.team import show_remote

        return show_remote(args, plan)
    if args.lineage:
        from buildtrain.views.lineage import lineage, lineage_text

        nodes = lineage(store, plan)
        print(json.dumps(nodes, indent=2) if args.json else lineage_text(plan, nodes))
        return ExitCode.OK
    print(show_json(store, plan) if args.json else show_text(store, plan))
    return ExitCode.OK


def cmd_why(args: argparse.Namespace) -> int:
    from buildtrain.views.lineage import why, why_text

    result = why(store_of(args), args.digest)
    print(json.dumps(result, indent=2) if args.json else why_text(result))
    return ExitCode.OK if result["found"] else ExitCode.USAGE


def cmd_diff(args: argparse.Namespace) -> int:
    from buildtrain.plan.diff import diff_plans
    from buildtrain.views.table import metrics_diff, metrics_diff_text
    from buildtrain.views.text import diff_json, diff_text

    store = store_of(args)
    a, b = plan_named(store, args.plan_a), plan_named(store, args.plan_b)
    changes, steps = diff_plans(a, b)
    metrics = metrics_diff(store, a.hash, b.hash)
    if args.json:
        print(json.dumps({**json.loads(diff_json(a, b, changes, steps)), "metrics": metrics}, indent=2))
    else:
        section = metrics_diff_text(metrics)
        print(diff_text(a, b, changes, steps) + ("\n" + section if section else ""))
    return ExitCode.OK


def selected_plans(args: argparse.Namespace, store: Store) -> list[str] | None:
    """The plans `bt ls PLAN... --name GLOB` lists, in order (None: every stored plan). A PLAN is
    what `bt run` takes: a hash or prefix, a stored sweep, a sweep file, a preset."""
    if not args.plans:
        return None
    from buildtrain.plan.refs import resolve_targets

    return [target.plan.hash for target in resolve_targets(args.plans, store)]


def output_width() -> int | None:
    """The width to fit a table in: $COLUMNS, else the terminal's; None when stdout is not a
    terminal (a file or a pipe gets every column)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def cmd_ls(args: argparse.Namespace) -> int:
    if args.remote is not None:
        from buildtrain.cli.team import ls_remote

        return ls_remote(args)
    store = store_of(args)
    hashes = selected_plans(args, store)
    if args.metrics or args.sort:
        from buildtrain.views.table import fitted_table, metrics_rows, sort_rows, table_json

        keys, rows = metrics_rows(store, hashes, args.name)
        if not rows and args.name is not None and not args.json:
            return _none_named(args.name)
        rows = sort_rows(rows, keys, args.sort)
        if args.json:
            print(json.dumps(table_json(keys, rows), indent=2))
            return ExitCode.OK
        text, hidden = fitted_table(keys, rows, output_width())
        print(text)
        if hidden:
            err(
                f"bt ls: {len(hidden)} config column(s) left out to fit {output_width()} columns "
                f"({', '.join(hidden[:3])}{', ...' if len(hidden) > 3 else ''}); "
                "list fewer plans, use a wider terminal or --json"
            )
        return ExitCode.OK
    from buildtrain.views.text import ls_rows, ls_text

    listed = named(ls_rows(store, hashes), args.name)
    if not listed and args.name is not None and not args.json:
        return _none_named(args.name)
    print(json.dumps(listed, indent=2) if args.json else ls_text(listed))
    return ExitCode.OK


def _none_named(pattern: str) -> int:
    err(f"bt ls: no plan is named like {pattern!r} (bt ls lists them all)")
    return ExitCode.OK


def named(rows: list[dict[str, Any]], pattern: str | None) -> list[dict[str, Any]]:
    """The rows whose plan name matches the shell-style pattern (all when None)."""
    return rows if pattern is None else [row for row in rows if fnmatch.fnmatchcase(row["name"], pattern)]


def cmd_report(args: argparse.Namespace) -> int:
    from buildtrain.sources.durable import write_bytes_durably
    from buildtrain.views.html import build_report

    store = store_of(args)
    hashes = (
        list(dict.fromkeys(store.plans.resolve(ref) for ref in args.plans))
        if args.plans
        else store.plans.hashes()
    )
    if not hashes:
        raise UsageError(f"no plans in the store {store.root}; compile one with: bt plan PRESET")
    out = Path(args.output)
    page, pngs = build_report(store, hashes, experiments(args), Path(args.png) if args.png else None)
    write_bytes_durably(out, page.encode())
    print(out)
    for path in pngs:
        print(path)
    return ExitCode.OK
