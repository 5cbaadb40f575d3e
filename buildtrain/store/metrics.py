"""A built step's metrics summary, `metrics/steps/<step hash>.json`: final training loss, held-out
results, median tokens/s and wall time of the execution that built it (the executor's
`MetricsCollector` computes it; `bt ls --metrics` and `bt report` read it; `bt fsck` checks it).

The file is framed like a plan card: its first line is the blake3 of the rest, checked on every
read (hashing raw bytes is C-speed, a canonical re-encoding is not), and the body names its step.
An edited, damaged or moved summary is never shown: the table prints a blank, fsck reports it and
`bt fsck --repair` removes it. The numbers cannot be re-derived from the output (speed and wall
time are not part of any output), so they are sealed, not recomputed.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from buildtrain.sources.durable import framed, unframed

METRICS_FORMAT = 2  # 2: framed by the blake3 of its body (format 1 was unsealed)


def encode(body: dict[str, Any]) -> bytes:
    return framed(json.dumps({**body, "format": METRICS_FORMAT}, indent=1, sort_keys=True).encode())


def step_metrics_problem(path: str, step_hash: str) -> tuple[dict[str, Any] | None, str | None]:
    """(summary, None) when `path` holds the sealed summary of `step_hash`; (None, why) when it is
    damaged, foreign or unsealed; (None, None) when there is none."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as file:  # never through a link
            raw = unframed(file.read())
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, "a symbolic link" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror or exc})"
    if raw is None:
        return None, "does not match its digest (edited, damaged, or written unsealed by an older bt)"
    try:
        body = json.loads(raw)
    except ValueError:
        return None, "not JSON"
    if not isinstance(body, dict) or body.get("format") != METRICS_FORMAT or body.get("step") != step_hash:
        return None, "another step's summary, or an unknown format"
    return body, None


def read_step_metrics(path: str, step_hash: str) -> dict[str, Any] | None:
    """The summary of a built step, or None when absent or not sound (a blank, never an error)."""
    return step_metrics_problem(path, step_hash)[0]
