"""What makes a checkpoint folder the checkpoint its name says: torch-free, so that `bt fsck`
checks checkpoints exactly as resume does without loading torch.

A checkpoint `step-000050/` must verify against its manifest (every file, and the folder name it
was sealed under), and its training state must record step 50 and the identity of its step (the
step hash), and its trace segment must end at that step. A folder renamed, linked or copied from another step or another plan fails one of these.

Its seal is an unkeyed digest, so a checkpoint whose weights were changed and sealed again passes
all of that: `state_problem` binds its tensors to the trace's record of the state at its update
(the digest of every weight and AdamW moment, `steps/train/record.py`), whoever wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from buildtrain.store import objects, trace
from buildtrain.store.layout import FROZEN, MODEL, OPTIMIZER, SHARDS, STATE_FORMAT, TRACE, TRAIN_STATE
from buildtrain.store.tensors import (
    combine,
    iter_safetensors,
    sharded_tensors,
    streamed_digests,
    tensor_digest,
)

# The checkpoint files whose tensors make the training state, and the prefix of their names in the
# trace's record (`steps/train/state.state_tensors`): weights that train, frozen ones, AdamW moments.
STATE_FILES = ((MODEL, "model."), (FROZEN, "model."), (OPTIMIZER, "optimizer."))


def checkpoint_problems(path: Path, update: int, expect: dict[str, Any]) -> list[str]:
    """Why the checkpoint folder `path` (named for `update`) cannot be resumed from; [] if it can."""
    found = objects.verify(path)
    if found:
        return found[:3]
    try:
        state = json.loads((path / TRAIN_STATE).read_bytes())
    except (OSError, ValueError) as exc:
        return [f"{TRAIN_STATE} unreadable ({exc})"]
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        return [f"{TRAIN_STATE} has an unknown format"]
    if state.get("step") != update:  # the state's field is named "step" (a data format)
        return [f"records step {state.get('step')}, named step {update}"]
    mismatched = [key for key, value in expect.items() if state.get(key) != value]
    if mismatched:
        return [f"belongs to another configuration ({', '.join(mismatched)})"]
    try:
        problem = trace.header_problem((path / TRACE).read_bytes(), update)
    except OSError as exc:
        problem = f"unreadable ({exc.strerror or exc})"
    return [f"{TRACE}: {problem}"] if problem else []


def state_digest(path: Path) -> str:
    """The digest the trace records as "state" for the tensors of the checkpoint folder `path`
    (either layout), read from its files without torch."""
    if (path / SHARDS).is_dir():
        whole = sharded_tensors(path / SHARDS)
        return combine({name: tensor_digest(name, *whole[name]) for name in sorted(whole)})
    found = {}
    for file, prefix in STATE_FILES:
        if (path / file).is_file():
            streamed = streamed_digests(path / file, prefix)  # computed as a pull wrote it
            if streamed is not None:
                found.update(streamed)
                continue
            for name, dtype, shape, raw in iter_safetensors(path / file):
                found[prefix + name] = tensor_digest(prefix + name, dtype, shape, raw)
    return combine(dict(sorted(found.items())))


def state_problem(path: Path, update: int, *, required: bool) -> str | None:
    """Why the tensors of a checkpoint (one `checkpoint_problems` accepts) are not the state its
    trace segment records at `update`; None when they are. A checkpoint taken at an interruption
    has no record to check against: `required` (one pulled from a remote) refuses it."""
    try:
        _, entries = trace.parse((path / TRACE).read_bytes())
        record = next((e for e in entries if e.get("step") == update and "eval" not in e), None)
        recorded = record.get("state") if isinstance(record, dict) else None
        if recorded is None:
            return f"{TRACE} records no state at update {update} to check it against" if required else None
        found = state_digest(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its tensors cannot be read ({type(exc).__name__}: {exc})"
    if found != recorded:
        return (
            f"its tensors give state {found[:12]}, its trace records {str(recorded)[:12]} at update "
            f"{update} (forged or damaged)"
        )
    return None
