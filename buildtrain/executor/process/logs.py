"""The one shape of every event in a run record: a JSON line with `event`, `level`, an ISO UTC
`timestamp` (microseconds) and the event's fields, keys sorted.

A step process logs through structlog (`configure`), whose processors are the two functions here;
the executor renders its own events with the same functions (`event_line`) without importing
structlog, which would cost a null build about 90 ms of start-up.
"""

from __future__ import annotations

import json
from typing import Any

from buildtrain import clock


def with_timestamp(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    event["timestamp"] = clock.iso_micro()
    return event


def render(_: Any, __: str, event: dict[str, Any]) -> str:
    return json.dumps(event, sort_keys=True)


def event_line(event: str, level: str = "info", **fields: Any) -> str:
    """An executor event, exactly as a step process's logger would write it."""
    return render(None, level, with_timestamp(None, level, {"event": event, "level": level, **fields}))


def configure(stream: Any) -> Any:
    """A step process's logger, writing JSON lines to `stream` (the pipe the executor reads)."""
    import logging  # with structlog, only in a step process: a null build never pays for it

    import structlog

    structlog.configure(
        processors=[structlog.processors.add_log_level, with_timestamp, render],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger()
