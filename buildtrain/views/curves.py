"""Training curves read from the store: every train step's trace, the exact record of each update.

The trace of a built train step holds the loss (as float32 bits) and learning rate of every update,
and the held-out results of evaluations during training. It is complete however the step was
built (in one run, resumed over several, or by another plan of a sweep), which a run record is
not. Stages are laid end to end: a finetune's first update follows the pretrain's last.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import attrs

from buildtrain.plan.card import Card
from buildtrain.store.layout import TRACE
from buildtrain.store.store import Store


@attrs.frozen
class Curve:
    plan: str
    label: str  # how the plan is named in a legend
    steps: tuple[int, ...]
    loss: tuple[float, ...]
    lr: tuple[float, ...]
    evals: tuple[tuple[int, float], ...]  # (update, held-out loss) during training
    boundaries: tuple[int, ...]  # the update after which each later stage starts


def _loss(value: Any) -> float | None:
    if isinstance(value, str) and len(value) == 8:
        try:
            return struct.unpack(">f", bytes.fromhex(value))[0]
        except ValueError:
            return None
    return float(value) if isinstance(value, (int, float)) else None


def read_trace(store: Store, step_hash: str) -> list[dict[str, Any]]:
    """The entries of a built train step's trace; [] when it is not built or unreadable."""
    try:
        raw = (store.outputs.path(step_hash) / TRACE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    entries = []
    for line in raw.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("step"), int):
            entries.append(entry)
    return entries


def plan_curve(store: Store, card: Card, label: str) -> Curve:
    steps: list[int] = []
    loss: list[float] = []
    lr: list[float] = []
    evals: list[tuple[int, float]] = []
    boundaries: list[int] = []
    offset = 0
    for index, (_, _, step_hash) in enumerate(card.summarizing("training")):
        if index:
            boundaries.append(offset)
        last = 0
        for entry in read_trace(store, step_hash):
            at = offset + entry["step"]
            last = max(last, entry["step"])
            if isinstance(entry.get("eval"), dict):
                value = entry["eval"].get("loss")
                if isinstance(value, (int, float)):
                    evals.append((at, float(value)))
                continue
            value = _loss(entry.get("loss"))
            if value is None:
                continue
            steps.append(at)
            loss.append(value)
            lr.append(float(entry.get("lr") or 0.0))
        offset += last
    return Curve(
        plan=card.hash,
        label=label,
        steps=tuple(steps),
        loss=tuple(loss),
        lr=tuple(lr),
        evals=tuple(evals),
        boundaries=tuple(boundaries),
    )
