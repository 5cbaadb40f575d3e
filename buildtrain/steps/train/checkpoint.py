"""Atomic checkpoints of a training step in progress, and resume from the newest valid one.

`checkpoints/.step-000050.tmp/` is written, every file fsynced, the manifest written last, then
renamed to `checkpoints/step-000050/` and the folder fsynced. Only folders whose manifest verifies
are candidates for resume; a damaged one is reported and skipped, a temporary one is ignored.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from buildtrain.plan.canonical import canonical_bytes
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

CHECKPOINT = re.compile(r"^step-(\d{6,})$")
STATE_FORMAT = 1


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


@attrs.frozen
class Resumed:
    step: int
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
    step: int,
    model: torch.nn.Module,
    optimizer: AdamW,
    state: dict[str, Any],
    trace: Trace,
    kill_midway: bool = False,
) -> Path:
    """Write a complete checkpoint for `step` atomically; returns its folder."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(step)
    temporary = folder / f".{checkpoint_name(step)}.tmp"
    objects.remove_tree(temporary)
    temporary.mkdir()
    save_tensors(temporary / MODEL, model_tensors(model))
    if kill_midway:  # test hook: die with a half-written checkpoint on disk
        os.kill(os.getpid(), signal.SIGKILL)
    save_tensors(temporary / OPTIMIZER, optimizer_tensors(model, optimizer))
    (temporary / TRAIN_STATE).write_bytes(canonical_bytes({"format": STATE_FORMAT, **state}))
    (temporary / TRACE).write_bytes(trace.to_bytes())
    objects.seal(temporary)  # before removing anything, so a crash here costs no checkpoint
    if final.exists():  # a checkpoint of this step from an earlier attempt: same content by design
        objects.remove_tree(final)
    objects.commit(temporary, final)
    return final


def candidates(folder: Path) -> list[tuple[int, Path]]:
    """Checkpoint folders, newest first (temporary folders are not candidates)."""
    found = []
    if folder.is_dir():
        for path in folder.iterdir():
            match = CHECKPOINT.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def prune(folder: Path, keep: int) -> None:
    for _, path in candidates(folder)[keep:]:
        objects.remove_tree(path)
    for path in folder.glob(".step-*.tmp"):
        objects.remove_tree(path)


def load_newest(
    folder: Path,
    model: torch.nn.Module,
    optimizer: AdamW,
    expect: dict[str, Any],
    on_skip: Callable[[Path, str], None],
) -> Resumed | None:
    """Restore the newest checkpoint that verifies and belongs to this step; None to start fresh."""
    for step, path in candidates(folder):
        problems = objects.verify(path)
        if problems:
            on_skip(path, "; ".join(problems[:3]))
            continue
        state = json.loads((path / TRAIN_STATE).read_bytes())
        mismatched = [key for key, value in expect.items() if state.get(key) != value]
        if state.get("format") != STATE_FORMAT or mismatched:
            on_skip(path, f"belongs to another configuration ({', '.join(mismatched) or 'format'})")
            continue
        load_model(model, path / MODEL)
        load_optimizer(model, optimizer, path / OPTIMIZER)
        return Resumed(step=step, state=state, trace=Trace(read_trace(path / TRACE)), path=path)
    return None
