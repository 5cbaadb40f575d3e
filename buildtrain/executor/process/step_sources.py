"""Where a data step's source files are now: found by content on this machine, or fetched from
the bucket the plan saw them in. Read when a step's job is written (`engine.job_of`) and by `bt
eval`; it starts no process (the local engine hands `spawn.py` the job `job_of` wrote)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from buildtrain.errors import StepFailed
from buildtrain.plan.plan import Plan, Step
from buildtrain.sources.data_url import is_object_url
from buildtrain.sources.stat_cache import SourceFile, StatCache, locate, whereabouts
from buildtrain.store.store import Store


def source_paths(
    store: Store, plan: Plan, step: Step, on_event: Callable[[dict[str, Any]], None] | None = None
) -> list[str]:
    """Find each source file of a data step by content (it may have moved since planning); a
    file found elsewhere than where the plan saw it is reported as a `source_found_elsewhere`
    event, so the terminal and the run record say where the bytes came from. A file planned from
    a bucket is taken from the store's source cache, or downloaded into it (`source_downloaded`)."""
    sources = step.inputs.get("sources", [])
    if not sources:
        return []
    hints = store.plans.meta(plan.hash).get("sources", {})
    if not isinstance(hints, dict):  # only hints: damaged ones are ignored, the digests decide
        hints = {}
    cache = store.stat_cache()
    found = []
    for source in sources:
        wanted = SourceFile(source["blake3"], source["size"])
        seen_at = [str(hint) for hint in hints.get(source["blake3"], [])]
        urls = [hint for hint in seen_at if is_object_url(hint)]
        local = [hint for hint in seen_at if not is_object_url(hint)]
        path = locate(cache, wanted, local)
        if path is None and urls:
            path = _from_bucket(store, cache, wanted, urls, step, on_event)
        elif path is None:
            raise StepFailed(
                f"{step.label}: {whereabouts(wanted, local)}; restore it, or plan again from the preset"
            )
        elif on_event is not None and str(path) not in local:
            on_event(
                {
                    "event": "source_found_elsewhere",
                    "level": "warning",
                    "label": step.label,
                    "blake3": source["blake3"],
                    "found_at": str(path),
                    "planned_at": seen_at,
                }
            )
        found.append(str(path))
    cache.save()
    return found


def _from_bucket(
    store: Store,
    cache: StatCache,
    wanted: SourceFile,
    urls: list[str],
    step: Step,
    on_event: Callable[[dict[str, Any]], None] | None,
) -> Path:
    """A data file planned from a bucket: the store's cached copy, else downloaded from a URL the
    plan saw it at (into the cache, checked against the plan as it is written); the next URL is
    tried when one no longer holds the planned bytes, and the last refusal is the error."""
    from buildtrain.store.source_cache import cached, fetch

    path = cached(store, cache, wanted)
    if path is not None:
        return path
    refused: StepFailed | None = None
    for url in urls:
        try:
            path = fetch(store, wanted, url)
        except StepFailed as exc:
            refused = exc
            continue
        if on_event is not None:
            on_event(
                {
                    "event": "source_downloaded",
                    "label": step.label,
                    "url": url,
                    "blake3": wanted.blake3,
                    "bytes": wanted.size,
                }
            )
        return path
    assert refused is not None  # `urls` is never empty here
    raise refused
