"""The run loop's claim on a step's output (`Outputs.claim`, `store/claims.py`): one record for
each case it can meet, and the step's lock held exactly while a build is claimed."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from buildtrain.errors import Locked
from buildtrain.store import layout, objects
from buildtrain.store.claims import Cached, Fresh, LockedBy, Resume
from buildtrain.store.store import Store

STEP = "c1" * 32


def publish_output(store: Store, step_hash: str = STEP) -> None:
    folder = store.new_temp("out")
    (folder / "weights.bin").write_bytes(b"weights")
    objects.publish(folder, store.outputs.path(step_hash), {"weights": "ab" * 32})


def is_locked(store: Store, step_hash: str = STEP) -> bool:
    """Whether some open file description holds the step's lock (flock is per description)."""
    try:
        with store.locks.hold(step_hash, wait=False):
            return False
    except Locked:
        return True


@contextmanager
def held_elsewhere(store: Store, holder: str) -> Iterator[int]:
    """The step's lock held through another open file description, as another run holds it."""
    store.folder(store.locks.dir)
    fd = os.open(store.locks.dir / f"{STEP}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, holder.encode(), 0)
        yield fd
    finally:
        os.close(fd)


def test_an_empty_place_is_claimed_fresh_holding_the_lock(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with store.outputs.claim(STEP) as claim:
        assert claim == Fresh(lock_fd=claim.lock_fd, work=store.outputs.work_dir(STEP))
        assert is_locked(store)
    assert not is_locked(store)


def test_a_published_output_is_cached_without_taking_the_lock(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    publish_output(store)
    with store.outputs.claim(STEP) as claim:
        assert claim == Cached(digests={"weights": "ab" * 32})
        assert not store.locks.dir.exists()  # a null build only reads


def test_an_output_published_while_waiting_is_cached_by_another_run(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    seen = []
    with held_elsewhere(store, "4242") as fd:

        def other_run_finishes(holder: str) -> None:
            seen.append(holder)
            publish_output(store)
            fcntl.flock(fd, fcntl.LOCK_UN)

        with store.outputs.claim(STEP, on_wait=other_run_finishes) as claim:
            assert claim == Cached(digests={"weights": "ab" * 32}, by_another_run=True)
    assert seen == ["4242"]


def test_a_busy_lock_without_waiting_names_its_holder(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with held_elsewhere(store, "4242"), store.outputs.claim(STEP, wait=False) as claim:
        assert claim == LockedBy(step_hash=STEP, holder="4242")
        with pytest.raises(Locked, match="being built by pid 4242"):
            raise claim.refusal()


def test_the_newest_sealed_checkpoint_is_claimed_for_resume(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    checkpoints = store.outputs.checkpoints_dir(STEP)
    for update in (4, 12):
        folder = checkpoints / layout.checkpoint_name(update)
        folder.mkdir(parents=True)
        (folder / layout.MODEL).write_bytes(b"model")
        objects.seal(folder)
    (checkpoints / layout.checkpoint_name(16)).mkdir()  # interrupted before its manifest: skipped
    with store.outputs.claim(STEP) as claim:
        assert isinstance(claim, Resume) and is_locked(store)
        assert (claim.update, claim.checkpoint) == (12, checkpoints / "step-000012")
        assert claim.work == store.outputs.work_dir(STEP) and claim.moved is None


def test_a_damaged_output_is_set_aside_and_named_in_a_fresh_claim(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    publish_output(store)
    (store.outputs.path(STEP) / "weights.bin").write_bytes(b"decayed")
    with store.outputs.claim(STEP) as claim:
        assert isinstance(claim, Fresh) and claim.problems
        assert claim.moved is not None and claim.moved.parent == store.quarantined
        assert (claim.moved / "weights.bin").read_bytes() == b"decayed"
        assert not os.path.lexists(store.outputs.path(STEP))
