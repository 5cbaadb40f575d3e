"""What makes a checkpoint folder the checkpoint its name says: torch-free, so that `bt fsck`
checks checkpoints exactly as resume does without loading torch.

A checkpoint `step-000050/` must verify against its manifest (every file, and the folder name it
was sealed under), and its training state must record step 50 and the identity of its step (the
step hash). A folder renamed, linked or copied from another step or another plan fails one of these.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from buildtrain.store import objects

CHECKPOINT = re.compile(r"^step-(\d{6,})$")
STATE_FORMAT = 1
TRAIN_STATE = "train_state.json"  # = state.TRAIN_STATE (state.py imports torch; a test pins them equal)


def checkpoint_name(update: int) -> str:
    """The folder name of the checkpoint taken after `update` (at least six digits, zero-padded)."""
    return f"step-{update:06d}"


def checkpoint_update(name: str) -> int | None:
    """The update a checkpoint folder name stands for; None for any other name (temporary,
    set aside, foreign)."""
    match = CHECKPOINT.match(name)
    return int(match.group(1)) if match else None


def newest_first(paths: Iterable[Path]) -> list[tuple[int, Path]]:
    """(update, path) of the checkpoint folder names among `paths`, newest first. By number, never
    as strings: `step-1000000` is newer than `step-999999`."""
    found = [(update, path) for path in paths if (update := checkpoint_update(path.name)) is not None]
    return sorted(found, key=lambda item: item[0], reverse=True)


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
    return []
