"""Plan metadata (`plans/<hash>.meta.json`): when and from which preset and files a plan was made.
Only hints, never in a hash; sealed by a digest that names its plan, so a damaged or moved record
is ignored rather than believed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from buildtrain.canonical import digest

META_FORMAT = 2  # sealed, names its plan


def seal_meta(plan_hash: str, meta: dict[str, Any]) -> bytes:
    """Plan metadata sealed by a digest over the plan hash and the whole record."""
    body = {"format": META_FORMAT, "plan": plan_hash, "meta": meta}
    return json.dumps({**body, "seal": digest("plan-meta", body)}, indent=1, sort_keys=True).encode()


def read_meta(path: Path, plan_hash: str) -> dict[str, Any] | None:
    """The metadata record of `plan_hash`, or None if it is absent, damaged or another plan's."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        raw = path.read_bytes()
        body = json.loads(raw)
        claimed = body.pop("seal")
        if (
            body.get("format") != META_FORMAT
            or body.get("plan") != plan_hash
            or claimed != digest("plan-meta", body)
        ):
            return None
        meta = body["meta"]
        return meta if isinstance(meta, dict) and seal_meta(plan_hash, meta) == raw else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
