"""Rechecks of released rows: which are due, a conditional request for each under the download's URL policy, and each chunk's new recheck state."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, BinaryIO

import aiohttp
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats import recheck_store
from tasks.formats.ledger import read_ledger_with, read_parquet
from tasks.formats.recipe_download import DownloadConfig
from tasks.formats.storage import Storage
from tasks.stages.fetch import Fetcher
from tasks.stages.fetch_body import CHUNK, content_range, stream_capped, validators
from tasks.stages.fetched import Fetched
from tasks.stages.release import latest, releases_dir

# A recheck's answers that say the link is gone for good (451: gone for legal reasons).
DEAD_STATUS = ("http_404", "http_410", "http_451")
# Refusals of the sites' opt-outs: robots.txt now disallowing the path is an opt-out too.
OPT_OUT_REASONS = ("opted_out", "robots_disallowed")
_TS = pa.timestamp("us", tz="UTC")
_LEDGER_COLUMNS = ["key", "source", "row", "status", "url", "sha256", "bytes"]
_FETCH_FACTS = ["etag", "last_modified", "fetched_at"]


@dataclass(frozen=True)
class DueRow:
    """One released row to check again, with what the check compares against.

    Args:
        key, source, row, url: the row as its download ledger has it.
        sha256, bytes: of the body the download kept (the released bytes).
        etag, last_modified: the validators sent back: the last check's where it saw the
            released bytes, else the download's; None where there were none (a ranged GET then).
        misses: the checks in a row before this one that could not reach the host.
        changed, changed_sha256: where the last check found the content changed (and the server
            gave validators for the new bytes): what it saw, and the new bytes' sha256. The
            validators sent are then that check's, so a 304 says "still changed" without a body
            read, while a 200 with the released bytes again says ``unchanged``.
    """

    key: str
    source: str
    row: int
    url: str
    sha256: str | None
    bytes: int | None
    etag: str | None = None
    last_modified: str | None = None
    misses: int = 0
    changed: str | None = None
    changed_sha256: str | None = None


@dataclass(frozen=True)
class ChunkPlan:
    """The due rows of one download chunk, and the recheck version their states go to.

    Args:
        source, chunk: the source and the chunk's stem (``recheck_store.chunk_stem``).
        gen, previous: the version to write (one past the latest), and the latest's path (None: none yet).
        rows: the rows to check, oldest check first.
    """

    source: str
    chunk: str
    gen: int
    previous: str | None
    rows: tuple[DueRow, ...]


@dataclass(frozen=True)
class RecheckPlan:
    """What one run rechecks.

    Args:
        released: released rows that could be rechecked (ok in the current download ledgers).
        due: of those, the rows due (``download.recheck.every_days`` since their last check).
        chunks: the due rows this run checks (at most ``fraction`` of ``released``), by chunk.
        next_at: the earliest time a released row falls due once this run's checks are done
            (now where due rows are left over); with no release yet, the earliest time an ok row
            of the download does (the release to follow takes its rows from them); None without
            such rows.
    """

    released: int = 0
    due: int = 0
    chunks: tuple[ChunkPlan, ...] = ()
    next_at: datetime | None = None

    @property
    def rows(self) -> int:
        return sum(len(c.rows) for c in self.chunks)


@dataclass(frozen=True)
class ChunkResult:
    """What one chunk's recheck reports to the flow: counts, never rows.

    Args:
        source, chunk: as ``ChunkPlan``.
        version: the recheck version written.
        counts: rows per outcome (``tasks.formats.reasons.RECHECK_OUTCOMES``).
        rows: rows checked; rows still under way at ``download.shard_timeout_s`` keep their last
            state and stay due.
        bytes_read: body bytes read over all checks (none for a 304).
        seconds: spent on the chunk.
    """

    source: str
    chunk: str
    version: str
    counts: dict[str, int]
    rows: int
    bytes_read: int
    seconds: float


@dataclass
class RecheckSummary:
    """What a run's recheck did, for the run's summary (``out["recheck"]``).

    Args:
        enabled: ``download.recheck.enabled`` and a fraction over 0.
        released: released rows that could be rechecked; due: of them, the due rows.
        checked: rows checked this run; counts: of them, per outcome.
        bytes_read: body bytes read; chunks: chunk tasks run; seconds: the recheck's wall time.
        next_recheck_at: when the earliest released row falls due (with no release yet: the
            earliest ok row of the download, which the release to follow takes from); None where
            the recheck is off or there is no such row.
        versions: the recheck versions written.
    """

    enabled: bool = False
    released: int = 0
    due: int = 0
    checked: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    chunks: int = 0
    seconds: float = 0.0
    next_recheck_at: datetime | None = None
    versions: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- which rows are due


def released_rows(storage: Storage, recipe: Any, ledgers: list[str], version: str | None) -> pa.Table:
    """The rows of release ``version`` that a recheck can check: ok in the download ``ledgers``
    (the current version of each chunk) of a URL-manifest source, with the chunk (``chunk``),
    the fetch facts (null in older ledgers) and the latest recheck state (``st_*``, null where
    none). With no release (``version`` None), every ok row of those ledgers."""
    sources = set(recipe.fetched_sources)
    empty = _released_schema().empty_table()
    if not sources:
        return empty
    fetched = [rel for rel in ledgers if rel.split("/")[-2] in sources]  # {dataset}/download/{source}/{name}
    parts = []
    for rel in fetched:
        t = read_ledger_with(storage, rel, _LEDGER_COLUMNS, _FETCH_FACTS)
        t = t.filter(pc.equal(t.column("status"), "ok")).drop_columns(["status"])
        parts.append(t.append_column("chunk", pa.array([recheck_store.chunk_stem(rel)] * t.num_rows, pa.string())))
    if not parts:
        return empty
    rows = pa.concat_tables(parts)
    if version is not None:
        samples = read_parquet(storage, f"{releases_dir(recipe.dataset)}/{version}/samples.parquet", ["source", "row"])
        # A video's clips share its row: one check per row.
        released = samples.group_by(["source", "row"]).aggregate([])
        rows = rows.join(released, keys=["source", "row"], join_type="inner")
    state = recheck_store.read_current(storage, recipe.dataset, fetched)
    columns = ["key", "checked_at", "outcome", "misses", "etag", "last_modified", "detail", "sha256"]
    state = state.select(columns).rename_columns(["key", *(f"st_{c}" for c in columns[1:])])
    rows = rows.join(state, keys="key", join_type="left outer")
    return rows.select(_released_schema().names).cast(_released_schema()).sort_by([("key", "ascending")])


def _released_schema() -> pa.Schema:
    return pa.schema(
        [
            ("key", pa.string()),
            ("source", pa.string()),
            ("row", pa.int64()),
            ("url", pa.string()),
            ("sha256", pa.string()),
            ("bytes", pa.int64()),
            ("etag", pa.string()),
            ("last_modified", pa.string()),
            ("fetched_at", _TS),
            ("chunk", pa.string()),
            ("st_checked_at", _TS),
            ("st_outcome", pa.string()),
            ("st_misses", pa.int32()),
            ("st_etag", pa.string()),
            ("st_last_modified", pa.string()),
            ("st_detail", pa.string()),
            ("st_sha256", pa.string()),
        ]
    )


def plan_recheck(storage: Storage, recipe: Any, ledgers: list[str], now: datetime) -> RecheckPlan:
    """The rows this run rechecks: released rows whose last check (or, never checked, their
    download; neither known: due) is ``every_days`` old, oldest first, at most
    ``ceil(fraction x released rows)``; nothing where the recheck is off or its fraction 0."""
    cfg = recipe.download.recheck
    if not cfg.enabled or cfg.fraction <= 0:
        return RecheckPlan()
    version = latest(storage, recipe.dataset)
    rows = released_rows(storage, recipe, ledgers, version)
    every = timedelta(days=cfg.every_days)
    last = pc.coalesce(rows.column("st_checked_at"), rows.column("fetched_at"))
    rows = rows.append_column("last", last)
    if version is None or rows.num_rows == 0:
        return RecheckPlan(next_at=next_due(rows, pa.array([], pa.string()), now, every))
    due_mask = pc.or_kleene(pc.is_null(last), pc.less_equal(last, pa.scalar(now - every, _TS)))
    due = rows.filter(pc.fill_null(due_mask, True))
    due = due.sort_by([("last", "ascending", "at_start"), ("key", "ascending")])
    taken = due.slice(0, math.ceil(cfg.fraction * rows.num_rows))
    return RecheckPlan(
        released=rows.num_rows,
        due=due.num_rows,
        chunks=tuple(_chunk_plans(storage, recipe.dataset, taken)),
        next_at=next_due(rows, taken.column("key"), now, every),
    )


def next_due(rows: pa.Table, checked: pa.Array | pa.ChunkedArray, now: datetime, every: timedelta) -> datetime | None:
    """The earliest time one of ``rows`` (with their ``last`` check) falls due once the rows
    ``checked`` (keys) are checked ``now``: a row never checked nor fetched at a known time is
    due now."""
    if rows.num_rows == 0:
        return None
    now_ts = pa.scalar(now, _TS)
    last = pc.if_else(pc.is_in(rows.column("key"), value_set=pa.array(checked, pa.string())), now_ts, rows["last"])
    earliest = pc.min(pc.fill_null(last, pa.scalar(now - every, _TS))).as_py()
    return earliest + every


def _chunk_plans(storage: Storage, dataset: str, taken: pa.Table) -> Iterable[ChunkPlan]:
    by_chunk: dict[tuple[str, str], list[DueRow]] = {}
    for r in taken.to_pylist():
        # The last check's validators: of the released bytes, or of the changed ones it saw.
        own = r["st_outcome"] is not None and bool(r["st_etag"] or r["st_last_modified"])
        changed = own and r["st_outcome"] == "content_changed"
        by_chunk.setdefault((r["source"], r["chunk"]), []).append(
            DueRow(
                key=r["key"],
                source=r["source"],
                row=r["row"],
                url=r["url"],
                sha256=r["sha256"],
                bytes=r["bytes"],
                etag=r["st_etag"] if own else r["etag"],
                last_modified=r["st_last_modified"] if own else r["last_modified"],
                misses=r["st_misses"] or 0,
                changed=r["st_detail"] if changed else None,
                changed_sha256=r["st_sha256"] if changed else None,
            )
        )
    versions = {source: recheck_store.latest_versions(storage, dataset, source) for source in {s for s, _ in by_chunk}}
    for (source, chunk), rows in sorted(by_chunk.items()):
        gen, previous = versions[source].get(chunk, (0, None))
        yield ChunkPlan(source, chunk, gen + 1, previous, tuple(rows))


# --------------------------------------------------------------------------- one row's check


class CheckBody:
    """A recheck's answer to one row's request (a :class:`tasks.stages.fetch_body.Body`): the
    body is hashed as it streams, never kept, and compared with the released one.

    With validators the request is conditional (``If-None-Match``, ``If-Modified-Since``): a 304
    is unchanged with no body read. Without, it asks ``Range: bytes=0-(size-1)``: a 206 whose
    complete length, or a 200 whose Content-Length, differs from the stored size is changed
    without reading on, as is a 416 (the file is shorter now). Otherwise the body is read, at
    most the stored size (more is a change too), and its sha256 compared.

    Args:
        row: the row checked.
        cap: the most bytes read where the stored size is unknown (``download.max_bytes``).
        deadline_s: the whole attempt's deadline (images), or None for stalls only (videos).
        stall_s: the longest wait for headers or for the next bytes.
    """

    def __init__(self, row: DueRow, cap: int, deadline_s: float | None, stall_s: float):
        self.row = row
        self.cap = row.bytes if row.bytes else cap
        self.deadline_s = deadline_s
        self.timeout = (
            None
            if deadline_s is not None
            else aiohttp.ClientTimeout(total=None, sock_connect=stall_s, sock_read=stall_s)
        )
        self.changed: str | None = None  # why the body is not the released one
        self.sha256: str | None = None
        self.read = 0  # body bytes read, over every attempt
        self.etag: str | None = None
        self.last_modified: str | None = None

    @property
    def conditional(self) -> bool:
        return bool(self.row.etag or self.row.last_modified)

    def headers(self) -> dict[str, str] | None:
        if self.conditional:
            sent = {"If-None-Match": self.row.etag, "If-Modified-Since": self.row.last_modified}
            return {name: value for name, value in sent.items() if value}
        return {"Range": f"bytes=0-{self.row.bytes - 1}"} if self.row.bytes else None

    def accepts(self, status: int) -> bool:
        return status in (200, 206, 304, 416)

    async def receive(self, resp: aiohttp.ClientResponse) -> Fetched:
        self.changed, self.sha256 = None, None
        self.etag, self.last_modified = validators(resp)
        status, size = resp.status, self.row.bytes
        if status == 304:
            return Fetched(http_status=status)
        if status == 416:
            self.changed = f"HTTP 416 to {self._asked()}: the file is shorter than the released {size} bytes"
            return Fetched(http_status=status)
        if status == 206:
            shown = resp.headers.get("Content-Range")
            got = content_range(shown)
            if got is not None and got[2] is not None and size and got[2] != size:
                self.changed = f"HTTP 206, Content-Range {shown}: {got[2]} bytes, the released file {size}"
                return Fetched(http_status=status)
            if got is None or got[0] != 0 or (size and got[1] != size - 1):
                return Fetched(
                    reason="fetch_failed", http_status=status, detail=f"Content-Range {shown!r} to {self._asked()}"
                )
        elif size and resp.content_length is not None and resp.content_length != size:
            self.changed = f"HTTP {status}, Content-Length {resp.content_length}: the released file has {size} bytes"
            return Fetched(http_status=status)
        hasher = hashlib.sha256()

        def write(chunk: bytes) -> None:
            hasher.update(chunk)
            self.read += len(chunk)

        start = self.read
        problem = await stream_capped(resp, self.cap, write, cap_name="the released size")
        self._compare(hasher, self.read - start, problem)
        return Fetched(http_status=status, size=self.read - start)

    def read_object(self, fh: BinaryIO) -> Fetched:
        hasher, n, problem = hashlib.sha256(), 0, None
        while chunk := fh.read(CHUNK):
            n += len(chunk)
            self.read += len(chunk)
            if n > self.cap:
                problem = f"more than the released size ({self.cap})"
                break
            hasher.update(chunk)
        self._compare(hasher, n, problem)
        return Fetched(size=n)

    def _compare(self, hasher: Any, n: int, problem: str | None) -> None:
        size, released = self.row.bytes, self.row.sha256
        if problem is not None:
            self.changed = problem
            return
        self.sha256 = hasher.hexdigest()
        if (size is not None and n != size) or self.sha256 != released:
            ours = (released or "")[:16]
            self.changed = f"{n} bytes of sha256 {self.sha256[:16]}..., the released {size} of sha256 {ours}..."

    def _asked(self) -> str:
        return "Range bytes=0-" + str((self.row.bytes or 0) - 1)


@dataclass(frozen=True)
class Check:
    """One row's recheck as the recheck state records it (``recheck_store.RECHECK_SCHEMA``)."""

    outcome: str
    http_status: int | None
    detail: str | None
    misses: int
    etag: str | None
    last_modified: str | None
    sha256: str | None
    bytes_read: int


