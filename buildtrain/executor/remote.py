"""A run's side of the team cache: pull a step from the remote instead of building it, push what
was built, hold the remote lease while building, attest builds; and `bt push`/`bt pull` by hand.

The remote is opened on first use only, so a null build with `--remote` never loads the S3
client, and nothing here is imported without a remote. A remote never decides a result: every
pulled byte is checked by the library (`store/remote/remote.py`) and re-hashed by the store
before its first use; a damaged or foreign object is named and the step is built locally; a push
that fails is a warning (the local result is good); a push that finds a different result on the
remote is non-determinism, reported and never overwritten.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.errors import BuildtrainError, ExitCode, Locked, RemoteDamaged, UsageError
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.store import evals, layout, objects
from buildtrain.store.remote import attest, leases
from buildtrain.store.remote.backend import RemoteUnavailable
from buildtrain.store.remote.remote import Remote
from buildtrain.store.remote.url import RemoteUrl, parse_url
from buildtrain.store.store import Store

# A builder's lease on a step lasts this long and is renewed every third of it; a waiter polls the
# remote this often. A machine that dies while building delays the others by at most LEASE_S.
LEASE_S = 60.0
POLL_S = 0.5
# A training step's checkpoint folder is looked at this often for a new checkpoint to push.
CHECKPOINT_POLL_S = 1.0

Say = Callable[[str, str], None]  # (step label, what happened), as Reporter.step


def remote_url(option: str | None) -> RemoteUrl | None:
    """`--remote URL`, else $BT_REMOTE, else None (no remote: nothing of it is imported)."""
    text = option or os.environ.get("BT_REMOTE") or None
    return parse_url(text) if text else None


class NotAttested(BuildtrainError):
    """`bt pull --min-attestations N` found fewer agreeing independent builds."""

    exit_code = ExitCode.NOT_REPRODUCED


@attrs.frozen(kw_only=True)
class PushReport:
    """What pushing one step came to: None problems when all went well."""

    step: str
    uploaded: int = 0
    bytes_uploaded: int = 0
    conflict: str | None = None  # two builds of the step disagree (non-determinism)
    failed: str | None = None  # the push could not be done (the local result stays good)


class RemoteCache:
    """One run's (or command's) remote: opened lazily, shared by its steps."""

    def __init__(self, url: RemoteUrl, say: Say) -> None:
        self.url = url
        self.say = say
        self._remote: Remote | None = None
        self._plans_pushed: set[str] = set()
        self.holder = leases.holder_id()
        self._lease: leases.Lease | None = None  # the newest renewal of the lease held
        self.on_lost: Callable[[], None] = _stop_this_run
        self.offline = False  # the remote could not be reached: the rest of the run builds locally

    @property
    def remote(self) -> Remote:
        if self._remote is None:
            self._remote = Remote.open(self.url)
        return self._remote

    # -- pulling ----------------------------------------------------------------------------------

    def pull(self, store: Store, step: Step) -> bool:
        """Pull the step's output into the store (caller holds the step's lock, no intact local
        output); False when the remote lacks it or it is damaged (named through `say`)."""
        try:
            found = self.remote.pull_output(store, step.hash)
        except RemoteDamaged as exc:
            self.say(step.label, str(exc))
            return False
        if found is None:
            return False
        problems = store.check_output(step.hash)  # re-hashed in full once, and stamped
        if problems:
            store.quarantine(step.hash)
            self.say(step.label, f"pulled output does not verify ({problems[0]}); building it")
            return False
        self._pull_entry(store, step)
        return True

    def _pull_entry(self, store: Store, step: Step) -> None:
        """An evaluation's cache entry comes with its step (other plans here then reuse it); a
        damaged or foreign one is named and left out (the step's own output is what counts)."""
        key = evals.key_of_output(store.output(step.hash))
        if key is None or evals.entry_problem(store.eval_path(key), key)[0] is not None:
            return
        try:
            raw = self.remote.pull_eval(key, lambda raw: _entry_check(key, raw))
        except RemoteDamaged as exc:
            self.say(step.label, str(exc))
            return
        if raw is not None:
            if os.path.lexists(store.eval_path(key)):
                store.set_aside(store.eval_path(key))
            store.replace_file(store.eval_path(key), raw)

    # -- pushing ----------------------------------------------------------------------------------

    def push(self, store: Store, plan: Plan, step: Step, *, built_here: bool = False) -> PushReport:
        """Push a built step (and its plan, once), then attest the build: always when `built_here`
        (a run built it, a verify reproduced it), else only when the remote did not already hold
        this result (a store that pulled a step must not count as one more build of it). Never
        raises for the remote: a failure comes back in `failed`."""
        try:
            if plan.hash not in self._plans_pushed:
                self.remote.push_plan(plan.hash, canonical_bytes(plan.to_body()))
                self._plans_pushed.add(plan.hash)
            pushed = self.remote.push_output(store, step.hash)
            key = evals.key_of_output(store.output(step.hash))  # an evaluation's cache entry
            if key is not None and evals.entry_problem(store.eval_path(key), key)[0] is not None:
                self.remote.push_eval(key, store.eval_path(key).read_bytes())
            if built_here or pushed.manifest != "present":
                self.attest(store, step)
        except (BuildtrainError, OSError, ValueError) as exc:
            return PushReport(step=step.label, failed=str(exc))
        return PushReport(
            step=step.label,
            uploaded=pushed.uploaded,
            bytes_uploaded=pushed.bytes_uploaded,
            conflict=pushed.conflict,
        )

    def attest(self, store: Store, step: Step) -> None:
        """Record this machine's build of a step (its output's digests) on the remote."""
        record = attest.Attestation(
            step=step.hash,
            machine=os.environ.get("BT_MACHINE") or socket.gethostname(),
            toolchain=digest("toolchain", step.toolchain),
            built_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds"),
            digests=objects.sealed_digests(store.output(step.hash)),
        )
        attest.attest(self.remote.backend, record)

    def agreeing(self, step: Step, digests: dict[str, str]) -> tuple[int, int]:
        """(builds that report these digests, all builds recorded) for a step."""
        records, _ = attest.attestations(self.remote.backend, step.hash)
        return attest.agreeing(records, digests), len(records)

    # -- a step's turn -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def turn(self, store: Store, step: Step, *, wait: bool = True) -> Iterator[bool]:
        """The caller holds the step's local lock and found no local output: pull it (yields
        False: nothing to build), else yield True holding the remote lease while it builds. A
        remote that cannot be reached is one line, and the run goes on without it."""
        try:
            pulled = not self.offline and self.pull(store, step)
        except RemoteUnavailable as exc:
            self.say(step.label, f"warning: {exc}; building locally, without the remote, from here on")
            self.offline, pulled = True, False
        if self.offline:
            yield True
            return
        if pulled:
            yield False
            return
        with self.building(store, step, wait=wait) as build:
            if not build or not kind_of(step.kind).resumable:
                yield build
                return
            with self.checkpoints(store, step):
                yield True

    # -- checkpoints: resume anywhere ---------------------------------------------------------------

    @contextlib.contextmanager
    def checkpoints(self, store: Store, step: Step) -> Iterator[None]:
        """Around a resumable step's build: with no local checkpoint, start from the newest one on
        the remote that verifies; while it runs, push each new checkpoint it keeps (from a thread
        of this process: the step process never waits for the network)."""
        folder = store.checkpoints_dir(step.hash)
        if not _newest(folder):
            folder.mkdir(parents=True, exist_ok=True)
            pulled, problems = self.remote.pull_newest_checkpoint(store, step.hash, folder)
            for problem in problems:
                self.say(step.label, problem)
            if pulled is not None:
                self.say(step.label, f"resuming from {pulled.name} pulled from {self.url}")
        stop = threading.Event()
        pusher = threading.Thread(target=self._push_checkpoints, args=(folder, step, stop), daemon=True)
        pusher.start()
        try:
            yield
        finally:
            stop.set()
            pusher.join()

    def _push_checkpoints(self, folder: Path, step: Step, stop: threading.Event) -> None:
        pushed: str | None = None
        while not stop.wait(CHECKPOINT_POLL_S):
            newest = _newest(folder)
            if newest is None or newest.name == pushed:
                continue
            try:
                self.remote.push_checkpoint(step.hash, newest)
                pushed = newest.name
            except (BuildtrainError, OSError, ValueError):
                continue  # pruned or moved aside meanwhile, or a passing network problem

    def report_push(self, store: Store, plan: Plan, step: Step, event: Callable[..., None]) -> None:
        """Push a step this run built; a failure or a conflict is one line, never a failed step."""
        if self.offline:
            return
        report = self.push(store, plan, step, built_here=True)
        if report.conflict:
            self.say(step.label, f"non-determinism: {report.conflict}; the remote's result was kept")
            event("remote_conflict", step=step.label, hash=step.hash, conflict=report.conflict)
        elif report.failed:
            self.say(step.label, f"warning: not pushed to {self.url} ({report.failed}); kept locally")
            event("remote_push_failed", step=step.label, hash=step.hash, problem=report.failed)
        else:
            event("remote_pushed", step=step.label, hash=step.hash, bytes=report.bytes_uploaded)

    # -- leases -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def building(self, store: Store, step: Step, *, wait: bool = True) -> Iterator[bool]:
        """Hold the remote lease on a step while the caller builds it. Yields False when, while
        waiting for another builder's lease, its result arrived and was pulled (nothing to build);
        without `wait` (`--no-wait`), another builder's lease raises Locked (exit 7)."""
        backend, waiting = self.remote.backend, False
        while True:
            lease = leases.take(backend, step.hash, self.holder, LEASE_S)
            mine = lease.holder == self.holder
            # Checked again after each take: a builder pushes, then releases its lease.
            if self.remote.has_output(step.hash) and self.pull(store, step):
                if mine:
                    leases.release(backend, lease)
                yield False
                return
            if mine:
                break
            if not wait:
                raise Locked(
                    f"{step.label}: {lease.holder} is building this step (remote lease on {self.url}); "
                    "run again without --no-wait to wait for it and pull its result"
                )
            if not waiting:
                self.say(step.label, f"waiting: {lease.holder} is building this step (remote lease)")
                waiting = True
            time.sleep(POLL_S)
        self._lease = lease
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(stop, step), daemon=True)
        renewer.start()
        try:
            yield True
        finally:
            stop.set()
            renewer.join()
            with contextlib.suppress(BuildtrainError, OSError):
                leases.release(backend, self._lease or lease)

    def _renew(self, stop: threading.Event, step: Step) -> None:
        """Renew every third of the lease; on a lost lease stop the step (SIGTERM to this bt,
        which the step process receives as an interruption: it checkpoints and exits 3)."""
        while not stop.wait(LEASE_S / 3):
            try:
                assert self._lease is not None
                self._lease = leases.renew(self.remote.backend, self._lease, LEASE_S)
            except leases.LeaseLost as exc:
                self.say(step.label, str(exc))
                self.on_lost()
                return
            except (BuildtrainError, OSError):
                continue  # a passing network problem: try again at the next renewal


