"""`bt push`, `bt pull`, `bt verify --push`, `bt ls --remote` and `bt show --remote`: one function
each, over the run's `RemoteCache` (`remote.py`) and the remote library. Every pulled byte is
checked; a store that pulled a step never attests it as its own build."""

from __future__ import annotations

import json

import attrs

from buildtrain.errors import ExitCode, RemoteDamaged, UsageError
from buildtrain.executor.remote import RemoteCache
from buildtrain.plan.plan import Plan, Step
from buildtrain.store import objects
from buildtrain.store.remote import attest
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
            if not store.has_output(step.hash):
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
            plan = Plan.from_body(json.loads(raw))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"not a plan: {exc}"
        return None if plan.hash == plan_hash else f"it is plan {plan.hash[:12]}"

    raw = RemoteCache(url, lambda *_: None).remote.pull_plan(plan_hash, belongs)
    if raw is None:
        raise UsageError(f"plan {plan_hash[:12]} is neither in {store.root} nor on {url}")
    save_plan(store, Plan.from_body(json.loads(raw)), pulled_from=str(url))


def pull_plans(store: Store, plans: list[Plan], url: RemoteUrl, min_attestations: int = 0) -> Transfer:
    """Pull every step of the plans the store lacks; exit 5 when one is damaged on the remote,
    4 when one has fewer than `min_attestations` agreeing builds, 1 when one is not there."""
    cache, done, problems = RemoteCache(url, lambda label, text: problems.append(f"{label}: {text}")), [], []
    codes: list[int] = []
    for plan in plans:
        for step in plan.steps:
            if store.has_output(step.hash) and not store.check_output(step.hash):
                done.append(f"{plan.hash[:12]} {step.label}: already here")
                continue
            refused = _too_few(cache, step, min_attestations)
            if refused:
                problems.append(refused)
                codes.append(ExitCode.NOT_REPRODUCED)
                continue
            with store.lock(step.hash):
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
    if wanted <= 0:
        return None
    digests = cache.remote.output_digests(step.hash)
    if digests is None:
        return None  # not there, or damaged: the pull says which
    agreeing, total = cache.agreeing(step, digests)
    if agreeing >= wanted:
        return None
    return (
        f"{step.label}: {agreeing} of {total} recorded builds agree with the remote's output, "
        f"--min-attestations {wanted} asks for {wanted}: not pulled (bt verify PLAN --push adds one)"
    )


def attest_plan(store: Store, plan: Plan, url: RemoteUrl, labels: list[str]) -> list[str]:
    """After `bt verify` reproduced these steps: push each (if the remote lacks it) and attest it."""
    cache, lines = RemoteCache(url, lambda *_: None), []
    for step in plan.steps:
        if step.label not in labels or not store.has_output(step.hash):
            continue
        report = cache.push(store, plan, step, built_here=True)
        if report.failed or report.conflict:
            lines.append(f"{step.label}: not attested: {report.failed or report.conflict}")
            continue
        agreeing, total = cache.agreeing(step, objects.sealed_digests(store.output(step.hash)))
        lines.append(f"{step.label}: attested on {url} ({agreeing} of {total} builds agree)")
    return lines


@attrs.frozen(kw_only=True)
class StepOnRemote:
    """What a remote holds of one step, for `bt show PLAN --remote`."""

    label: str
    hash: str
    on_remote: bool
    agreeing: int  # recorded builds whose digests are the remote output's
    builds: int  # recorded builds, agreeing or not
    disagreements: list[str]  # non-determinism: each digest on which recorded builds differ
    damaged: int  # attestations that do not verify (not counted)

    def __str__(self) -> str:
        text = (
            f"on the remote, {self.agreeing} of {self.builds} builds agree"
            if self.on_remote
            else "not on the remote"
        )
        for line in self.disagreements:
            text += f"; {line}"
        return text + (f"; {self.damaged} damaged attestation(s) not counted" if self.damaged else "")


def remote_status(plan: Plan, url: RemoteUrl) -> list[StepOnRemote]:
    """Per step: on the remote or not, and how many recorded builds agree with its output."""
    remote, rows = Remote.open(url), []
    for step in plan.steps:
        digests = remote.output_digests(step.hash)
        records, problems = attest.attestations(remote.backend, step.hash)
        rows.append(
            StepOnRemote(
                label=step.label,
                hash=step.hash,
                on_remote=digests is not None,
                agreeing=attest.agreeing(records, digests) if digests is not None else 0,
                builds=len(records),
                disagreements=[str(found) for found in attest.disagreements(records)],
                damaged=len(problems),
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
