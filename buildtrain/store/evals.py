"""The evaluation cache's files: `evals/<key>.json`, addressed by what determines the result.

The key is computed here and nowhere else (`key_of`): the eval step, the executor completing a
cached evaluation without a process, `bt gc` keeping the entries its outputs name, and `bt fsck`
checking entries all call it. Torch-free and plan-free. Each entry is sealed by a digest over its
key, its identity and its result (`seal_entry`), and is used only if that verifies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.store.layout import EVAL_RESULT

ENTRY_FORMAT = 1


def key_of(identity: dict[str, Any]) -> str:
    """The content address of an evaluation with this identity."""
    return digest("eval", identity)


def seal_entry(key: str, body: dict[str, Any]) -> bytes:
    """The bytes of `evals/<key>.json`: the key, the identity and the result under one digest, so
    an edited value, or an entry copied under another key, does not verify."""
    sealed = {"format": ENTRY_FORMAT, "key": key, "identity": body["identity"], "result": body["result"]}
    return canonical_bytes({**sealed, "seal": digest("eval-entry", sealed)})


def entry_problem(path: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the result body, None) when `path` holds the sealed result of `key`; (None, why) when it
    is damaged or foreign; (None, None) when there is nothing there."""
    if not path.exists() and not path.is_symlink():
        return None, None
    if path.is_symlink():
        return None, "a symbolic link, not an evaluation result"
    if not path.is_file():
        return None, "not a regular file"
    try:
        raw = path.read_bytes()
        entry = json.loads(raw)
        claimed = entry.pop("seal")
        if entry.get("format") != ENTRY_FORMAT or entry.get("key") != key:
            return None, "sealed for another key (a foreign result)"
        if claimed != digest("eval-entry", entry) or canonical_bytes({**entry, "seal": claimed}) != raw:
            return None, "content does not match its seal"
        if key_of(entry["identity"]) != key or not isinstance(entry["result"], dict):
            return None, "identity does not match its key"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"unreadable ({type(exc).__name__})"
    return {"identity": entry["identity"], "result": entry["result"]}, None


def keys_of_output(output: Path) -> list[str]:
    """The cache keys an eval step's output names, if it holds a readable result: the held-out
    result's, then each suite's (`bt gc` keeps those entries)."""
    path = output / EVAL_RESULT
    if path.is_symlink() or not path.is_file():
        return []
    try:
        body = json.loads(path.read_bytes())
        suites = body.get("suites", {})
        points = [point for curve in body.get("curves", {}).values() for point in curve]
        return [
            key_of(body["identity"]),
            *(key_of(suite["identity"]) for suite in suites.values()),
            *(key_of(point["identity"]) for point in points),
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def output_entries(output: Path) -> dict[str, dict[str, Any]]:
    """The cache entry bodies ({"identity", "result"}) an eval step's output holds, by key: the
    held-out result, each suite's, each point of a curve ({} when it holds no readable result)."""
    try:
        body = json.loads((output / EVAL_RESULT).read_bytes())
        parts = [body, *body.get("suites", {}).values()]
        parts += [point for curve in body.get("curves", {}).values() for point in curve]
        found = [{"identity": part["identity"], "result": part["result"]} for part in parts]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return {key_of(entry["identity"]): entry for entry in found}


def output_result(output: Path) -> dict[str, Any] | None:
    """The held-out result an eval step's output records (read from its small file; the output's
    manifest is checked by fsck and by every step that reads it as an input)."""
    try:
        result = json.loads((output / EVAL_RESULT).read_bytes())["result"]
        return result if isinstance(result, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def output_suites(output: Path) -> dict[str, dict[str, Any]]:
    """Each benchmark suite's result an eval step's output records, by suite name."""
    try:
        suites = json.loads((output / EVAL_RESULT).read_bytes()).get("suites", {})
        return {name: dict(suite["result"]) for name, suite in suites.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def output_curves(output: Path) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Each suite's (update, result) points an eval step's output records (`checkpoints_every`)."""
    try:
        curves = json.loads((output / EVAL_RESULT).read_bytes()).get("curves", {})
        return {
            name: [(int(p["update"]), dict(p["result"])) for p in points] for name, points in curves.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
