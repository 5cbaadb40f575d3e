"""Plan cards: the few facts about a plan that tables need, kept so 1,000 plans list at once.

Loading a plan re-derives every step hash from its canonical bytes (the safe way in, and the cost
of `bt ls` over many plans: milliseconds each). A card is a pure function of the immutable plan
(name, flattened config, steps by label and kind) plus the plan's creation time (a hint), written
when the plan is stored and on first use for older plans, under `<store>/metrics/plans/<hash>.json`.
The file's first line is the blake3 of the rest, which is checked on every read (hashing raw bytes
is C-speed, a canonical re-encoding is not): a damaged or foreign card is recomputed from the
plan, never believed. It is a cache, so it is replaced atomically but not fsynced.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import BuildtrainError
from buildtrain.kinds import KINDS
from buildtrain.plan.diff import flatten
from buildtrain.plan.plan import Plan
from buildtrain.plan.stored import load_plan
from buildtrain.sources.durable import framed, unframed, write_bytes_durably
from buildtrain.store.store import Store

CARD_FORMAT = 1


@attrs.frozen
class Card:
    hash: str
    name: str
    created: str
    config: dict[str, Any]  # flattened: `stages[0].train.lr` -> 0.003
    steps: tuple[tuple[str, str, str], ...]  # (label, kind, hash) in plan order

    def summarizing(self, what: str) -> list[tuple[str, str, str]]:
        """The steps whose kind's metrics summary holds `what` ("training", "evaluation")."""
        # A card read back may name a kind this bt lacks.
        return [step for step in self.steps if getattr(KINDS.get(step[1]), "summary", None) == what]


def card_path(store: Store, plan_hash: str) -> str:
    return store.results.card_path(plan_hash)


def save_card(store: Store, plan: Plan, created: str) -> Card:
    body = {
        "format": CARD_FORMAT,
        "plan": plan.hash,
        "name": plan.name,
        "created": created,
        "config": flatten({"name": plan.name, **plan.config}),
        "steps": [[s.label, s.kind, s.hash] for s in plan.steps],
    }
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    path = Path(card_path(store, plan.hash))
    with contextlib.suppress(OSError, BuildtrainError):  # read-only or damaged: computed next time
        store.folder(store.cards)
        write_bytes_durably(path, framed(raw), durable=False)
    return _card(body)


def read_card(store: Store, plan_hash: str) -> Card | None:
    """The stored card of a plan, or None when it is absent, damaged or another plan's."""
    try:
        with open(card_path(store, plan_hash), "rb") as file:
            raw = unframed(file.read())
        if raw is None:
            return None
        body = json.loads(raw)
        if body.get("format") != CARD_FORMAT or body.get("plan") != plan_hash:
            return None
        return _card(body)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_card(store: Store, plan_hash: str) -> Card | None:
    """The plan's card, computed and kept on first use; None for a damaged plan."""
    card = read_card(store, plan_hash)
    if card is not None:
        return card
    try:
        plan = load_plan(store, plan_hash)
    except Exception:  # a damaged plan is listed as such; fsck says more
        return None
    created = store.plans.meta(plan_hash).get("created")
    return save_card(store, plan, created if isinstance(created, str) else "?")


def _card(body: dict[str, Any]) -> Card:
    steps = tuple((str(label), str(kind), str(h)) for label, kind, h in body["steps"])
    return Card(
        hash=body["plan"],
        name=str(body["name"]),
        created=str(body.get("created", "?")),
        config=dict(body["config"]),
        steps=steps,
    )
