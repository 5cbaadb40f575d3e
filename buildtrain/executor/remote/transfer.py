"""`bt push`, `bt pull`, `bt verify --push`, `bt ls --remote` and `bt show --remote`: one function
each, over the run's `RemoteCache` (`remote.py`) and the remote library. Every pulled byte is
checked; a store that pulled a step never attests it as its own build. Attestations (and
`cryptography`) are imported only by the functions that sign or count them."""

from __future__ import annotations

import json

import attrs

from buildtrain.errors import ExitCode, RemoteDamaged, UsageError
from buildtrain.executor.remote.remote import RemoteCache
from buildtrain.kinds import KINDS
from buildtrain.plan.plan import Plan, Step
from buildtrain.store import objects
from buildtrain.store.remote.remote import Remote
from buildtrain.store.remote.url import RemoteUrl
from buildtrain.store.store import Store


@attrs.frozen(kw_only=True)
class Transfer:
    """What `bt push` or `bt pull` did for the plans it was given."""

    done: list[str]  # "plan step: what" lines
    problems: list[str]
    code: int


def push_plans(store: Store, plans: list[Plan], url: RemoteUrl) -> Transfer:
    """Push every built step of the plans (and the plans); exit 4 on non-determinism."""
    cache, done, problems = RemoteCache(url, lambda *_: None), [], []
    codes: list[int] = []
    for plan in plans:
        for step in plan.steps:
            if not store.outputs.has(step.hash):
                done.append(f"{plan.hash[:12]} {step.label}: not built here, not pushed")
                continue
            report = cache.push(store, plan, step)
            if report.conflict:
                problems.append(f"{step.label}: non-determinism: {report.conflict}")
                codes.append(ExitCode.NOT_REPRODUCED)
            elif report.failed:
                problems.append(f"{step.label}: push failed: {report.failed}")
                codes.append(ExitCode.FAILED)
            else:
                done.append(
                    f"{plan.hash[:12]} {step.label}: pushed "
                    f"({report.uploaded} files, {report.bytes_uploaded / 1e6:.1f} MB uploaded)"
                )
    code = max(codes, default=ExitCode.OK)  # non-determinism (4) over a failed push (1)
    return Transfer(done=done, problems=problems, code=int(code))


def remote_plan(store: Store, url: RemoteUrl, plan_hash: str) -> None:
    """Pull a plan the local store lacks (by its full hash) from the remote, checked against it."""
    from buildtrain.plan.stored import save_plan

    def belongs(raw: bytes) -> str | None:
        try:
            plan = Plan.from_body(json.loads(raw), kinds=KINDS)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"not a plan: {exc}"
        return None if plan.hash == plan_hash else f"it is plan {plan.hash[:12]}"

    raw = RemoteCache(url, lambda *_: None).remote.pull_plan(plan_hash, belongs)
    if raw is None:
        raise UsageError(f"plan {plan_hash[:12]} is neither in {store.root} nor on {url}")
    save_plan(store, Plan.from_body(json.loads(raw), kinds=KINDS), pulled_from=str(url))


def pull_plans(store: Store, plans: list[Plan], url: RemoteUrl, min_attestations: int = 0) -> Transfer:
    """Pull every step of the plans the store lacks; exit 5 when one is damaged on the remote,
    4 when one has fewer than `min_attestations` agreeing builds, 1 when one is not there."""
    cache, done, problems = RemoteCache(url, lambda label, text: problems.append(f"{label}: {text}")), [], []
    codes: list[int] = []
    for plan in plans:
        for step in plan.steps:
            if store.outputs.has(step.hash) and not store.outputs.check(step.hash):
                done.append(f"{plan.hash[:12]} {step.label}: already here")
                continue
            refused = _too_few(cache, step, min_attestations)
            if refused:
                problems.append(refused)
                codes.append(ExitCode.NOT_REPRODUCED)
                continue
            with store.locks.hold(step.hash):
                before = len(problems)
                if cache.pull(store, step):
                    done.append(f"{plan.hash[:12]} {step.label}: pulled")
                elif len(problems) > before:
                    codes.append(ExitCode.CORRUPT)
                else:
                    problems.append(f"{step.label}: not on {url}")
                    codes.append(ExitCode.FAILED)
    code = ExitCode.CORRUPT if ExitCode.CORRUPT in codes else max(codes, default=ExitCode.OK)
    return Transfer(done=done, problems=problems, code=int(code))


