"""Atomic checkpoints of a training step in progress, and resume from the newest valid one.

`checkpoints/.step-000050.tmp/` is written, every file fsynced, the manifest written last, then
renamed to `checkpoints/step-000050/` and the folder fsynced. The manifest records the folder's
name and the state records the step and the step hash, so a checkpoint renamed, linked or copied
from another step never passes for another update. Only folders whose manifest verifies and whose
recorded step and identity agree with their name are candidates for resume; any other is reported,
moved aside (renamed `damaged-...`, out of the candidates, removed with the work folder) and
skipped; a temporary one is ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from buildtrain.canonical import canonical_bytes
from buildtrain.errors import CorruptObject
from buildtrain.steps.train.optimizer import AdamW
from buildtrain.steps.train.state import (
    MODEL,
    OPTIMIZER,
    TRACE,
    TRAIN_STATE,
    load_model,
    load_optimizer,
    model_tensors,
    optimizer_tensors,
    save_tensors,
)
from buildtrain.store import objects
from buildtrain.store.checkpoints import checkpoint_problems
from buildtrain.store.layout import STATE_FORMAT, checkpoint_name, newest_first


@attrs.frozen
class Resumed:
    update: int  # the update the checkpoint was taken after
    state: dict[str, Any]
    trace: Trace
    path: Path


class Trace:
    """The per-update record of a train step; each entry is encoded once, when it is added, since
    every checkpoint writes the whole trace so far."""

    def __init__(self, entries: list[dict[str, Any]] | None = None) -> None:
        self.entries: list[dict[str, Any]] = []
        self._lines: list[bytes] = []
        for entry in entries or []:
            self.append(entry)

    def append(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)
        self._lines.append(canonical_bytes(entry) + b"\n")

    def to_bytes(self) -> bytes:
        return b"".join(self._lines)


def read_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def save(
    folder: Path,
    update: int,
    model: torch.nn.Module,
    optimizer: AdamW,
    state: dict[str, Any],
    trace: Trace,
    midway: Callable[[int], None] | None = None,
) -> Path:
    """Write a complete checkpoint for `update` atomically; returns its folder. `midway` is called
    with the update once the weights are written and nothing else is (a fault can strike there)."""
    require_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(update)
    temporary = folder / f".{checkpoint_name(update)}.tmp"
    objects.remove_tree(temporary)
    temporary.mkdir()
    save_tensors(temporary / MODEL, model_tensors(model))
    if midway is not None:
        midway(update)
    save_tensors(temporary / OPTIMIZER, optimizer_tensors(model, optimizer))
    (temporary / TRAIN_STATE).write_bytes(canonical_bytes({"format": STATE_FORMAT, **state}))
    (temporary / TRACE).write_bytes(trace.to_bytes())
    objects.seal(temporary, name=final.name)  # before removing anything: a crash here costs nothing
    if final.exists():  # a checkpoint of this step from an earlier attempt: same content by design
        objects.remove_tree(final)
    objects.commit(temporary, final)
    return final


def require_folder(folder: Path) -> None:
    """Refuse a file or a link in place of the checkpoints folder or its work folder: writing a
    checkpoint there fails (or goes elsewhere), and the message would blame the disk."""
    for path in (folder.parent, folder):
        if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
            raise CorruptObject(
                f"{path} is {'a symbolic link' if path.is_symlink() else 'a file'}, not a folder of "
                "checkpoints; run bt fsck --repair (it moves it to quarantine/), then bt run again"
            )


def candidates(folder: Path) -> list[tuple[int, Path]]:
    """Checkpoint folders, newest first (temporary folders are not candidates)."""
    if not folder.is_dir():
        return []
    return [
        (at, path) for at, path in newest_first(folder.iterdir()) if path.is_dir() and not path.is_symlink()
    ]


def prune(folder: Path, keep: int, scheduled: Callable[[int], bool] | None = None) -> None:
    """Keep the newest `keep` checkpoints. Given which updates are `scheduled`, a checkpoint taken
    at an interruption counts for nothing and stays only while it is the newest (resume starts
    there): the checkpoints kept are those an uninterrupted build keeps."""
    found = candidates(folder)
    if scheduled is None:
        doomed = found[keep:]
    else:
        kept = found[:1] + [c for c in found if scheduled(c[0])][:keep]
        doomed = [c for c in found if c not in kept]
    for _, path in doomed:
        objects.remove_tree(path)
    for path in folder.glob(".step-*.tmp"):
        objects.remove_tree(path)


def set_aside(path: Path) -> None:
    """Move a checkpoint that must not be resumed out of the candidates (a link is removed)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
        return
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, path.with_name(f"damaged-{path.name}.{time.time_ns()}"))


def load_newest(
    folder: Path,
    model: torch.nn.Module,
    optimizer: AdamW,
    expect: dict[str, Any],
    on_skip: Callable[[Path, str], None],
) -> Resumed | None:
    """Restore the newest checkpoint that verifies and belongs to this step; None to start fresh.
    Every newer one that does not is reported through `on_skip` and moved aside."""
    require_folder(folder)
    for _, path in newest_first(folder.iterdir()) if folder.is_dir() else []:
        if path.is_symlink():  # never a checkpoint, whatever it points to
            on_skip(path, "a symbolic link, not a checkpoint folder")
            set_aside(path)
    for update, path in candidates(folder):
        found = checkpoint_problems(path, update, expect)
        if found:
            on_skip(path, "; ".join(found))
            set_aside(path)
            continue
        state = json.loads((path / TRAIN_STATE).read_bytes())
        load_model(model, path / MODEL)
        load_optimizer(model, optimizer, path / OPTIMIZER)
        return Resumed(update=update, state=state, trace=Trace(read_trace(path / TRACE)), path=path)
    return None
