"""A run's side of the team cache: pull a step from the remote instead of building it, push what
was built, hold the remote lease while building, attest builds; and `bt push`/`bt pull` by hand.

The remote is opened on first use only, so a null build with `--remote` never loads the S3
client, and nothing here is imported without a remote. A remote never decides a result: every
pulled byte is checked by the library (`store/remote/remote.py`) and re-hashed by the store
before its first use; a damaged or foreign object is named and the step is built locally; a push
that fails is a warning (the local result is good); a push that finds a different result on the
remote is non-determinism, reported and never overwritten. A resumable step's checkpoints go
through the remote in `executor/remote/remote_checkpoints.py`.
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
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.canonical import digest
from buildtrain.errors import BuildtrainError, Locked, RemoteDamaged, RemoteUnavailable
from buildtrain.executor.remote.remote_checkpoints import SharedCheckpoints
from buildtrain.kinds import kind_of
from buildtrain.kinds.kind import stored_problems
from buildtrain.plan.plan import Plan, Step
from buildtrain.store import evals, layout, objects
from buildtrain.store.remote import leases
from buildtrain.store.remote.remote import Remote
from buildtrain.store.remote.url import RemoteUrl
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.store.remote.attest import Tally

# A builder's lease on a step lasts this long and is renewed every third of it; a waiter polls the
# remote this often. A machine that dies while building delays the others by at most LEASE_S.
LEASE_S = 60.0
POLL_S = 0.5

Say = Callable[[str, str], None]  # (step label, what happened), as Reporter.step


@attrs.frozen(kw_only=True)
class PushReport:
    """What pushing one step came to: None problems when all went well."""

    step: str
    uploaded: int = 0
    bytes_uploaded: int = 0
    conflict: str | None = None  # two builds of the step disagree (non-determinism)
    failed: str | None = None  # the push could not be done (the local result stays good)


class RemoteCache(SharedCheckpoints):
    """One run's (or command's) remote: opened lazily, shared by its steps."""

    def __init__(self, url: RemoteUrl, say: Say, min_attestations: int = 0) -> None:
        self.url = url
        self.say = say
        self.min_attestations = min_attestations  # trusted signers a pulled output needs (0: none)
        self._said: set[tuple[str, str]] = set()
        self._pushed: dict[str, set[str]] = {}  # checkpoint names pushed, by step hash
        self._remote: Remote | None = None
        self._plans_pushed: set[str] = set()
        self.holder = leases.holder_id()
        self._lease: leases.Lease | None = None  # the newest renewal of the lease held
        self.on_lost: Callable[[], None] = _stop_this_run
        self.offline = False  # the remote could not be reached: the rest of the run builds locally
        self.resumed: set[str] = set()  # steps whose build started from a pulled checkpoint

    @property
    def remote(self) -> Remote:
        if self._remote is None:
            self._remote = Remote.open(self.url)
        return self._remote

    # -- pulling ----------------------------------------------------------------------------------

    def pull(self, store: Store, step: Step, *, pinned: str | None = None) -> bool:
        """Pull the step's output into the store (caller holds the step's lock, no intact local
        output); False when the remote lacks it, it is damaged, or fewer trusted builders than
        required signed it (each named through `say`). `pinned` (a manifest's own digest): only
        that build is taken, and no signer is counted: the run that pins it holds or built it,
        under its own requirement (a node's inputs, a node's output collected)."""
        refused = self.too_few_signers(step) if pinned is None else None
        if refused is not None:
            self.say_once(step, f"{refused}; building it here")
            return False
        kind = kind_of(step.kind)

        def accept(folder: Path) -> str | None:
            # Its seal is unkeyed: a declared digest counts only once the bytes give it again.
            problems = stored_problems(kind, step.hash, folder, step.config)
            return problems[0] if problems else None

        try:
            found = self.remote.pull_output(store, step.hash, pinned=pinned, accept=accept)
        except RemoteDamaged as exc:
            self.say(step.label, str(exc))
            return False
        if found is None:
            return False
        problems = store.outputs.check(step.hash)  # hashed as it came in: stamped by the pull
        if problems:
            store.outputs.quarantine(step.hash)
            self.say(step.label, f"pulled output does not verify ({problems[0]}); building it")
            return False
        self._pull_entry(store, step)
        return True

    def say_once(self, step: Step, text: str) -> None:
        """Say `text` of a step once per run (a step's turn asks the remote twice: before and
        after taking its lease)."""
        if (step.hash, text) not in self._said:
            self._said.add((step.hash, text))
            self.say(step.label, text)

    def _pull_entry(self, store: Store, step: Step) -> None:
        """An evaluation's cache entry comes with its step (other plans here then reuse it); a
        damaged or foreign one is named and left out (the step's own output is what counts)."""
        for key in evals.keys_of_output(store.outputs.path(step.hash)):
            if evals.entry_problem(store.results.eval_path(key), key)[0] is None:
                self._pull_key(store, step, key)

    def _pull_key(self, store: Store, step: Step, key: str) -> None:
        # An entry is reused by other plans: it must hold what the step's own result (its
        # digest re-derived) holds under that key, not merely be sealed.
        recorded = evals.output_entries(store.outputs.path(step.hash)).get(key)
        try:
            raw = self.remote.pull_eval(key, lambda raw: _entry_check(key, raw, recorded))
        except RemoteDamaged as exc:
            self.say(step.label, str(exc))
            return
        if raw is not None:
            if os.path.lexists(store.results.eval_path(key)):
                store.set_aside(store.results.eval_path(key))
            store.replace_file(store.results.eval_path(key), raw)

    # -- pushing ----------------------------------------------------------------------------------

    def push(self, store: Store, plan: Plan, step: Step, *, built_here: bool = False) -> PushReport:
        """Push a built step (and its plan, once), then attest the build: always when `built_here`
        (a run built it, a verify reproduced it), else only when the remote did not already hold
        this result (a store that pulled a step must not count as one more build of it). A build
        that is not `independent` (it resumed from a checkpoint another builder made) is pushed
        and never attested. Never raises for the remote: a failure comes back in `failed`."""
        try:
            self._push_plan(plan)
            pushed = self.remote.push_output(store, step.hash)
            for key in evals.keys_of_output(store.outputs.path(step.hash)):  # an evaluation's cache entries
                if evals.entry_problem(store.results.eval_path(key), key)[0] is not None:
                    self.remote.push_eval(key, store.results.eval_path(key).read_bytes())
            fresh = built_here or pushed.manifest != "present"
            if fresh and self.independent(store, step):
                self.attest(store, plan, step)
        except (BuildtrainError, OSError, ValueError) as exc:
            return PushReport(step=step.label, failed=str(exc))
        return PushReport(
            step=step.label,
            uploaded=pushed.uploaded,
            bytes_uploaded=pushed.bytes_uploaded,
            conflict=pushed.conflict,
        )

    def _push_plan(self, plan: Plan) -> None:
        if plan.hash not in self._plans_pushed:
            self.remote.push_plan(plan.hash, plan.canonical())
            self._plans_pushed.add(plan.hash)

    def share_plan(self, plan: Plan, step: Step) -> None:
        """Upload the plan before `step`, its first to build here, starts: should this run stop,
        another machine resumes it by hash (`bt run HASH --remote`). Never raises for the remote."""
        if self.offline:
            return
        try:
            self._push_plan(plan)
        except (BuildtrainError, OSError, ValueError) as exc:
            self.say_once(step, f"warning: plan not uploaded ({exc}); only this store can resume this run")

    def independent(self, store: Store, step: Step) -> bool:
        """Whether this store's build of a step is its own: False once any of it started from a
        checkpoint pulled from a remote (this run's, or an earlier interrupted run's, whose work
        folder still holds the mark). Such a build counts as nobody's attestation: its bits are
        only as good as the machine that wrote the checkpoint."""
        marked = (store.outputs.work_dir(step.hash) / layout.PULLED_CHECKPOINT).is_file()
        return step.hash not in self.resumed and not marked

    def attest(self, store: Store, plan: Plan, step: Step) -> None:
        """Sign this builder's statement of a step's build (its outputs' digests) and add it to
        the remote; the builder key is made on first use (`keyring.py`)."""
        from buildtrain.store.remote import attest, keyring, signing

        key = keyring.builder_key(create=True)
        output = store.outputs.path(step.hash)
        record = attest.Attestation(
            step=step.hash,
            plan=plan.hash,
            builder=signing.key_id(signing.raw_public(key)),
            machine=os.environ.get("BT_MACHINE") or socket.gethostname(),
            toolchain=dict(step.toolchain),
            built_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds"),
            inputs={
                name: value if isinstance(value, str) else digest("step-input", value)
                for name, value in step.inputs.items()
            },
            digests=objects.sealed_digests(output),
            files=objects.sealed_files(output),
        )
        attest.attest(self.remote.backend, record, key)

    def too_few_signers(self, step: Step, wanted: int | None = None) -> str | None:
        """Why the remote's output of `step` may not be pulled: fewer than `wanted` (default: this
        cache's requirement) distinct trusted keys signed exactly it; None when enough did, or
        when there is nothing (or only damage) to pull, which the pull itself reports."""
        wanted = self.min_attestations if wanted is None else wanted
        output = self.remote.output_declared(step.hash) if wanted > 0 else None
        if output is None:
            return None
        counted = self.tally(step, *output)
        if len(counted.agreeing) >= wanted:
            return None
        return (
            f"--min-attestations {wanted} asks for {wanted} distinct trusted keys that signed the "
            f"remote's output; {counted}: not pulled"
        )

    def tally(self, step: Step, digests: dict[str, str], files: dict[str, str] | None = None) -> Tally:
        """What this user's keyring counts for a step's output (an `attest.Tally`)."""
        from buildtrain.store.remote import attest, keyring

        found = attest.attestations(self.remote.backend, step.hash, keyring.load_keyring())
        return attest.tally(found, digests, files)

    # -- a step's turn -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def turn(
        self, store: Store, step: Step, *, wait: bool = True, checkpoints: bool = True
    ) -> Iterator[bool]:
        """The caller holds the step's local lock and found no local output: pull it (yields
        False: nothing to build), else yield True holding the remote lease while it builds. A
        remote that cannot be reached is one line, and the run goes on without it. Without
        `checkpoints` a resumable step's checkpoints are left to the process that builds it (on
        a cluster node, in a store of its own: see `engines/on_node.py`)."""
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
            if not build or not checkpoints or not kind_of(step.kind).resumable:
                yield build
                return
            with self.checkpoints(store, step):
                yield True

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


def _entry_check(key: str, raw: bytes, recorded: dict[str, Any] | None) -> str | None:
    """Whether bytes from the remote are the sealed evaluation entry of `key` that the pulled
    step's result records (`recorded`) (None: they are)."""
    import json

    try:
        entry = json.loads(raw)
        body = {"identity": entry["identity"], "result": entry["result"]}
        if evals.seal_entry(key, body) != raw:
            return "it does not match its seal or key"
    except (ValueError, KeyError, TypeError):
        return "not an evaluation entry"
    if body != recorded:
        return f"its result is not the one {layout.EVAL_RESULT} of the step records (forged)"
    return None


def _stop_this_run() -> None:
    """SIGTERM to this bt: `spawn` forwards it to the step process, which checkpoints and exits,
    and the run ends as interrupted (exit 3); `bt run` again resumes."""
    os.kill(os.getpid(), signal.SIGTERM)
