"""Lineage: what produced an output, down to the source files' digests, and the way back from weights.

`bt show PLAN --lineage` prints, for each target of a plan, the chain of steps that produced it:
each step's hash, kind, toolchain and sealed output digests, its upstream steps, and at the
bottom the content digests of the source files (or the synthetic corpus's settings).
`bt why DIGEST` goes the other way: it finds the stored step outputs that hold a file or declare
a digest (a line of an export's BLAKE3SUMS, say) and names the plans and steps that produced it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from buildtrain.errors import UsageError
from buildtrain.plan.card import load_card
from buildtrain.plan.plan import Plan, Step
from buildtrain.store.layout import CHECKSUMS, EXPORT_WEIGHTS, SHORT
from buildtrain.store.objects import MANIFEST
from buildtrain.store.plans import HEX
from buildtrain.store.store import Store

MIN_DIGEST = 8


def _sealed(store: Store, step_hash: str) -> dict[str, str]:
    try:
        body = json.loads((store.outputs.path(step_hash) / MANIFEST).read_bytes())
        return dict(body.get("digests") or {})
    except (OSError, ValueError, AttributeError):
        return {}


def step_node(store: Store, plan: Plan, step: Step, sources: dict[str, list[str]]) -> dict[str, Any]:
    """One step of the lineage with its inputs resolved, recursively (JSON-ready)."""
    inputs: dict[str, Any] = {}
    for name, value in step.inputs.items():
        if name == "sources":
            inputs["sources"] = [
                {"blake3": s["blake3"], "size": s["size"], "seen_at": sources.get(s["blake3"], [])}
                for s in value
            ]
            if not value:
                inputs["sources"] = {"synthetic": step.config.get("data", {}).get("synthetic")}
        elif isinstance(value, str):
            inputs[name] = step_node(store, plan, plan.step(value), sources)
        else:
            inputs[name] = None
    return {
        "label": step.label,
        "kind": step.kind,
        "hash": step.hash,
        "built": store.outputs.has(step.hash),
        "outputs": _sealed(store, step.hash),
        "toolchain": dict(step.toolchain),
        "inputs": inputs,
    }


def lineage(store: Store, plan: Plan) -> list[dict[str, Any]]:
    sources = store.plans.meta(plan.hash).get("sources")
    known = sources if isinstance(sources, dict) else {}
    return [step_node(store, plan, plan.step(target), known) for target in plan.targets]


def _toolchain_text(toolchain: dict[str, Any]) -> str:
    return ", ".join(
        f"{key}={value[:SHORT] if isinstance(value, str) and len(value) == 64 else value}"
        for key, value in sorted(toolchain.items())
    )


def lineage_text(plan: Plan, nodes: list[dict[str, Any]]) -> str:
    lines = [f"lineage of plan {plan.hash[:SHORT]} '{plan.name}'"]
    shown: set[str] = set()

    def walk(node: dict[str, Any], depth: int, via: str) -> None:
        pad = "  " * depth
        head = (
            f"{pad}{via}{node['label']}  {node['hash'][:SHORT]}  {'built' if node['built'] else 'not built'}"
        )
        if node["hash"] in shown:
            lines.append(head + "  (as above)")
            return
        shown.add(node["hash"])
        lines.append(head)
        for name, value in sorted(node["outputs"].items()):
            lines.append(f"{pad}    output {name}: {value}")
        lines.append(f"{pad}    toolchain: {_toolchain_text(node['toolchain'])}")
        for name, value in node["inputs"].items():
            if name == "sources":
                if isinstance(value, dict):
                    lines.append(
                        f"{pad}    <- sources: synthetic corpus {json.dumps(value['synthetic'], sort_keys=True)}"
                    )
                for source in value if isinstance(value, list) else []:
                    where = f"  (seen at {source['seen_at'][0]})" if source["seen_at"] else ""
                    lines.append(
                        f"{pad}    <- source blake3 {source['blake3']}  {source['size']} bytes{where}"
                    )
            elif value is None:
                continue
            else:
                walk(value, depth + 2, f"<- {name}: ")

    for node in nodes:
        walk(node, 1, "")
    return "\n".join(lines)


def _wanted(text: str) -> tuple[str, str]:
    """(digest or prefix, where it came from): a digest, a BLAKE3SUMS file, an export folder, or
    any other file (its own blake3: an exported model.safetensors names the weights it holds)."""
    path = Path(text)
    if path.is_dir():
        path = path / CHECKSUMS
    if path.is_file() and path.name != CHECKSUMS:
        from buildtrain.store.objects import hash_file

        try:
            return hash_file(path)[0], f"the blake3 of {path}"
        except OSError as exc:
            raise UsageError(f"{text}: cannot read ({exc.strerror or exc})") from None
    if path.is_file():
        try:
            for line in path.read_text(encoding="utf-8").splitlines():
                value, _, name = line.partition("  ")
                if name.strip() == EXPORT_WEIGHTS:
                    return value.strip().lower(), f"{EXPORT_WEIGHTS} in {path}"
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{text}: cannot read ({exc})") from None
        raise UsageError(f"{path}: no {EXPORT_WEIGHTS} line; give a digest from it instead")
    value = text.strip().lower()
    if not HEX.match(value) or len(value) < MIN_DIGEST:
        raise UsageError(
            f"{text!r} is not a digest (at least {MIN_DIGEST} hex digits), an export folder or a BLAKE3SUMS file"
        )
    return value, "digest"


def why(store: Store, text: str) -> dict[str, Any]:
    """Every stored output holding a file or declaring a digest that starts with the given one,
    with the plans (and their step labels) that contain the step which produced it."""
    wanted, origin = _wanted(text)
    found = []
    for manifest in sorted(store.steps.glob(f"*/{MANIFEST}")) if store.steps.is_dir() else []:
        try:
            body = json.loads(manifest.read_bytes())
        except (OSError, ValueError):
            continue
        step_hash = manifest.parent.name
        hits = [
            f"file {n}"
            for n, f in (body.get("files") or {}).items()
            if str(f.get("blake3", "")).startswith(wanted)
        ]
        hits += [f"digest {n}" for n, d in (body.get("digests") or {}).items() if str(d).startswith(wanted)]
        if hits:
            found.append({"step": step_hash, "matches": hits, "plans": _plans_with(store, step_hash)})
    return {"digest": wanted, "from": origin, "found": found}


def _plans_with(store: Store, step_hash: str) -> list[dict[str, Any]]:
    plans = []
    for plan_hash in store.plans.hashes():
        card = load_card(store, plan_hash)
        if card is None:
            continue
        for label, _, h in card.steps:
            if h == step_hash:
                meta = store.plans.meta(plan_hash)
                plans.append(
                    {
                        "plan": plan_hash,
                        "name": card.name,
                        "label": label,
                        "preset": meta.get("preset"),
                        "overrides": meta.get("overrides", []),
                    }
                )
    return plans


def why_text(result: dict[str, Any]) -> str:
    if not result["found"]:
        return f"no stored output holds {result['digest']} ({result['from']}); bt gc may have removed it"
    lines = []
    for item in result["found"]:
        lines.append(f"{', '.join(item['matches'])} of step output {item['step']}")
        for plan in item["plans"]:
            sets = f" --set {' '.join(plan['overrides'])}" if plan["overrides"] else ""
            lines.append(
                f"  produced by {plan['label']} of plan {plan['plan'][:SHORT]} '{plan['name']}'"
                f" (bt show {plan['plan'][:SHORT]} --lineage; planned from {plan['preset']}{sets})"
            )
        if not item["plans"]:
            lines.append("  no stored plan contains this step any more")
    return "\n".join(lines)
