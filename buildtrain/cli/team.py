"""The commands of the team cache: `bt push`, `bt pull`, `bt ls --remote`, `bt show --remote`,
and where a command finds its remote (`--remote URL`, else $BT_REMOTE). Each is a thin call into
`executor/remote/remote.py`; nothing of the remote is imported by a command that was given none."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from buildtrain.cli.common import err, store_of
from buildtrain.errors import ExitCode, UsageError

if TYPE_CHECKING:
    from buildtrain.executor.remote.transfer import Transfer
    from buildtrain.plan.plan import Plan
    from buildtrain.store.remote.url import RemoteUrl
    from buildtrain.store.store import Store

ENVIRONMENT = "BT_REMOTE"


def remote_of(args: argparse.Namespace, *, required: bool = False) -> RemoteUrl | None:
    """`--remote URL`, else $BT_REMOTE; None when neither is set (UsageError when `required`)."""
    text = getattr(args, "remote", None) or os.environ.get(ENVIRONMENT) or None
    if text is None:
        if required:
            raise UsageError(
                f"no remote: give --remote URL or set {ENVIRONMENT} (s3://bucket/prefix or file:///path)"
            )
        return None
    from buildtrain.store.remote.url import parse_url

    return parse_url(text)


# A team's standing requirement, set beside BT_REMOTE: the trusted signers a pulled step needs.
MIN_ATTESTATIONS = "BT_MIN_ATTESTATIONS"


def min_attestations(args: argparse.Namespace) -> int:
    """`--min-attestations N`, else $BT_MIN_ATTESTATIONS, else 0 (a value that is no count: exit 2)."""
    given = getattr(args, "min_attestations", None)
    if given is not None:
        return int(given)
    text = os.environ.get(MIN_ATTESTATIONS, "").strip()
    if text and not text.isdigit():
        raise UsageError(f"{MIN_ATTESTATIONS}={text!r}: give a whole number of trusted signers (0: none)")
    return int(text or 0)


def _plans(args: argparse.Namespace, store: Store, url: RemoteUrl | None = None) -> list[Plan]:
    """The plans named as `bt run` takes them; with `url`, a full plan hash the store lacks is
    fetched from the remote first (checked against its hash)."""
    from buildtrain.plan.refs import resolve_targets

    if url is not None:
        fetch_plans(args.plans, store, url)
    with remote_hint(url):
        return [target.plan for target in resolve_targets(args.plans, store)]


@contextlib.contextmanager
def remote_hint(url: RemoteUrl | None) -> Iterator[None]:
    """A plan the store lacks, named by a prefix while a remote is set: say that a remote gives
    plans by their full hash (a prefix would mean listing every plan of the team)."""
    try:
        yield
    except UsageError as exc:
        if url is None or not str(exc).startswith("no plan "):
            raise
        raise UsageError(
            f"{exc}; or fetch it from the remote by its full hash (bt ls --remote {url} lists them)"
        ) from None


def fetch_plans(refs: list[str], store: Store, url: RemoteUrl) -> None:
    """Fetch each full plan hash among `refs` that the store lacks from the remote (checked
    against the hash), so a colleague's `bt run HASH` works from the hash alone."""
    from buildtrain.executor.remote.transfer import remote_plan
    from buildtrain.store.remote import keys

    for ref in refs:
        if keys.HASH.match(ref) and not store.plans.path(ref).exists():
            remote_plan(store, url, ref)


def _said(command: str, transfer: Transfer) -> int:
    for line in transfer.done:
        err(line)
    for line in transfer.problems:
        err(f"bt {command}: {line}")
    return transfer.code


def cmd_push(args: argparse.Namespace) -> int:
    from buildtrain.executor.remote.transfer import push_plans

    store, url = store_of(args), remote_of(args, required=True)
    assert url is not None
    return _said("push", push_plans(store, _plans(args, store), url))


def cmd_pull(args: argparse.Namespace) -> int:
    from buildtrain.executor.remote.transfer import pull_plans

    store, url = store_of(args), remote_of(args, required=True)
    assert url is not None
    return _said("pull", pull_plans(store, _plans(args, store, url), url, min_attestations(args)))


def ls_remote(args: argparse.Namespace) -> int:
    """`bt ls --remote`: the plans the remote holds, one `HASH  NAME` line each."""
    import json

    from buildtrain.executor.remote.transfer import remote_plans

    url = remote_of(args, required=True)
    assert url is not None
    rows = remote_plans(url)
    if args.json:
        print(json.dumps([{"plan": plan, "name": name} for plan, name in rows], indent=2))
    else:
        print("\n".join(f"{plan}  {name}" for plan, name in rows) if rows else f"(no plans on {url})")
    return ExitCode.OK


def show_remote(args: argparse.Namespace, plan: Plan) -> int:
    """`bt show PLAN --remote`: per step, whether the remote holds it and how many builds agree."""
    from buildtrain.executor.remote.transfer import remote_status

    url = remote_of(args, required=True)
    assert url is not None
    rows = remote_status(plan, url)
    if args.json:
        import json

        import attrs

        print(
            json.dumps(
                {"plan": plan.hash, "remote": str(url), "steps": [attrs.asdict(r) for r in rows]}, indent=2
            )
        )
        return ExitCode.OK
    width = max(len(row.label) for row in rows)
    print(f"plan {plan.hash[:12]} '{plan.name}' on {url}")
    for row in rows:
        print(f"  {row.label:<{width}}  {row.hash[:12]}  {row}")
    return ExitCode.OK
