"""Plan cards: the few facts about a plan that tables need, cached so 1,000 plans list at once.

Loading a plan re-derives every step hash from its canonical bytes (the safe way in, and the cost
of `bt ls` over many plans). A card is a pure function of the immutable plan (name, flattened
config, steps by label and kind), so it is computed once and kept under
`<store>/metrics/plans/<plan hash>.json`, sealed by a digest over its content: a damaged or
foreign card is recomputed, never believed. Results of a plan join in from its steps' outputs and
step summaries (executor/metrics.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.executor.metrics import read_step_metrics
from buildtrain.plan.diff import flatten
from buildtrain.store.objects import write_bytes_durably
from buildtrain.store.store import Store

CARD_FORMAT = 1
EVAL_RESULT = "eval.json"  # steps/eval.py's file name; not imported, so that no step module loads


@attrs.frozen
class Card:
    hash: str
    name: str
    config: dict[str, Any]  # flattened: `stages[0].train.lr` -> 0.003
    steps: tuple[tuple[str, str, str], ...]  # (label, kind, hash) in plan order

    def of_kind(self, kind: str) -> list[tuple[str, str, str]]:
        return [step for step in self.steps if step[1] == kind]


def _card_path(store: Store, plan_hash: str) -> Path:
    return store.root / "metrics" / "plans" / f"{plan_hash}.json"


def card_body(plan_hash: str, name: str, config: Any, steps: list[list[str]]) -> dict[str, Any]:
    return {"format": CARD_FORMAT, "plan": plan_hash, "name": name, "config": config, "steps": steps}


def load_card(store: Store, plan_hash: str) -> Card | None:
    """The plan's card, computed and kept on first use; None for a damaged plan."""
    path = _card_path(store, plan_hash)
    try:
        body = json.loads(path.read_bytes())
        seal = body.pop("seal")
        if (
            body.get("format") == CARD_FORMAT
            and body.get("plan") == plan_hash
            and seal == digest("card", body)
        ):
            return _card(body)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        plan = store.load_plan(plan_hash)
    except Exception:  # a damaged plan is listed as such; fsck says more
        return None
    config = flatten({"name": plan.name, **plan.config})
    body = card_body(plan.hash, plan.name, config, [[s.label, s.kind, s.hash] for s in plan.steps])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_durably(path, canonical_bytes({**body, "seal": digest("card", body)}))
    except OSError:  # a read-only store: computed again next time
        pass
    return _card(body)


def _card(body: dict[str, Any]) -> Card:
    steps = tuple((str(label), str(kind), str(h)) for label, kind, h in body["steps"])
    return Card(hash=body["plan"], name=str(body["name"]), config=dict(body["config"]), steps=steps)


def eval_result(store: Store, step_hash: str) -> dict[str, Any] | None:
    """The held-out result of a built eval step, read from its (small) output file."""
    try:
        body = json.loads((store.output(step_hash) / EVAL_RESULT).read_bytes())
        result = body["result"]
        return result if isinstance(result, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def plan_results(store: Store, card: Card) -> dict[str, Any]:
    """The numbers of one plan: final train loss and speed (last stage), held-out loss and bits
    per token, wall time (the sum over the executions that built its steps), build status."""
    built = [store.has_output(h) for _, _, h in card.steps]
    summaries = {h: read_step_metrics(store.root, h) for _, _, h in card.steps}
    trains = card.of_kind("train")
    last = summaries.get(trains[-1][2]) if trains else None
    train = (last or {}).get("train") or {}
    evals = card.of_kind("eval")
    result = eval_result(store, evals[-1][2]) if evals and built[card.steps.index(evals[-1])] else None
    walls = [s["wall_s"] for s in summaries.values() if s and isinstance(s.get("wall_s"), (int, float))]
    count = sum(built)
    return {
        "train_loss": train.get("final_loss"),
        "heldout_loss": (result or {}).get("loss"),
        "bits_per_token": (result or {}).get("bits_per_token"),
        "tokens_per_s": train.get("tokens_per_s"),
        "wall_s": round(sum(walls), 3) if walls else None,
        "status": "built"
        if count == len(built)
        else "not built"
        if count == 0
        else f"partial {count}/{len(built)}",
    }
