"""Plans in the store: the store keeps a plan's canonical bytes under its hash; this module turns
a plan into those bytes and back, and trusts bytes read back only once they decode to a plan whose
hash is the name they were found under."""

from __future__ import annotations

import json
from typing import Any

from buildtrain.errors import BuildtrainError, CorruptObject
from buildtrain.kinds import KINDS
from buildtrain.plan.plan import Plan
from buildtrain.store.store import Store


def save_plan(store: Store, plan: Plan, **meta: Any) -> dict[str, Any]:
    """Store the plan's canonical bytes; returns its metadata record (when and from where).
    Creates the store in a new or empty folder, and refuses a folder that is not a store."""
    claim_store(store)
    return store.plans.save(plan.hash, plan.canonical(), **meta)


def load_plan(store: Store, ref: str) -> Plan:
    """The stored plan that `ref` (a hash or unique prefix) names, checked against its name."""
    plan_hash, raw = store.plans.read(ref)
    try:
        plan = Plan.from_body(json.loads(raw), kinds=KINDS)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptObject(
            f"plan {plan_hash[:12]} in {store.root} is damaged ({exc}); run bt fsck, "
            "then plan it again from its preset (bt plan PRESET)"
        ) from None
    if plan.hash != plan_hash or plan.canonical() != raw:
        raise CorruptObject(f"plan {plan_hash[:12]} does not match its hash; run bt fsck")
    return plan


def claim_store(store: Store, *, create: bool = True) -> bool:
    """Make sure `store.root` is a buildtrain store before anything writes or removes there:
    marked; new or empty (marked now, with `create`); or made by a bt from before markers: only
    store folders at its top and a plan that verifies (marked now). Anything else (a home folder,
    a project: `--store ~` is one typo away) raises `UsageError` and nothing is touched. False
    when there is nothing there and `create` is off."""
    found = store.identity()
    if found == "marked":
        return True
    if found == "new":
        if create:
            store.mark()
        return create
    if found == "unmarked" and any(_verifies(store, plan_hash) for plan_hash in store.plans.hashes()):
        store.mark()
        return True
    raise store.not_a_store()


def _verifies(store: Store, plan_hash: str) -> bool:
    try:
        load_plan(store, plan_hash)
    except BuildtrainError:
        return False
    return True