def _too_few(cache: RemoteCache, step: Step, wanted: int) -> str | None:
    refused = cache.too_few_signers(step, wanted)
    if refused is None:
        return None
    return (
        f"{step.label}: {refused} (bt verify PLAN --push by a builder whose key you trust adds one; "
        "bt keys trust FILE --name NAME trusts a builder)"
    )


def attest_plan(store: Store, plan: Plan, url: RemoteUrl, labels: list[str]) -> list[str]:
    """After `bt verify` reproduced these steps: push each (if the remote lacks it) and attest it."""
    cache, lines = RemoteCache(url, lambda *_: None), []
    for step in plan.steps:
        if step.label not in labels or not store.outputs.has(step.hash):
            continue
        report = cache.push(store, plan, step, built_here=True)
        if report.failed or report.conflict:
            lines.append(f"{step.label}: not attested: {report.failed or report.conflict}")
            continue
        output = store.outputs.path(step.hash)
        counted = cache.tally(step, objects.sealed_digests(output), objects.sealed_files(output))
        lines.append(f"{step.label}: attested on {url} ({counted})")
    return lines


@attrs.frozen(kw_only=True)
class StepOnRemote:
    """What a remote holds of one step, for `bt show PLAN --remote`."""

    label: str
    hash: str
    on_remote: bool
    agreeing: int  # distinct trusted keys that signed the remote output's digests
    signers: list[str]  # their keyring names
    disagreements: list[str]  # non-determinism: each digest on which trusted builds differ
    ignored: dict[str, int]  # records that count 0, by why: unsigned, untrusted key, forged, ...

    def __str__(self) -> str:
        from buildtrain.store.remote import attest

        text = "not on the remote"
        if self.on_remote:
            names = f" ({', '.join(self.signers)})" if self.signers else ""
            text = f"on the remote, {attest.builders(self.agreeing)}{names}"
        for line in self.disagreements:
            text += f"; {line}"
        return text + (f"; {attest.ignored_line(self.ignored)}" if self.ignored else "")


def remote_status(plan: Plan, url: RemoteUrl) -> list[StepOnRemote]:
    """Per step: on the remote or not, and how many trusted builders agree with its output."""
    # Here, not at the top: a run with a remote imports this module, and a null build must not
    # load the signing library.
    from buildtrain.store.remote import attest, keyring

    remote, rows, trusted = Remote.open(url), [], keyring.load_keyring()
    for step in plan.steps:
        output = remote.output_declared(step.hash)
        found = attest.attestations(remote.backend, step.hash, trusted)
        counted = attest.tally(found, *(output or ({}, None)))
        agreeing = counted.agreeing if output is not None else {}
        rows.append(
            StepOnRemote(
                label=step.label,
                hash=step.hash,
                on_remote=output is not None,
                agreeing=len(agreeing),
                signers=sorted(agreeing.values()),
                disagreements=[str(found) for found in attest.disagreements(found)],
                ignored=counted.ignored,
            )
        )
    return rows


def remote_plans(url: RemoteUrl) -> list[tuple[str, str]]:
    """(plan hash, name) of each plan the remote holds (name '?' where its bytes do not decode)."""
    remote, rows = Remote.open(url), []
    for plan_hash in remote.plans():
        try:
            raw = remote.pull_plan(plan_hash, lambda *_: None)
            name = str(json.loads(raw or b"{}").get("name", "?"))
        except (RemoteDamaged, ValueError):
            name = "? (damaged)"
        rows.append((plan_hash, name))
    return rows
