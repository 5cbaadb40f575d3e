"""The one shape of every event in a run record: a JSON line with `event`, `level`, an ISO UTC
`timestamp` (microseconds) and the event's fields, sorted. The step processes (`configure`) and
the executor (`writing_to`) render through the same structlog processors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import structlog

PROCESSORS: list[Any] = [
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    structlog.processors.JSONRenderer(sort_keys=True),
]


def configure(stream: Any) -> Any:
    """A step process's logger, writing JSON lines to `stream` (the pipe the executor reads)."""
    structlog.configure(
        processors=PROCESSORS,
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger()


class _Sink:
    """A structlog logger that hands each rendered line to a function."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write

    def msg(self, message: str) -> None:
        self._write(message)

    info = warning = error = msg


def writing_to(write: Callable[[str], None]) -> Any:
    """A logger for the executor's own events, rendered like a step process's, without touching
    structlog's global configuration (a `bt verify` holds several records in one process)."""
    return structlog.wrap_logger(_Sink(write), processors=PROCESSORS)
