"""Human-readable text for plans, diffs and listings (the CLI prints it on stderr or stdout).

Plain text on purpose: these commands must stay instant, and they must read well in a CI log.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from buildtrain.kinds import KINDS
from buildtrain.plan.diff import Change, StepChange, flatten
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.stored import load_plan
from buildtrain.store.layout import SHORT
from buildtrain.store.store import Store

if TYPE_CHECKING:  # `bt show` and `bt ls` do not load the verifier
    from buildtrain.verify.verdicts import StepVerdict, Verification


def step_status(store: Store, step: Step) -> tuple[str, str]:
    """(action, reason) for one step, without hashing anything: the dry run of `bt run`."""
    if store.outputs.has(step.hash):
        return "cached", "output in store"
    newest = store.outputs.newest_checkpoint(step.hash)
    if newest is not None:
        return "will run", f"resume from checkpoint at step {newest[0]}"
    return "will run", "not built"


def plan_summary(store: Store, plan: Plan) -> str:
    statuses = [step_status(store, step) for step in plan.steps]
    cached = sum(action == "cached" for action, _ in statuses)
    width = max(len(step.label) for step in plan.steps)
    lines = [
        f"plan {plan.hash[:SHORT]} '{plan.name}': {len(plan.steps)} steps, "
        f"{cached} cached, {len(plan.steps) - cached} to run"
    ]
    for step, (action, reason) in zip(plan.steps, statuses, strict=True):
        lines.append(f"  {step.label:<{width}}  {step.hash[:SHORT]}  {action}: {reason}")
    return "\n".join(lines)


def _value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def show_text(store: Store, plan: Plan) -> str:
    meta = store.plans.meta(plan.hash)
    lines = [f"plan    {plan.hash}", f"name    {plan.name}"]
    if meta.get("preset"):
        lines.append(
            f"preset  {meta['preset']}"
            + (
                f"  (--set {' '.join(map(str, meta['overrides']))})"
                if isinstance(meta.get("overrides"), list) and meta["overrides"]
                else ""
            )
        )
    if meta.get("created"):
        lines.append(f"created {meta['created']}")
    lines.append("")
    lines.append("steps")
    by_hash = {step.hash: step.label for step in plan.steps}
    for step in plan.steps:
        action, reason = step_status(store, step)
        target = "  (target)" if step.hash in plan.targets else ""
        lines.append(f"  {step.label}  {step.hash}{target}")
        lines.append(f"      {action}: {reason}")
        for name, value in step.inputs.items():
            if name == "sources":
                total = sum(s["size"] for s in value)
                shown = f"{len(value)} files, {total} bytes" if value else "none (synthetic corpus)"
                lines.append(f"      <- sources: {shown}")
            elif value is not None:
                lines.append(f"      <- {name}: {by_hash.get(value, '?')} {value[:SHORT]}")
    lines.append("")
    lines.append("config")
    for key, value in flatten({"name": plan.name, **plan.config}).items():
        lines.append(f"  {key} = {_value(value)}")
    return "\n".join(lines)


def show_json(store: Store, plan: Plan) -> str:
    body = plan.to_body()
    body["hash"] = plan.hash
    body["meta"] = store.plans.meta(plan.hash)
    for step in body["steps"]:
        action, reason = step_status(store, plan.step(step["hash"]))
        step["status"] = {"action": action, "reason": reason}
    return json.dumps(body, indent=2)


def diff_text(a: Plan, b: Plan, changes: list[Change], steps: list[StepChange]) -> str:
    lines = [f"plan {a.hash[:SHORT]} -> {b.hash[:SHORT]}"]
    if not changes:
        lines.append("config: no differences")
    else:
        lines.append(f"config: {len(changes)} key(s) differ")
        for change in changes:
            lines.append(f"  {change.key}: {_value(change.before)} -> {_value(change.after)}")
    lines.append("steps:")
    width = max(len(s.label) for s in steps)
    for step in steps:
        line = f"  {step.label:<{width}}  {step.status}"
        if step.reasons:
            line += ": " + "; ".join(step.reasons)
        lines.append(line)
    invalid = [s.label for s in steps if s.status in ("invalidated", "added")]
    reused = [s.label for s in steps if s.status == "reused"]
    lines.append(f"{len(invalid)} step(s) to rebuild, {len(reused)} reused")
    return "\n".join(lines)


def diff_json(a: Plan, b: Plan, changes: list[Change], steps: list[StepChange]) -> str:
    return json.dumps(
        {
            "from": a.hash,
            "to": b.hash,
            "config": [{"key": c.key, "before": c.before, "after": c.after} for c in changes],
            "steps": [
                {
                    "label": s.label,
                    "status": s.status,
                    "before": s.before,
                    "after": s.after,
                    "reasons": list(s.reasons),
                }
                for s in steps
            ],
        },
        indent=2,
    )


def ls_rows(store: Store, plan_hashes: list[str] | None = None) -> list[dict[str, Any]]:
    rows = []
    for plan_hash in store.plans.hashes() if plan_hashes is None else plan_hashes:
        meta = store.plans.meta(plan_hash)
        created = meta.get("created") if isinstance(meta.get("created"), str) else "?"  # a hint only
        try:
            plan = load_plan(store, plan_hash)
        except Exception:  # a damaged plan is listed, not fatal; fsck says more
            rows.append(
                {
                    "hash": plan_hash,
                    "name": "?",
                    "created": created,
                    "steps": 0,
                    "status": "damaged",
                }
            )
            continue
        built = sum(store.outputs.has(step.hash) for step in plan.steps)
        status = (
            "built"
            if built == len(plan.steps)
            else ("not built" if built == 0 else f"partial {built}/{len(plan.steps)}")
        )
        rows.append(
            {
                "hash": plan_hash,
                "name": plan.name,
                "created": created,
                "steps": len(plan.steps),
                "status": status,
            }
        )
    rows.sort(key=lambda r: r["created"])
    return rows


def ls_text(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no plans in this store; compile one with: bt plan PRESET"
    header = f"{'plan':<{SHORT}}  {'name':<16}  {'created':<20}  {'steps':>5}  status"
    lines = [header]
    for row in rows:
        lines.append(
            f"{row['hash'][:SHORT]:<{SHORT}}  {row['name'][:16]:<16}  {row['created']:<20}  {row['steps']:>5}  {row['status']}"
        )
    return "\n".join(lines)


def verdict_line(verdict: StepVerdict) -> str:
    mark = {"reproduced": "✓", "diverged": "✗", "damaged": "✗", "not compared": "✗"}.get(verdict.status, "-")
    shown = ""
    kind = KINDS.get(verdict.kind)
    name = (kind.headline if kind is not None else None) or min(verdict.reexecuted, default="")
    if verdict.status == "reproduced" and len(verdict.reexecuted.get(name, "")) == 64:
        shown = f"{name} {verdict.reexecuted[name][:12]}"
    return f"  {mark} {verdict.label:<16} {verdict.status:<10} {shown}  {verdict.detail}".rstrip()


def verification_summary(verification: Verification) -> list[str]:
    """The closing lines of `bt verify`: what did not reproduce and why, or that all did."""

    def labels(status: str) -> str:
        return ", ".join(v.label for v in verification.with_status(status))

    lines = []
    if verification.with_status("damaged"):
        lines.append(
            f"DAMAGED STORE: the recorded output of {labels('damaged')} is damaged or not "
            "its step's; run bt fsck, then bt run to rebuild it"
        )
    if verification.with_status("diverged"):
        lines.append(f"NOT REPRODUCED: {labels('diverged')} differ from the recorded build")
    if verification.with_status("not compared"):
        lines.append(f"NOT VERIFIED: {labels('not compared')} could not be compared (see above)")
    if verification.reproduced:
        checked = len(verification.with_status("reproduced"))
        lines.append(
            f"reproduced: {checked} of {len(verification.verdicts)} steps match the recorded build bit for bit"
        )
    return lines