def _entry_check(key: str, raw: bytes) -> str | None:
    """Whether bytes from the remote are the sealed evaluation entry of `key` (None: they are)."""
    import json

    try:
        entry = json.loads(raw)
        body = {"identity": entry["identity"], "result": entry["result"]}
        return None if evals.seal_entry(key, body) == raw else "it does not match its seal or key"
    except (ValueError, KeyError, TypeError):
        return "not an evaluation entry"


def _newest(folder: Path) -> Path | None:
    """The newest finished checkpoint folder (`step-NNNNNN`; hidden ones are being written)."""
    found = [path for _, path in layout.newest_first(folder.iterdir() if folder.is_dir() else ())]
    return next((path for path in found if path.is_dir() and not path.is_symlink()), None)


def _stop_this_run() -> None:
    """SIGTERM to this bt: `spawn` forwards it to the step process, which checkpoints and exits,
    and the run ends as interrupted (exit 3); `bt run` again resumes."""
    os.kill(os.getpid(), signal.SIGTERM)


# -- bt push, bt pull, bt ls --remote ---------------------------------------------------------------


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
    import json

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
    import json

    remote, rows = Remote.open(url), []
    for plan_hash in remote.plans():
        try:
            raw = remote.pull_plan(plan_hash, lambda *_: None)
            name = str(json.loads(raw or b"{}").get("name", "?"))
        except (RemoteDamaged, ValueError):
            name = "? (damaged)"
        rows.append((plan_hash, name))
    return rows
