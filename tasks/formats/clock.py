"""The time a run takes as now: the wall clock, or ``SHARDSMITH_NOW`` where a test or the demo sets the nights."""

from __future__ import annotations

import os
from datetime import UTC, datetime

NOW_ENV = "SHARDSMITH_NOW"


def now() -> datetime:
    """Now, in UTC. ``SHARDSMITH_NOW`` (ISO 8601, e.g. ``2026-12-05T02:00:00Z``) replaces the wall
    clock for what keeping a dataset current decides (retries due, rechecks due, takedown entries'
    dates): the four-night test and ``shardsmith demo --nights`` run nights days apart in minutes."""
    fixed = os.environ.get(NOW_ENV)
    if not fixed:
        return datetime.now(UTC)
    try:
        when = datetime.fromisoformat(fixed.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{NOW_ENV}={fixed!r} is not an ISO 8601 time (2026-12-05T02:00:00Z)") from None
    return when.astimezone(UTC) if when.tzinfo is not None else when.replace(tzinfo=UTC)


def stamp() -> str:
    """``now()`` as a record writes it: ``2026-12-05T02:00:00Z``."""
    return now().strftime("%Y-%m-%dT%H:%M:%SZ")
