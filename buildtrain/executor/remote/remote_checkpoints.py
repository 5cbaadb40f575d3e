"""The team cache's checkpoints of a resumable step: with no local checkpoint, a build starts
from the newest one on the remote that verifies (and pulls the older ones its output keeps);
while it runs, each new checkpoint it keeps is pushed from a thread of this process. A part of
`executor/remote/remote.py`'s `RemoteCache`, which holds the remote, the run's messages and what was
pushed; leases, pulls and pushes of outputs stay there.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from buildtrain.canonical import canonical_bytes
from buildtrain.errors import BuildtrainError, RemoteDamaged
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Step
from buildtrain.store import layout
from buildtrain.store.remote.remote import Remote
from buildtrain.store.remote.url import RemoteUrl
from buildtrain.store.store import Store

# A training step's checkpoint folder is looked at this often for a new checkpoint to push.
CHECKPOINT_POLL_S = 1.0
# A push must never slow the training beside it: the pusher's thread, and the upload threads it
# starts (a new thread inherits its creator's nice value on Linux), yield the CPU to it.
PUSHER_NICE = 19


class SharedCheckpoints:
    """Checkpoints through the remote, mixed into `RemoteCache`, whose attributes it reads."""

    url: RemoteUrl
    say: Callable[[str, str], None]
    min_attestations: int
    resumed: set[str]
    _pushed: dict[str, set[str]]

    if TYPE_CHECKING:  # RemoteCache's own

        @property
        def remote(self) -> Remote: ...

        def say_once(self, step: Step, text: str) -> None: ...

    @contextlib.contextmanager
    def checkpoints(self, store: Store, step: Step) -> Iterator[None]:
        """Around a resumable step's build: with no local checkpoint, start from the newest one on
        the remote that verifies; while it runs, push each new checkpoint it keeps (from a thread
        of this process: the step process never waits for the network)."""
        folder = store.outputs.checkpoints_dir(step.hash)
        if (store.outputs.work_dir(step.hash) / layout.PULLED_CHECKPOINT).is_file():
            if self.min_attestations > 0:  # a pulled checkpoint, and all after it: unsigned
                self.say_once(
                    step, "not resuming from checkpoints that began on the remote (no one signs one)"
                )
                store.set_aside(folder, keep=False)
                (store.outputs.work_dir(step.hash) / layout.PULLED_CHECKPOINT).unlink()
            else:
                self.resumed.add(step.hash)  # an earlier run resumed from a pulled one: still not ours
        if _newest(folder) is None:
            self._start_from_remote(store, step, folder)
        stop = threading.Event()
        pusher = threading.Thread(target=self._push_checkpoints, args=(folder, step, stop), daemon=True)
        pusher.start()
        try:
            yield
        finally:
            stop.set()
            pusher.join()

    def _start_from_remote(self, store: Store, step: Step, folder: Path) -> None:
        """No local checkpoint: pull the remote's newest that verifies and the older ones the
        output keeps, and mark the build as resumed from a pulled one (never attested). Not
        when signed results are required: no one signs a checkpoint."""
        if self.min_attestations > 0:
            if self.remote.checkpoints(step.hash):
                self.say_once(
                    step, "not resuming from the remote's checkpoint (no one signs one): building it"
                )
            return
        folder.mkdir(parents=True, exist_ok=True)
        pulled, problems = self.remote.pull_newest_checkpoint(store, step.hash, folder)
        for problem in problems:
            self.say(step.label, problem)
        if pulled is None:
            return
        self._pull_kept(store, step, pulled, folder)
        self.resumed.add(step.hash)
        mark = {"checkpoint": pulled.name, "remote": str(self.url)}
        store.replace_file(
            store.outputs.work_dir(step.hash) / layout.PULLED_CHECKPOINT, canonical_bytes(mark)
        )
        self.say(step.label, f"resuming from {pulled.name} pulled from {self.url}")

    def _pull_kept(self, store: Store, step: Step, newest: Path, folder: Path) -> None:
        """After resuming from `newest`, pull the older checkpoints the finished output keeps
        (`kept_updates`): a build resumed on another machine then publishes the files an
        uninterrupted one does. One the remote lacks or that does not verify is named: the output
        will lack it, and a push then reports the difference."""
        update = layout.checkpoint_update(newest.name) or 0
        held = set(self.remote.checkpoints(step.hash))
        for older in kind_of(step.kind).kept_updates(step.config):
            name = layout.checkpoint_name(older)
            if older >= update or (folder / name).exists():
                continue
            if name not in held:
                self.say(step.label, f"the remote lacks kept checkpoint {name}: the output will not hold it")
                continue
            try:
                self.remote.pull_checkpoint(store, step.hash, name, folder)
            except RemoteDamaged as exc:
                self.say(step.label, str(exc))

    def push_newest_checkpoint(self, store: Store, step: Step) -> None:
        """Push what the pusher has not, after the step process ended (the checkpoint a stop
        wrote may be newer than the pusher's last look); a failure is left to the next run."""
        self._push_new(
            store.outputs.checkpoints_dir(step.hash), step, self._pushed.setdefault(step.hash, set())
        )

    def _push_checkpoints(self, folder: Path, step: Step, stop: threading.Event) -> None:
        _lower_priority()
        pushed = self._pushed.setdefault(step.hash, set())
        while not stop.wait(CHECKPOINT_POLL_S):
            self._push_new(folder, step, pushed)

    def _push_new(self, folder: Path, step: Step, pushed: set[str]) -> None:
        """Push every finished checkpoint of `folder` not pushed yet, oldest first: the kept ones
        before a resume point must be there for another machine to resume from (`_pull_kept`)."""
        found = [path for _, path in layout.newest_first(folder.iterdir() if folder.is_dir() else ())]
        for path in reversed(found):
            if path.name in pushed or not path.is_dir() or path.is_symlink():
                continue
            try:
                self.remote.push_checkpoint(step.hash, path)
                pushed.add(path.name)
            except (BuildtrainError, OSError, ValueError):
                continue  # pruned or moved aside meanwhile, or a passing network problem


def _lower_priority() -> None:
    """Lower this thread's CPU priority, and no other's: on Linux a nice value belongs to a
    thread (elsewhere a thread id is no process id, so nothing is changed)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUSHER_NICE)


def _newest(folder: Path) -> Path | None:
    """The newest finished checkpoint folder (`step-NNNNNN`; hidden ones are being written)."""
    found = [path for _, path in layout.newest_first(folder.iterdir() if folder.is_dir() else ())]
    return next((path for path in found if path.is_dir() and not path.is_symlink()), None)
