"""Leases: which builder works on a step now, so that a second one waits instead of building it
again (a lease only saves work: two builds that finish anyway must agree, see attest.py).

A lease is a chain of records `leases/<step>/<generation>.json`, each written create-only (S3
If-None-Match, a hard link in a folder), so of all writers of one generation exactly one succeeds.
The record of the highest generation says who holds the step and until when. Taking a free or
expired lease writes the next generation; renewing writes the next generation too (with the same
holder), and releasing writes one marked released. So taking over an expired lease and a late
renewal race for the same generation, and one of them loses: never two holders. After each write
the writer lists the chain and holds only if its record is the highest (a writer that read an old
listing may create a generation below one that exists, and then holds nothing).

Expiry is wall-clock time (seconds since the epoch), compared across machines: clocks must agree
to well within a lease's duration. A holder renews at a fraction of the duration (say a third)
and must stop its step on `LeaseLost` (its lease expired or was taken over). A damaged record is
treated as released: a lease only coordinates, it never vouches for a result. So is a record whose
expiry lies further ahead than the longest lease (`MAX_DURATION`): no lease taken now can, and
trusted, it would block the step for as long as it says (reported once per record on stderr).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import uuid

import attrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.errors import BuildtrainError
from buildtrain.store.remote import keys
from buildtrain.store.remote.backend import AlreadyExists, Backend, ObjectMissing

LEASE_FORMAT = 1
ATTEMPTS = 8  # rounds of read, write, confirm before `take` reports the step as busy
# The longest lease a builder may take (buildtrain's own last 60 s, executor/remote/remote.py); it leaves
# room for clocks that disagree by minutes, and bounds how long any record can block a step.
MAX_DURATION = 600.0
_reported: set[tuple[str, int]] = set()  # far-future records already reported by this process


class LeaseLost(BuildtrainError):
    """The lease expired or another builder took it over: the step must stop."""


@attrs.frozen(kw_only=True)
class Lease:
    step: str
    generation: int = attrs.field(validator=attrs.validators.ge(0))
    holder: str = attrs.field(validator=attrs.validators.min_len(1))
    token: str
    """Unique to this record: a write whose answer was lost is recognised as ours."""
    expires: float
    """Seconds since the epoch."""
    released: bool = False

    def live(self, now: float) -> bool:
        return not self.released and now < self.expires <= now + MAX_DURATION


def holder_id() -> str:
    """A holder id that names this process and no other: host, pid and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _encode(lease: Lease) -> bytes:
    body = {"format": LEASE_FORMAT, **attrs.asdict(lease)}
    return canonical_bytes({**body, "seal": digest("remote-lease", body)})


def _decode(raw: bytes, step: str, generation: int) -> Lease | None:
    """The record, or None when it is damaged or not this step's generation."""
    try:
        body = json.loads(raw)
        claimed = body.pop("seal")
        if body.pop("format") != LEASE_FORMAT or claimed != digest(
            "remote-lease", {"format": LEASE_FORMAT, **body}
        ):
            return None
        lease = Lease(**body)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return lease if lease.step == step and lease.generation == generation and _encode(lease) == raw else None


def _generations(backend: Backend, step: str) -> list[int]:
    found = (keys.generation_of(key) for key in backend.list(keys.leases(step)))
    return sorted(g for g in found if g is not None)


def current(backend: Backend, step: str) -> tuple[int, Lease | None]:
    """(highest generation or -1, its record or None when there is none or it is damaged)."""
    generations = _generations(backend, step)
    if not generations:
        return -1, None
    top = generations[-1]
    try:
        record = _decode(backend.get(keys.lease(step, top)), step, top)
    except ObjectMissing:
        return top, None
    if record is not None and not record.released and record.expires > time.time() + MAX_DURATION:
        _report_far_future(record)
        return top, None
    return top, record


def _report_far_future(record: Lease) -> None:
    if (record.step, record.generation) in _reported:
        return
    _reported.add((record.step, record.generation))
    ahead = record.expires - time.time()
    print(
        f"bt: lease on step {record.step[:12]} (generation {record.generation}, {record.holder}) "
        f"expires {ahead:.0f} s from now, more than the longest lease ({MAX_DURATION:.0f} s): "
        "treated as damaged and taken over; check that machine's clock",
        file=sys.stderr,
        flush=True,
    )


def _write(backend: Backend, lease: Lease) -> bool:
    """Create the record; True when it is ours (also when an earlier try of this write landed)."""
    raw = _encode(lease)
    key = keys.lease(lease.step, lease.generation)
    try:
        backend.put(key, raw, create_only=True)
        return True
    except AlreadyExists:
        with contextlib.suppress(ObjectMissing):
            return backend.get(key) == raw
        return False


def _highest(backend: Backend, lease: Lease) -> bool:
    generations = _generations(backend, lease.step)
    return bool(generations) and generations[-1] == lease.generation


def take(backend: Backend, step: str, holder: str, duration: float) -> Lease:
    """Take the lease on `step` for `duration` seconds. Returns our lease, or the live lease of
    the builder that holds it: ours when `.holder == holder`, so a holder id names one builder
    process and no other (host, pid and a random part)."""
    _check_duration(duration)
    top, record = current(backend, step)
    for _ in range(ATTEMPTS):
        now = time.time()
        if record is not None and record.live(now):
            return record
        mine = Lease(
            step=step, generation=top + 1, holder=holder, token=uuid.uuid4().hex, expires=now + duration
        )
        if _write(backend, mine) and _highest(backend, mine):
            _prune(backend, mine)
            return mine
        top, record = current(backend, step)
    if record is None:
        raise LeaseLost(f"lease on step {step[:12]}: could not be taken after {ATTEMPTS} tries (busy remote)")
    return record


def _check_duration(duration: float) -> None:
    if not 0 < duration <= MAX_DURATION:
        raise ValueError(f"a lease lasts more than 0 and at most {MAX_DURATION} s (got {duration})")


def renew(backend: Backend, lease: Lease, duration: float) -> Lease:
    """Extend a lease we hold; LeaseLost when it expired or was taken over."""
    _check_duration(duration)
    now = time.time()
    if not lease.live(now):
        raise LeaseLost(f"lease on step {lease.step[:12]} expired before it was renewed; stop the step")
    renewed = attrs.evolve(
        lease, generation=lease.generation + 1, token=uuid.uuid4().hex, expires=now + duration
    )
    if not (_write(backend, renewed) and _highest(backend, renewed)):
        _, record = current(backend, lease.step)
        other = f" by {record.holder}" if record is not None else ""
        raise LeaseLost(f"lease on step {lease.step[:12]} was taken over{other}; stop the step")
    _prune(backend, renewed)
    return renewed


def release(backend: Backend, lease: Lease) -> None:
    """Give the lease up (a no-op when it was already lost)."""
    done = attrs.evolve(lease, generation=lease.generation + 1, token=uuid.uuid4().hex, released=True)
    if _write(backend, done):
        _prune(backend, done)


def _prune(backend: Backend, lease: Lease) -> None:
    """Remove the generations below the previous one: the chain stays short. Safe because a
    writer holds only when its record is the highest after its write."""
    for generation in _generations(backend, lease.step):
        if generation < lease.generation - 1:
            backend.delete(keys.lease(lease.step, generation))