def judge_check(row: DueRow, fetched: Fetched, body: CheckBody, dead_after: int) -> Check:
    """The outcome of one row's request: ``unchanged`` (304, or the same bytes), ``content_changed``,
    ``opted_out`` (robots.txt, X-Robots-Tag, TDM-Rep), ``link_dead`` (404, 410, 451, or the
    ``dead_after``-th miss in a row) or ``unreachable`` (anything else: timeouts, connection and DNS
    errors, 5xx after the download's retries, a URL the policy now refuses)."""
    status, reason = fetched.http_status, fetched.reason
    # The validators kept describe the released bytes (they are sent next time), but after a change.
    sent = (row.etag, row.last_modified)
    seen = (body.etag or row.etag, body.last_modified or row.last_modified) if body.etag or body.last_modified else sent
    if reason is None and body.changed is not None:
        return Check("content_changed", status, body.changed, 0, body.etag, body.last_modified, body.sha256, body.read)
    if reason is None:
        detail = "the released bytes" if status is None else f"HTTP {status}: the released bytes"
        if status == 304:
            if row.changed is not None:  # not modified since the check that found it changed
                return Check("content_changed", status, row.changed, 0, *seen, row.changed_sha256, body.read)
            detail = "HTTP 304 Not Modified"
        return Check("unchanged", status, detail, 0, *seen, body.sha256, body.read)
    if reason in OPT_OUT_REASONS:
        return Check("opted_out", status, fetched.detail, 0, *sent, None, body.read)
    detail = f"{reason}: {fetched.detail}" if fetched.detail else reason
    if reason in DEAD_STATUS:
        return Check("link_dead", status, detail, 0, *sent, None, body.read)
    misses = row.misses + 1
    if misses >= dead_after:
        detail = f"not reached in {misses} checks in a row; the last: {detail}"
        return Check("link_dead", status, detail, misses, *sent, None, body.read)
    return Check("unreachable", status, detail, misses, *sent, None, body.read)


