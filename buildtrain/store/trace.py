"""A train step's trace in segments: each checkpoint seals only the updates since the one before.

Rewriting the whole trace at every checkpoint cost 9.6 / 12.8 / 46 ms per checkpoint at 200 /
2,000 / 20,000 updates (O(updates^2 / checkpoint_every) over a run), and resume read it all back
(2.3 / 22 / 292 ms). Now a checkpoint's `trace.jsonl` is one segment: a header line, then the
trace lines of the updates since the previous scheduled checkpoint (one taken at an interruption
is no boundary, so the segments that enter an output do not depend on interruptions):

    {"first":51,"format":1,"last":100,"previous":"<blake3 of the previous segment>"|null}

Every segment is also kept by its blake3 in `work/<step hash>/trace/<blake3>.jsonl` (a hard link:
pruning a checkpoint keeps its segment). The whole trace is the chain from the newest segment back
to the first (`previous` null, `first` 1), read once, when the output is assembled: every segment
is trusted only once its bytes hash to the name it was found under (the pool) or to the manifest
of the checkpoint it is in, and the chain must cover every update from 1 to the last exactly once.
Resume reads the newest checkpoint alone. Torch-free: fsck checks segments as resume does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import blake3

from buildtrain.canonical import canonical_bytes
from buildtrain.sources import durable
from buildtrain.store import objects
from buildtrain.store.layout import HASH_NAME, SEGMENT_SUFFIX

SEGMENT_FORMAT = 1


class TraceDamaged(ValueError):
    """A segment is missing, does not hash to its name, or the chain has a gap."""


def _blake3_or_none(_: Any, __: Any, value: Any) -> None:
    if value is not None and not (isinstance(value, str) and HASH_NAME.match(value)):
        raise ValueError(f"a segment links to a blake3, not {str(value)[:24]!r}")


@attrs.frozen
class Header:
    first: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])
    last: int = attrs.field(validator=attrs.validators.instance_of(int))  # the checkpoint's update
    previous: str | None = attrs.field(validator=_blake3_or_none)  # None: the first segment

    @last.validator
    def _not_before_first(self, _: Any, value: int) -> None:
        if value < self.first:
            raise ValueError(f"a segment ends at update {value}, before its first, {self.first}")

    def encode(self) -> bytes:
        body = {"format": SEGMENT_FORMAT, "first": self.first, "last": self.last, "previous": self.previous}
        return canonical_bytes(body) + b"\n"


def segment_bytes(header: Header, lines: list[bytes]) -> bytes:
    return header.encode() + b"".join(lines)


def segment_digest(raw: bytes) -> str:
    return blake3.blake3(raw).hexdigest()


def read_header(raw: bytes) -> Header:
    """The header line alone (following a chain needs no more); raises TraceDamaged."""
    head = raw.partition(b"\n")[0]
    try:
        fields = json.loads(head)
        header = Header(first=fields["first"], last=fields["last"], previous=fields["previous"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceDamaged(f"not a trace segment ({exc})") from None
    if fields.get("format") != SEGMENT_FORMAT or header.encode() != head + b"\n":
        raise TraceDamaged("not a trace segment (unknown format)")
    return header


def parse(raw: bytes) -> tuple[Header, list[dict[str, Any]]]:
    """A segment's header and entries; raises TraceDamaged when it is not a sound segment."""
    header = read_header(raw)
    try:
        entries = [json.loads(line) for line in raw.partition(b"\n")[2].splitlines() if line.strip()]
    except ValueError as exc:
        raise TraceDamaged(f"not a trace segment ({exc})") from None
    updates = [e.get("step") for e in entries if isinstance(e, dict) and "eval" not in e]
    if updates != list(range(header.first, header.last + 1)):
        raise TraceDamaged(f"does not hold updates {header.first} to {header.last} once each, in order")
    return header, entries


def header_problem(raw: bytes, update: int) -> str | None:
    """Why the segment sealed in the checkpoint of `update` is not its own; None when it is."""
    try:
        header, _ = parse(raw)
    except TraceDamaged as exc:
        return str(exc)
    if header.last != update:
        return f"its trace segment ends at update {header.last}, not {update}"
    if (header.previous is None) != (header.first == 1):
        return "its trace segment does not link to the one before it"
    return None


def pool_path(pool: Path, digest: str) -> Path:
    return pool / f"{digest}{SEGMENT_SUFFIX}"


def keep(pool: Path, digest: str, source: Path | None = None, raw: bytes | None = None) -> Path:
    """Put a segment into the pool under its blake3 (a hard link of `source`, else `raw` written
    durably); an intact copy already there is kept."""
    path = pool_path(pool, digest)
    if path.is_file() and not path.is_symlink() and objects.hash_file(path)[0] == digest:
        return path
    pool.mkdir(parents=True, exist_ok=True)
    if source is not None:
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.unlink(missing_ok=True)
        try:
            os.link(source, temporary)
            os.replace(temporary, path)
            durable.fsync_dir(pool)
            return path
        except OSError:
            temporary.unlink(missing_ok=True)
            raw = source.read_bytes()
    assert raw is not None
    durable.write_bytes_durably(path, raw)
    return path


def pool_problem(path: Path) -> str | None:
    """Why a file in the pool is not the segment its name says (`bt fsck`); None when it is."""
    digest = path.name.removesuffix(SEGMENT_SUFFIX)
    if not HASH_NAME.match(digest) or not path.name.endswith(SEGMENT_SUFFIX):
        return "not a trace segment"
    if path.is_symlink() or not path.is_file():
        return "not a regular file"
    raw = path.read_bytes()
    if segment_digest(raw) != digest:
        return "does not match its blake3"
    try:
        parse(raw)
    except TraceDamaged as exc:
        return str(exc)
    return None


def whole(pool: Path, newest: bytes) -> list[dict[str, Any]]:
    """Every entry of the trace, from the chain that ends with the (already verified) segment
    `newest`; raises TraceDamaged naming the first segment that is missing or unsound."""
    segments: list[list[dict[str, Any]]] = []
    raw, name, ends_at = newest, "the newest", None
    while True:
        try:
            header, entries = parse(raw)
        except TraceDamaged as exc:
            raise TraceDamaged(f"trace segment {name} is damaged: {exc}") from None
        if ends_at is not None and header.last != ends_at:
            raise TraceDamaged(f"trace segment {name} ends at update {header.last}, not {ends_at}")
        segments.append(entries)
        if header.previous is None:
            break
        ends_at, path = header.first - 1, pool_path(pool, header.previous)
        name = path.name
        try:
            raw = path.read_bytes()
        except OSError:
            raise TraceDamaged(f"trace segment {name} (updates up to {ends_at}) is missing") from None
        if segment_digest(raw) != header.previous:
            raise TraceDamaged(f"trace segment {name} does not match its blake3")
    if header.first != 1:
        raise TraceDamaged(f"the trace starts at update {header.first}, not 1")
    return [entry for entries in reversed(segments) for entry in entries]
