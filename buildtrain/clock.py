"""UTC timestamps for records and metadata, never for anything hashed. Each stamp reads the clock
once, so its seconds and its fraction belong to the same moment."""

from __future__ import annotations

import datetime


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def iso_seconds(moment: datetime.datetime | None = None) -> str:
    """`2026-11-23T17:05:09Z`: plan metadata."""
    return (moment or utc_now()).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_micro(moment: datetime.datetime | None = None) -> str:
    """`2026-11-23T17:05:09.123456Z`: events in run records."""
    return (moment or utc_now()).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def compact(moment: datetime.datetime | None = None) -> str:
    """`20261123T170509Z`: run record folder names, which sort by time."""
    return (moment or utc_now()).strftime("%Y%m%dT%H%M%SZ")
