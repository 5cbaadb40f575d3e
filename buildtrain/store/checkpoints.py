"""What makes a checkpoint folder the checkpoint its name says: torch-free, so that `bt fsck`
checks checkpoints exactly as resume does without loading torch.

A checkpoint `step-000050/` must verify against its manifest (every file, and the folder name it
was sealed under), and its training state must record step 50 and the identity of its step (the
step hash), and its trace segment must end at that step. A folder renamed, linked or copied from another step or another plan fails one of these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from buildtrain.store import objects, trace
from buildtrain.store.layout import STATE_FORMAT, TRACE, TRAIN_STATE


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
