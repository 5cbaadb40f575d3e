"""Where each object lives on a remote (keys relative to the remote's root):

    blobs/<blake3>                          one file's bytes, named by their blake3
    steps/<step hash>.json                  a step output's MANIFEST.json, written after its blobs
    plans/<plan hash>.json                  a plan's bytes, framed by their blake3
    evals/<key>.json                        an evaluation entry's bytes, framed by their blake3
    work/<step hash>/<checkpoint>.json      a checkpoint's manifest, sealed to its step and name
    leases/<step hash>/<generation>.json    who builds a step now (see leases.py)
    attestations/<step hash>/<digest>.json  independent builds of a step (see attest.py)

Every name is checked before it becomes part of a key, so a key never climbs out of its folder.
"""

from __future__ import annotations

import re

HASH = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")
GENERATION_DIGITS = 12  # zero-padded, so generations list in order


def _hash(value: str, what: str) -> str:
    if not HASH.match(value):
        raise ValueError(f"{what} {value!r} is not a 64-hex digest")
    return value


def _name(value: str, what: str) -> str:
    if not NAME.match(value):
        raise ValueError(f"{what} {value!r}: use letters, digits, '.', '_' and '-', not starting with '.'")
    return value


def blob(blake3: str) -> str:
    return f"blobs/{_hash(blake3, 'blob digest')}"


def step(step_hash: str) -> str:
    return f"steps/{_hash(step_hash, 'step hash')}.json"


def plan(plan_hash: str) -> str:
    return f"plans/{_hash(plan_hash, 'plan hash')}.json"


def evaluation(key: str) -> str:
    return f"evals/{_name(key, 'evaluation key')}.json"


def checkpoints(step_hash: str) -> str:
    return f"work/{_hash(step_hash, 'step hash')}"


def checkpoint(step_hash: str, name: str) -> str:
    return f"{checkpoints(step_hash)}/{_name(name, 'checkpoint name')}.json"


def leases(step_hash: str) -> str:
    return f"leases/{_hash(step_hash, 'step hash')}"


def lease(step_hash: str, generation: int) -> str:
    if generation < 0 or generation >= 10**GENERATION_DIGITS:
        raise ValueError(f"lease generation {generation} out of range")
    return f"{leases(step_hash)}/{generation:0{GENERATION_DIGITS}d}.json"


def attestations(step_hash: str) -> str:
    return f"attestations/{_hash(step_hash, 'step hash')}"


def attestation(step_hash: str, record_digest: str) -> str:
    return f"{attestations(step_hash)}/{_hash(record_digest, 'attestation digest')}.json"


def name_in(folder: str, key: str) -> str | None:
    """The name of an object listed in `folder` (`plans/<h>.json` in `plans` -> `<h>`); None for
    a key of any other shape (a stray object, which listings skip)."""
    rest = key[len(folder) + 1 :] if key.startswith(f"{folder}/") else ""
    if "/" in rest or not rest.endswith(".json"):
        return None
    name = rest[: -len(".json")]
    return name if NAME.match(name) else None


def generation_of(key: str) -> int | None:
    """The generation a lease key names, None for any other key."""
    name = key.rpartition("/")[2]
    digits = name[: -len(".json")] if name.endswith(".json") else ""
    return int(digits) if len(digits) == GENERATION_DIGITS and digits.isdigit() else None
