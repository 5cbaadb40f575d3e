"""The trace segments a checkpoint links back to, between a remote and a store's pool: pushed
oldest first, so a segment on the remote always has every one before it there too, and pulled
each checked against its blake3 (segments are blobs, named by their blake3). Used by `remote.py`'s
checkpoint transfers; the checkpoints themselves are its business.
"""

from __future__ import annotations

from pathlib import Path

from buildtrain.errors import CorruptObject
from buildtrain.store import trace
from buildtrain.store.layout import TRACE, trace_segments
from buildtrain.store.remote import keys
from buildtrain.store.remote.backend import Backend, ObjectMissing


def push(backend: Backend, folder: Path) -> None:
    """Upload the trace segments a checkpoint links back to (blobs by their blake3), oldest
    first, so that a segment on the remote always has every one before it there too: the
    walk back stops at the first one already pushed, and a push costs the segments since."""
    pool, missing = trace_segments(folder.parent), []
    try:
        previous = trace.read_header((folder / TRACE).read_bytes()).previous
        while previous is not None and backend.exists(keys.blob(previous)) is None:
            path = trace.pool_path(pool, previous)
            raw = path.read_bytes()
            if trace.segment_digest(raw) != previous:
                raise trace.TraceDamaged(f"{path.name} does not match its blake3")
            missing.append((previous, path))
            previous = trace.read_header(raw).previous
    except (OSError, trace.TraceDamaged) as exc:
        raise CorruptObject(f"checkpoint {folder} was not pushed: its trace is damaged ({exc})") from None
    for segment, path in reversed(missing):
        backend.put_file(keys.blob(segment), path)


def pull(backend: Backend, checkpoint: Path) -> tuple[str, str] | None:
    """Download the trace segments the pulled `checkpoint` links back to that the local pool
    lacks, each checked against its blake3; kept oldest first. None, or (the key at fault, what
    is wrong with it) for the caller's message; nothing is kept then."""
    pool, fetched = trace_segments(checkpoint.parent), []
    previous: str | None = None
    try:
        previous = trace.read_header((checkpoint / TRACE).read_bytes()).previous
        while previous is not None:
            local = trace.pool_path(pool, previous)
            raw = local.read_bytes() if local.is_file() and not local.is_symlink() else None
            if raw is None or trace.segment_digest(raw) != previous:
                raw = backend.get(keys.blob(previous))
                if trace.segment_digest(raw) != previous:
                    raise trace.TraceDamaged(f"segment {previous[:12]} does not match its blake3")
                fetched.append((previous, raw))
            previous = trace.read_header(raw).previous
    except ObjectMissing:
        return keys.blob(str(previous)), "links to a trace segment it does not hold"
    except (OSError, trace.TraceDamaged) as exc:
        key = keys.blob(previous) if previous else f"{TRACE} of the checkpoint"
        return key, f"has a damaged trace ({exc})"
    for segment, raw in reversed(fetched):
        trace.keep(pool, segment, raw=raw)
    return None
