"""An iterator advanced in a helper thread, a few items ahead of its consumer.

For a data file read in chunks: the read and the blake3 check of chunk k + 1 (`SourceReader`;
both release the GIL) run while the step works on chunk k. What the consumer sees is exactly
what the iterator yields, in order, and an exception it raises (a source that changed since
planning) is raised to the consumer at the same place. At most `depth` items wait, so memory
stays bounded; a consumer that stops early stops the thread, which closes the iterator (and so
its file). Needs no torch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

DEPTH = 4  # chunks waiting: 4 MB of 1 MB reads
_END = object()
POLL_SECONDS = 0.1  # how often a blocked producer looks whether its consumer has gone


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _produce(items: Iterator[T], out: queue.Queue[object], stop: threading.Event) -> None:
    try:
        for item in items:
            if not _put(out, item, stop):
                return
        _put(out, _END, stop)
    except BaseException as exc:
        _put(out, _Raised(exc), stop)
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


def _put(out: queue.Queue[object], item: object, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def read_ahead(items: Iterator[T], depth: int = DEPTH) -> Iterator[T]:
    """`items`, advanced in a helper thread up to `depth` items ahead of the caller."""
    out: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    thread = threading.Thread(target=_produce, args=(items, out, stop), name="read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item = out.get()
            if item is _END:
                return
            if isinstance(item, _Raised):
                raise item.error
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        thread.join()
