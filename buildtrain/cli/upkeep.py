"""The commands that look after the store and the run records: `bt fsck` (re-hash every object,
repair) and `bt gc` (remove what no plan needs, prune records). Neither imports torch, a step or
the executor; building and running are `commands.py`'s."""

from __future__ import annotations

import argparse

from buildtrain.cli.commands import experiments
from buildtrain.cli.common import err, store_of
from buildtrain.errors import ExitCode, UsageError


def cmd_fsck(args: argparse.Namespace) -> int:
    import json

    from buildtrain.verify.fsck import fsck

    store = store_of(args)
    report = fsck(store, fix=args.repair)
    if report is None:
        err(f"bt fsck: no store at {store.root}")
        return ExitCode.OK
    if args.json:
        body = {
            "store": report.store,
            "checked": report.checked,
            "damaged": [item.to_json() for item in report.damaged],
            "repaired": report.repaired,
            "not_repaired": report.not_repaired,
        }
        print(json.dumps(body, indent=2))
    for item in report.damaged:
        err(f"damaged {item.kind}: {item.object}")
        for problem in item.problems[:5]:
            err(f"    {problem}")
        for referrer in item.referenced_by:
            err(f"    used by {referrer}")
        if item.note:
            err(f"    {item.note}")
    for line in report.repaired:
        err(f"repaired {line}")
    for line in report.not_repaired:
        err(f"not repaired {line}")
    verdict = f"{len(report.damaged)} damaged" if report.damaged else "all intact"
    err(f"bt fsck: {report.checked} objects checked in {store.root}: {verdict}")
    if report.damaged and not args.repair:
        err(
            "bt fsck --repair moves every damaged object to quarantine/; then bt run rebuilds what "
            "a plan needs (a damaged plan: bt plan PRESET again)"
        )
    elif report.damaged and not report.not_repaired:
        err("repaired: bt run rebuilds what a plan needs; bt gc removes the quarantine")
        return ExitCode.OK
    return ExitCode.CORRUPT if report.damaged else ExitCode.OK


def cmd_gc(args: argparse.Namespace) -> int:
    if args.records or args.keep is not None:
        return _gc_records(args)
    from buildtrain.verify.gc import collect

    store = store_of(args)
    report = collect(store, drop=args.drop, dry_run=args.dry_run)
    for line in report.warnings:
        err(f"warning: {line}")
    for plan_hash in report.dropped:
        err(f"{'would drop' if args.dry_run else 'dropped'} plan {plan_hash[:12]}")
    for path in report.removed:
        err(f"{'would remove' if args.dry_run else 'removed'} {path}")
    for line in report.left:
        err(f"could not remove {line}")
    if report.busy:
        err("note: a bt run holds a step lock; work and temporary folders were left alone")
    err(
        f"bt gc: {'would free' if args.dry_run else 'freed'} {report.freed / 1e6:.1f} MB "
        f"in {len(report.removed)} item(s)"
    )
    return ExitCode.FAILED if report.left else ExitCode.OK


def _gc_records(args: argparse.Namespace) -> int:
    from buildtrain.verify.records import prune_records

    if args.drop:
        raise UsageError(
            "--drop forgets plans in the store; bt gc --records prunes run records: give one of them"
        )
    folder = experiments(args)
    pruned = prune_records(folder, args.keep, dry_run=args.dry_run)
    for path in pruned.removed:
        err(f"{'would remove' if args.dry_run else 'removed'} {path}")
    for line in pruned.left:
        err(f"could not remove {line}")
    err(
        f"bt gc: {'would free' if args.dry_run else 'freed'} {pruned.freed / 1e6:.1f} MB in "
        f"{len(pruned.removed)} run record(s) of {folder}; {pruned.kept} kept"
    )
    return ExitCode.FAILED if pruned.left else ExitCode.OK
