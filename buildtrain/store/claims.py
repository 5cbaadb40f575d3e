"""What the run loop learns when it claims a step's output (`Outputs.claim`): one record instead
of five questions (is it published? damaged? locked? is there a work folder? a checkpoint?).

- `Cached`: the output is in the store and verifies; nothing to build.
- `LockedBy`: another process holds the step's lock and the caller would not wait.
- `Fresh`: the lock is held by the caller; build from the start in `work`.
- `Resume`: the lock is held by the caller; `work` holds a sealed checkpoint, the newest at
  `update`. Only a hint: the step process checks it against its configuration and its trace
  (`store/checkpoints.py`) and starts afresh from a checkpoint it refuses.

`Fresh` and `Resume` name the damaged output set aside to make room for the build, if any: the
run loop reports it, the store never prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs

from buildtrain.errors import Locked
from buildtrain.store.locks import HeldBy


@attrs.frozen(kw_only=True)
class Cached:
    digests: Mapping[str, str]  # the logical digests its manifest declares
    by_another_run: bool = False  # found only once the lock was held: built meanwhile


@attrs.frozen(kw_only=True)
class LockedBy:
    step_hash: str
    holder: str  # the holder's pid, as it wrote it into the lock file

    def refusal(self) -> Locked:
        """The error `bt run --no-wait` exits with (the message of a busy lock everywhere)."""
        return HeldBy(self.step_hash, self.holder)


@attrs.frozen(kw_only=True)
class Fresh:
    lock_fd: int  # the step's lock, held until the claim's context ends; a child may inherit it
    work: Path
    moved: Path | None = None  # where a damaged output in the way was set aside
    problems: tuple[str, ...] = ()  # what was wrong with it


@attrs.frozen(kw_only=True)
class Resume:
    lock_fd: int
    work: Path
    update: int  # the newest sealed checkpoint's update
    checkpoint: Path
    moved: Path | None = None
    problems: tuple[str, ...] = ()


Claim = Cached | LockedBy | Fresh | Resume
