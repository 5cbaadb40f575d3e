"""Atomic checkpoints of a training step in progress, and resume from the newest valid one.

`checkpoints/.step-000050.tmp/` is written, every file fsynced, the manifest written last, then
renamed to `checkpoints/step-000050/` and the folder fsynced. The manifest records the folder's
name and the state records the step and the step hash, so a checkpoint renamed, linked or copied
from another step never passes for another update. Only folders whose manifest verifies and whose
recorded step and identity agree with their name are candidates for resume; any other is reported,
moved aside (renamed `damaged-...`, out of the candidates, removed with the work folder) and
skipped; a temporary one is ignored.

A checkpoint holds one segment of the trace, the updates since the scheduled checkpoint before it,
linked to that one's segment by its blake3 (`store/trace.py`): saving and resuming cost the same at update 20,000 as at
update 200, and the whole trace is read once, when the output is assembled.

Weights that do not train (LoRA's base model) are kept apart from those that do, in
`frozen.safetensors`: a process writes that file once and links it into its later checkpoints,
after checking, when the new checkpoint is sealed, that it still holds what was written.

A sharded checkpoint (one file per rank) stays so while the step trains, for every rank to write
and read its own rows; the output gets it whole (`publish`), in the files an unsharded one holds.
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
from buildtrain.errors import CorruptObject, StepFailed
from buildtrain.steps.train.optimizer import AdamW
from buildtrain.steps.train.ranks import Ranks
from buildtrain.steps.train.state import (
    FROZEN,
    MODEL,
    OPTIMIZER,
    SHARDS,
    TRACE,
    TRAIN_STATE,
    checkpoint_tensors,
    load_model,
    load_optimizer,
    optimizer_tensors,
    save_tensors,
    trained_and_frozen,
)
from buildtrain.store import objects, trace
from buildtrain.store.checkpoints import checkpoint_problems, state_problem
from buildtrain.store.layout import STATE_FORMAT, checkpoint_name, newest_first, trace_segments


@attrs.frozen
class Resumed:
    update: int  # the update the checkpoint was taken after
    state: dict[str, Any]
    trace: Trace
    path: Path


class Trace:
    """The per-update record of a train step on rank 0: the lines since the newest checkpoint,
    and where the sealed segments before them end (the newest one's blake3 and last update)."""

    def __init__(self, folder: Path, head: str | None = None, sealed_until: int = 0) -> None:
        self.folder = folder  # the checkpoints; their segments are kept beside them
        self.pool = trace_segments(folder)
        self.head = head
        self.sealed_until = sealed_until
        self._lines: list[bytes] = []

    def append(self, entry: dict[str, Any]) -> None:
        self._lines.append(canonical_bytes(entry) + b"\n")

    def seal(self, update: int, *, boundary: bool = True) -> tuple[bytes, str]:
        """The segment of the lines since the newest boundary (which it links to), and its
        blake3. At a boundary (a scheduled checkpoint) the trace then starts its next segment;
        a checkpoint taken at an interruption is no boundary, so that the segments of scheduled
        checkpoints, which enter the output, are the same however often a build was interrupted."""
        header = trace.Header(first=self.sealed_until + 1, last=update, previous=self.head)
        raw = trace.segment_bytes(header, self._lines)
        digest = trace.segment_digest(raw)
        if boundary:
            self.head, self.sealed_until, self._lines = digest, update, []
        return raw, digest

    def reopen(self, raw: bytes) -> None:
        """Resumed from a checkpoint that is no boundary: its segment's lines are pending again,
        to be sealed with the updates up to the next boundary."""
        header = trace.read_header(raw)
        self.head, self.sealed_until = header.previous, header.first - 1
        self._lines = raw.partition(b"\n")[2].splitlines(keepends=True)

    def whole(self) -> list[dict[str, Any]]:
        """Every entry from update 1: the chain of sealed segments read back (each checked
        against its blake3), then the lines since. Raises StepFailed, with every checkpoint
        moved aside, when a segment is missing or damaged: the trace before it is lost, so the
        step is built again from the start."""
        pending = [json.loads(line) for line in self._lines]
        if self.head is None:
            return pending
        path = trace.pool_path(self.pool, self.head)
        try:
            raw = path.read_bytes()
            if trace.segment_digest(raw) != self.head:
                raise trace.TraceDamaged(f"trace segment {path.name} does not match its blake3")
            return trace.whole(self.pool, raw) + pending
        except (trace.TraceDamaged, OSError) as exc:
            for _, checkpoint in candidates(self.folder):
                set_aside(checkpoint)
            raise StepFailed(
                f"the trace of this step is damaged ({exc}); every checkpoint was moved aside: "
                "bt run again builds the step from the start"
            ) from None


def read_trace(path: Path) -> list[dict[str, Any]]:
    """A whole trace file (a train step output's), one entry per line."""
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


@attrs.define
class FrozenFile:
    """The frozen weights' file (LoRA's base model) in the newest checkpoint that holds it, and
    its blake3 when it was written or verified: the next checkpoint links that file rather than
    writing the same bytes again (a 7B base is 28 GB in float32; the adapters are megabytes)."""

    path: Path | None = None
    blake3: str | None = None


def save(
    folder: Path,
    update: int,
    model: torch.nn.Module,
    optimizer: AdamW,
    state: dict[str, Any],
    history: Trace,
    midway: Callable[[int], None] | None = None,
    *,
    boundary: bool = True,
    frozen: FrozenFile | None = None,
) -> Path:
    """Write a complete checkpoint for `update` atomically, with the trace lines since the newest
    boundary as its segment (`Trace.seal`); returns its folder. `midway` is called with the update
    once the weights are written and nothing else is (a fault can strike there). Weights that do
    not train go to a file of their own, linked from `frozen` when it names one."""
    final, temporary = _start(folder, update)
    trained, fixed = trained_and_frozen(model)
    save_tensors(temporary / MODEL, trained)
    linked = bool(fixed) and frozen is not None and _link_frozen(frozen, temporary / FROZEN)
    if fixed and not linked:
        save_tensors(temporary / FROZEN, fixed)
    if midway is not None:
        midway(update)
    save_tensors(temporary / OPTIMIZER, optimizer_tensors(model, optimizer))

    def sealed(body: dict[str, Any]) -> None:
        if fixed and frozen is not None:
            _remember_frozen(frozen, final, body["files"][FROZEN]["blake3"], linked)

    return _finish(temporary, final, update, state, history, boundary, sealed)


def frozen_file(path: Path) -> FrozenFile:
    """The frozen weights' file of a checkpoint that verified against its manifest (none: an
    empty `FrozenFile`)."""
    listed = objects.read_manifest(path)["files"].get(FROZEN)
    return FrozenFile() if listed is None else FrozenFile(path=path / FROZEN, blake3=listed["blake3"])


def _link_frozen(frozen: FrozenFile, target: Path) -> bool:
    """Hard-link the frozen weights' file of the newest checkpoint; False where there is none
    (or links are refused: then the file is written)."""
    if frozen.path is None or not frozen.path.is_file():
        return False
    try:
        os.link(frozen.path, target)
    except OSError:
        return False
    return True


def _remember_frozen(frozen: FrozenFile, final: Path, found: str, linked: bool) -> None:
    """Note the checkpoint's frozen file (`found`: its blake3, hashed when the checkpoint was
    sealed) for the next one. A linked file must still hold what was written: a changed one is
    refused before the checkpoint is committed, never blessed by a new manifest."""
    if linked and found != frozen.blake3:
        raise CorruptObject(
            f"{frozen.path}: the frozen weights changed on disk since they were checkpointed "
            f"(blake3 {found[:16]}…, written as {str(frozen.blake3)[:16]}…); run bt fsck, then bt run again"
        )
    frozen.path, frozen.blake3 = final / FROZEN, found


def save_sharded(
    folder: Path,
    update: int,
    write_shards: Callable[[Path], None],
    state: dict[str, Any],
    history: Trace,
    midway: Callable[[int], None] | None = None,
    *,
    boundary: bool = True,
    ranks: Ranks,
) -> Path:
    """`save` for sharded training, on every rank: rank 0 opens the temporary folder, every rank
    writes its shards into it (`write_shards`, collective), and rank 0 alone writes the rest,
    seals the manifest over every rank's files and renames the folder into place. The returned
    path is meaningful on rank 0 only."""
    final, temporary = _start(folder, update) if ranks.lead else _paths(folder, update)
    ranks.barrier("a checkpoint")
    write_shards(temporary)
    ranks.barrier("a checkpoint")  # every rank's files complete before rank 0 seals them
    if not ranks.lead:
        return final
    if midway is not None:
        midway(update)
    return _finish(temporary, final, update, state, history, boundary)


def publish(path: Path, target: Path) -> None:
    """Put the verified checkpoint `path` into an output as `target` (the same name).

    An unsharded one is linked as it is. A sharded one holds one file per rank, cut where the
    ranks' rows fall, so its bytes depend on the world size although its tensors do not: it is
    written again as whole tensors, in the files and by the names of an unsharded checkpoint
    (`save`), and sealed under its name. The output is then one function of the step hash at any
    world size (the same bytes from 1, 2 or 4 ranks), and every reader of a kept checkpoint finds
    the layout it knows.
    """
    if not (path / SHARDS).is_dir():
        objects.link_tree(path, target)  # the work copy stays valid until commit
        return
    tensors = checkpoint_tensors(path, optimizer=True)
    target.mkdir(parents=True)
    for file, prefix in ((MODEL, "model."), (OPTIMIZER, "optimizer.")):
        named = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        save_tensors(target / file, named)
    for file in (TRAIN_STATE, TRACE):  # the same bytes at any world size (rank 0 wrote them)
        (target / file).write_bytes((path / file).read_bytes())
    objects.seal(target, name=path.name)


def _paths(folder: Path, update: int) -> tuple[Path, Path]:
    return folder / checkpoint_name(update), folder / f".{checkpoint_name(update)}.tmp"


def _start(folder: Path, update: int) -> tuple[Path, Path]:
    """The checkpoint's final folder and its empty temporary one."""
    require_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final, temporary = _paths(folder, update)
    objects.remove_tree(temporary)
    temporary.mkdir()
    return final, temporary


def _finish(
    temporary: Path,
    final: Path,
    update: int,
    state: dict[str, Any],
    history: Trace,
    boundary: bool,
    sealed: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """The training state and trace segment, then the manifest, then the rename into place.
    `sealed` sees the manifest before the rename, and may refuse the checkpoint by raising."""
    (temporary / TRAIN_STATE).write_bytes(canonical_bytes({"format": STATE_FORMAT, **state}))
    raw, segment = history.seal(update, boundary=boundary)
    # Kept by its blake3 first, so that a later checkpoint's link to it holds after this one is pruned.
    trace.keep(history.pool, segment, raw=raw)
    (temporary / TRACE).write_bytes(raw)
    body = objects.seal(temporary, name=final.name)  # before removing anything: a crash here costs nothing
    if sealed is not None:
        sealed(body)
    if final.exists():  # a checkpoint of this step from an earlier attempt: same content by design
        objects.remove_tree(final)
    objects.commit(temporary, final)
    return final


def require_folder(folder: Path) -> None:
    """Refuse a file or a link in place of the checkpoints folder, its work folder or the trace
    segments beside it: writing a checkpoint there fails (or goes elsewhere), and the message would
    blame the disk."""
    for path in (folder.parent, folder, trace_segments(folder)):
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
    model: torch.nn.Module | None,
    optimizer: AdamW,
    expect: dict[str, Any],
    on_skip: Callable[[Path, str], None],
) -> Resumed | None:
    """Restore the newest checkpoint that verifies and belongs to this step; None to start fresh.
    Every newer one that does not is reported through `on_skip` and moved aside. Without a
    model (sharded training) the tensors are left for every rank to read its own."""
    require_folder(folder)
    for _, path in newest_first(folder.iterdir()) if folder.is_dir() else []:
        if path.is_symlink():  # never a checkpoint, whatever it points to
            on_skip(path, "a symbolic link, not a checkpoint folder")
            set_aside(path)
    for update, path in candidates(folder):
        # Its tensors must be the state the trace records at its update, wherever it came from.
        found = checkpoint_problems(path, update, expect)
        if not found and (problem := state_problem(path, update, required=False)):
            found = [problem]
        if found:
            on_skip(path, "; ".join(found))
            set_aside(path)
            continue
        state = json.loads((path / TRAIN_STATE).read_bytes())
        if model is not None:
            load_model(model, path)  # its weights, and its frozen ones where they are apart
            load_optimizer(model, optimizer, path / OPTIMIZER)
        history = Trace(folder, objects.sealed_files(path)[TRACE], update)
        trace.keep(history.pool, history.head, source=path / TRACE)  # one pulled from a remote brings it
        return Resumed(update=update, state=state, trace=history, path=path)
    return None