async def check_rows(
    rows: Iterable[DueRow], cfg: DownloadConfig, dead_after: int, video: bool = False, s3_options: dict | None = None
) -> dict[str, Check]:
    """Each row's check (by key), concurrently under the download's limits; rows still under way
    at ``download.shard_timeout_s`` are left out (they stay due)."""
    rows = list(rows)

    async def one(fetcher: Fetcher, row: DueRow) -> Check:
        body = CheckBody(row, cfg.max_bytes, None if video else cfg.timeout_s, cfg.timeout_s)
        fetched = await fetcher.fetch_with(row.url, body)
        return judge_check(row, fetched, body, dead_after)

    async with Fetcher(cfg, s3_options) as fetcher:
        tasks = [asyncio.ensure_future(one(fetcher, row)) for row in rows]
        if not tasks:
            return {}
        _, pending = await asyncio.wait(tasks, timeout=cfg.shard_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return {row.key: task.result() for row, task in zip(rows, tasks) if task.done() and not task.cancelled()}


def recheck_chunk(
    storage: Storage,
    dataset: str,
    plan: ChunkPlan,
    cfg: DownloadConfig,
    dead_after: int,
    now: datetime,
    video: bool = False,
    s3_options: dict | None = None,
) -> ChunkResult:
    """Check one chunk's due rows and write its next recheck version: the previous version's
    rows with this run's checks merged in (the latest version is all a reader needs)."""
    started = time.perf_counter()
    checks = asyncio.run(check_rows(plan.rows, cfg, dead_after, video, s3_options))
    fresh = pa.Table.from_pylist(
        [
            {
                "key": row.key,
                "source": row.source,
                "row": row.row,
                "url": row.url,
                "checked_at": now,
                "outcome": c.outcome,
                "http_status": c.http_status,
                "detail": c.detail,
                "misses": c.misses,
                "etag": c.etag,
                "last_modified": c.last_modified,
                "sha256": c.sha256,
            }
            for row in plan.rows
            if (c := checks.get(row.key)) is not None
        ],
        schema=recheck_store.RECHECK_SCHEMA,
    )
    if plan.previous is not None:
        before = recheck_store.read_state(storage, plan.previous)
        kept = before.filter(pc.invert(pc.is_in(before.column("key"), value_set=fresh.column("key"))))
        fresh = pa.concat_tables([kept, fresh])
    merged = fresh.sort_by([("row", "ascending"), ("key", "ascending")])
    version = recheck_store.write_version(storage, dataset, plan.source, plan.chunk, plan.gen, merged)
    counts: dict[str, int] = {}
    for c in checks.values():
        counts[c.outcome] = counts.get(c.outcome, 0) + 1
    return ChunkResult(
        source=plan.source,
        chunk=plan.chunk,
        version=version,
        counts=dict(sorted(counts.items())),
        rows=len(checks),
        bytes_read=sum(c.bytes_read for c in checks.values()),
        seconds=round(time.perf_counter() - started, 3),
    )


def summarize(plan: RecheckPlan, results: list[ChunkResult], seconds: float) -> RecheckSummary:
    counts: dict[str, int] = {}
    for r in results:
        for outcome, n in r.counts.items():
            counts[outcome] = counts.get(outcome, 0) + n
    return RecheckSummary(
        enabled=True,
        released=plan.released,
        due=plan.due,
        checked=sum(r.rows for r in results),
        counts=dict(sorted(counts.items())),
        bytes_read=sum(r.bytes_read for r in results),
        chunks=len(results),
        seconds=round(seconds, 3),
        next_recheck_at=plan.next_at,
        versions=sorted(r.version for r in results),
    )


def recheck(storage: Storage, recipe: Any, ledgers: list[str], now: datetime) -> RecheckSummary:
    """A run's recheck in this process, chunk after chunk (``flows/recheck.py`` runs the chunks
    as tasks): the plan, the checks, a summary."""
    started = time.perf_counter()
    if not recipe.download.recheck.enabled or recipe.download.recheck.fraction <= 0:
        return RecheckSummary()
    plan = plan_recheck(storage, recipe, ledgers, now)
    results = [
        recheck_chunk(
            storage,
            recipe.dataset,
            chunk,
            recipe.download_for(chunk.source),
            recipe.download.recheck.dead_after,
            now,
            is_video(recipe, chunk.source),
            recipe.storage_options,
        )
        for chunk in plan.chunks
    ]
    return summarize(plan, results, time.perf_counter() - started)


def is_video(recipe: Any, source: str) -> bool:
    return any(s.name == source and s.media == "video" for s in recipe.sources)
