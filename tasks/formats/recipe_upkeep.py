"""Recipe models of keeping a dataset current: retries of passing failures, rechecks of released links, takedown lists."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.formats.recipe_base import Frozen

Action = Literal["keep", "drop"]


class RetryFailed(Frozen):
    """Rows whose last fetch failed for a passing reason (``tasks.formats.reasons.is_transient``:
    timeouts, 5xx, 429, connection and DNS errors, a shard deadline) are fetched again by a later
    run; rows that are ``ok`` or failed for a final reason (404, a refusal, bad content) never are.

    Args:
        enabled: retry on later runs. Default on.
        after_hours: the wait after a row's last attempt before it is due again; doubles with each
            further attempt (``after_hours * 2 ** (fetches - 1)``), so a host that stays down is
            asked less and less often. Default 20 hours: a nightly run retries last night's failures.
        max_attempts: runs that fetch a row, its first download included; after that its last
            outcome is final. Default 4.
    """

    enabled: bool = True
    after_hours: float = Field(default=20.0, ge=0, le=24 * 365)
    max_attempts: int = Field(default=4, ge=1, le=100)


class RecheckActions(Frozen):
    """What a release does with a released row a recheck found changed: ``keep`` it (reported in
    the diff and the report) or ``drop`` it (a ``rejected`` row with that reason).

    Args:
        link_dead: 404/410, or a host that did not answer ``recheck.dead_after`` checks in a row.
        content_changed: the URL now serves different bytes.
        opted_out: robots.txt, ``X-Robots-Tag`` or TDM-Rep now say no.
    """

    link_dead: Action = "keep"
    content_changed: Action = "keep"
    opted_out: Action = "drop"


class Recheck(Frozen):
    """Released rows checked again with conditional requests (ETag / Last-Modified; a ranged GET
    and the stored sha256 where the server gave neither), under the same URL policy and robots
    handling as the download.

    Args:
        enabled: recheck on later runs. Default on.
        every_days: a released row is due once its last check (or its download) is this old.
            Default 30.
        fraction: at most this share of the released rows is rechecked in one run (the oldest
            checks first), so the work of a night stays bounded. Default 0.05.
        dead_after: a host that cannot be reached (timeouts, connection and DNS errors, 5xx) this
            many checks in a row makes the row ``link_dead``. Default 3.
        actions: what a release does with each outcome (see ``RecheckActions``).
    """

    enabled: bool = True
    every_days: float = Field(default=30.0, ge=0, le=3650)
    fraction: float = Field(default=0.05, ge=0, le=1)
    dead_after: int = Field(default=3, ge=1, le=100)
    actions: RecheckActions = RecheckActions()


class TakedownList(Frozen):
    """One takedown list: a local file or an ``s3://`` object of entries, one a line (see
    docs/guide/upkeep.md): URLs, domains, sample keys, sha256 digests, perceptual hashes.

    Args:
        path: the list; a relative path is relative to the recipe's folder.
        name: how ledger rows and reports name the list (default: the file's name).
        phash_distance: a perceptual hash entry matches images whose 64-bit pHash differs in at
            most this many bits. Default 4.
    """

    path: str = Field(min_length=1)
    name: str | None = None
    phash_distance: int = Field(default=4, ge=0, le=16)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: object) -> object:
        return {"path": value} if isinstance(value, str) else value


class UpkeepGate(Frozen):
    """Bounds on what one run changes in the released rows, as shares of the previous release's
    samples; a run over a bound is blocked like any failed gate. ``None`` leaves it unbounded.

    Args:
        max_dead_rate: rows newly ``link_dead`` (kept or dropped).
        max_changed_rate: rows newly ``content_changed``.
        max_opted_out_rate: rows newly ``opted_out``.
        max_taken_down_rate: rows newly ``taken_down``.
        max_removed_rate: released rows missing from the new release, for any reason.
    """

    max_dead_rate: float | None = Field(default=None, ge=0, le=1)
    max_changed_rate: float | None = Field(default=None, ge=0, le=1)
    max_opted_out_rate: float | None = Field(default=None, ge=0, le=1)
    max_taken_down_rate: float | None = Field(default=None, ge=0, le=1)
    max_removed_rate: float | None = Field(default=None, ge=0, le=1)
