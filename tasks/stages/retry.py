"""Retries of passing failures (``download.retry_failed``): which download rows are due again, and a chunk's next version built from its current one plus those rows fetched again."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import posixpath
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, TypeVar, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats import clock
from tasks.formats.ledger import (
    COLUMNS,
    DOWNLOAD_LEDGER_SCHEMA,
    FETCH_FACTS,
    LEDGER_SCHEMA,
    Counts,
    read_ledger,
    read_ledgers,
    widened,
    write_parquet,
)
from tasks.formats.ledger import read_parquet as read_table
from tasks.formats.manifests import ChunkRef, read_chunk
from tasks.formats.names import split_version
from tasks.formats.reasons import ERROR, OK, is_transient
from tasks.formats.recipe_download import DownloadConfig, ValidateConfig
from tasks.formats.recipe_upkeep import RetryFailed
from tasks.formats.shards import SampleRecord, ShardWriter
from tasks.formats.storage import Storage
from tasks.formats.tar_reader import ShardError
from tasks.stages.download import check_every_row_once, download_verdict, failed_row
from tasks.stages.fetched import Fetched
from tasks.stages.fetchrows import iter_completed
from tasks.stages.runner import DecidePool, LedgerRun, ShardResult, ShardRun, Verdict
from tasks.stages.validate import DECODE_THREADS, Judge, thumbs_path
from tasks.stages.validate import failed_row as failed_judge

K = TypeVar("K")
Pair = tuple[str, str]  # (tar, ledger)
LEDGER_SUFFIX = ".ledger.parquet"
# What the download flow reads of every current ledger, once a run: counts, the gate's columns and
# what decides a retry; the fetch facts are optional (ledgers written before them lack them).
FLOW_COLUMNS = ["key", "source", "row", "status", "reason", "bytes"]
DUE_FACTS = ["fetched_at", "fetches"]
# At most this many chunks in one retry task: a night after an outage retries a few rows of many
# chunks, and a task per chunk would cost more in orchestration than the retry itself.
CHUNKS_PER_TASK = 32
# Bytes of a previous version read at once when its samples are copied into the next one.
COPY_WINDOW_BYTES = 16 << 20
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# copy_file_range errors that mean "not between these two files": copy through memory instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.ETXTBSY}


# ---------------------------------------------------------------------------------------------
# Which rows are due
# ---------------------------------------------------------------------------------------------


def _due_times(table: pa.Table, cfg: RetryFailed) -> tuple[np.ndarray, np.ndarray]:
    """(eligible, due time in µs since the epoch) of every row: eligible rows failed for a passing
    reason and have had fewer than ``max_attempts`` fetches; a row of no known fetch time (a ledger
    of an older run) is due at once (-inf)."""
    n = table.num_rows
    none = np.zeros(n, bool), np.full(n, np.inf)
    if not cfg.enabled or n == 0:
        return none
    errors = pc.fill_null(pc.equal(table.column("status"), ERROR), False)
    reasons = pc.unique(pc.filter(table.column("reason"), errors)).to_pylist()
    transient = [r for r in reasons if is_transient(r)]
    if not transient:
        return none
    fetches = pc.fill_null(table.column("fetches"), 1).to_numpy().astype(np.int64)
    eligible = (
        pc.and_(errors, pc.fill_null(pc.is_in(table.column("reason"), value_set=pa.array(transient)), False))
        .to_numpy(zero_copy_only=False)
        .astype(bool)
    ) & (fetches < cfg.max_attempts)
    # Timestamps as float µs: nulls become NaN (exact to the µs for another 280 years).
    at = table.column("fetched_at").cast(pa.int64()).to_numpy().astype(np.float64)
    wait = cfg.after_hours * 3600e6 * np.exp2(np.maximum(fetches, 1) - 1)
    due = np.where(np.isnan(at), -np.inf, at + wait)
    return eligible, due


def _micros(when: datetime) -> float:
    return (when - _EPOCH) / timedelta(microseconds=1)


def due_rows(table: pa.Table, cfg: RetryFailed, now: datetime) -> list[int]:
    """Manifest rows of a download ledger whose fetch is due again at ``now``: ``error`` with a
    passing reason (``tasks.formats.reasons.is_transient``), fewer than ``cfg.max_attempts``
    fetches (null: 1), and ``fetched_at + after_hours * 2 ** (fetches - 1) <= now`` (a null
    ``fetched_at`` is due). None when ``cfg.enabled`` is false. The table needs ``row``,
    ``status``, ``reason``, ``fetched_at`` and ``fetches`` (``read_current``). Only rows of URL
    manifests may be retried: the caller passes only their ledgers (``Recipe.fetched_sources``)."""
    eligible, due = _due_times(table, cfg)
    mask = eligible & (due <= _micros(now))
    if not mask.any():
        return []
    return sorted(table.column("row").to_numpy()[mask].tolist())


def next_retry_at(table: pa.Table, cfg: RetryFailed) -> datetime | None:
    """When the earliest retry of a row of this ledger falls due (in the past where one is due
    now: a row of no known fetch time is due since the epoch); None when no row will ever be
    retried (none failed for a passing reason under the attempt cap, or retries are off)."""
    eligible, due = _due_times(table, cfg)
    if not eligible.any():
        return None
    first = float(due[eligible].min())
    return _EPOCH if not np.isfinite(first) else _EPOCH + timedelta(microseconds=round(first))


def read_current(storage: Storage, rels: list[str]) -> dict[str, pa.Table | None]:
    """``FLOW_COLUMNS`` and the fetch facts that decide a retry (``DUE_FACTS``, nulls where a
    ledger predates them) of each ledger; ``None`` for a missing one."""
    return read_ledgers(storage, rels, FLOW_COLUMNS, missing_ok=True, optional=DUE_FACTS)


# ---------------------------------------------------------------------------------------------
# Versions of a chunk
# ---------------------------------------------------------------------------------------------


def version_paths(previous: Pair, rows: Iterable[int]) -> Pair:
    """(tar, ledger) of the version after ``previous`` that retries ``rows``: generation + 1, and
    8 hex digits of a digest of the previous ledger and the rows, so that a retry interrupted
    and run again writes the same names."""
    base, gen = split_version(previous[1].removesuffix(LEDGER_SUFFIX))
    d8 = hashlib.sha256(json.dumps([previous[1], sorted(rows)]).encode()).hexdigest()[:8]
    stem = f"{base}.r{gen + 1:03d}-{d8}"
    return stem + ".tar", stem + LEDGER_SUFFIX


def list_folders(storage: Storage, rels: Iterable[str]) -> dict[str, set[str]]:
    """The names in each folder of ``rels``: one listing per folder, however many files name it."""
    folders = sorted({posixpath.dirname(rel) for rel in rels})
    return {folder: set(storage.listdir(folder)) for folder in folders}


def current_versions(bases: dict[K, Pair], listed: dict[str, set[str]], ledger_only: set[K]) -> dict[K, Pair]:
    """Each chunk's current version: the committed retry version of its base (tar, ledger) with
    the highest generation, or the base where there is none. Committed: the ledger is listed,
    and the tar unless the chunk is in ``ledger_only`` (a lean download, ``download.keep_raw:
    false``, keeps no raw shard). ``listed``: ``list_folders`` of the bases' folders."""
    found: dict[str, dict[str, list[tuple[int, str]]]] = {}  # folder -> base name -> [(gen, stem name)]
    for folder, names in listed.items():
        by_base = found.setdefault(folder, {})
        for name in names:
            if not name.endswith(LEDGER_SUFFIX):
                continue
            stem = name.removesuffix(LEDGER_SUFFIX)
            base, gen = split_version(stem)
            if gen:
                by_base.setdefault(base, []).append((gen, stem))
    out: dict[K, Pair] = {}
    for key, (tar, ledger) in bases.items():
        folder, names = posixpath.dirname(ledger), listed.get(posixpath.dirname(ledger), set())
        versions = found.get(folder, {}).get(posixpath.basename(ledger).removesuffix(LEDGER_SUFFIX), [])
        committed = [(gen, stem) for gen, stem in versions if key in ledger_only or stem + ".tar" in names]
        if committed:
            _, stem = max(committed)
            out[key] = (f"{folder}/{stem}.tar", f"{folder}/{stem}{LEDGER_SUFFIX}")
        else:
            out[key] = (tar, ledger)
    return out


# ---------------------------------------------------------------------------------------------
# A retry: the next version of a chunk
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryResult(ShardResult):
    """A chunk's new version made by a retry: ``ShardResult``'s fields (of the whole version), and
    what the retry itself did.

    Args:
        retried: rows fetched again.
        recovered: of those, rows now ``ok``.
        fetched_bytes: the recovered rows' bytes (the rest of the version was copied).
    """

    retried: int = 0
    recovered: int = 0
    fetched_bytes: int = 0


class AppendRun(ShardRun):
    """A ``ShardRun`` whose tar starts with the first ``size`` bytes of another tar, copied as
    they are: the samples of a chunk's previous version, so their ledger rows keep their
    offsets. Samples added go after them (their offsets count from the tar's start).

    Args:
        storage, tar, ledger, schema: as ``ShardRun``.
        source: the tar whose first ``size`` bytes start this one.
        size: bytes of ``source`` taken: its samples, without its end-of-archive blocks.
    """

    def __init__(self, storage: Storage, tar: str, ledger: str, schema: pa.Schema, source: str, size: int):
        super().__init__(storage, tar, ledger, schema)
        self.source, self.size = source, size

    @contextmanager
    def writing(self) -> Iterator[ShardRun]:
        with self.storage.atomic_writer(self.tar) as fh:
            _copy_head(self.storage, self.source, fh, self.size)
            self.writer = ShardWriter(cast(BinaryIO, fh))
            yield self
            self.writer.close()

    def add(self, verdict: Verdict | list[Verdict]) -> SampleRecord | None:
        last = None
        for one in verdict if isinstance(verdict, list) else [verdict]:
            last = super().add(one)
            if last is not None:
                one.row["offset"] += self.size
                for m in one.row["members"]:
                    m["offset"] += self.size
        return last

    @property
    def bytes_written(self) -> int:
        return self.size + super().bytes_written


def _copy_head(storage: Storage, source: str, out: Any, size: int) -> None:
    """The first ``size`` bytes of ``source`` into ``out``: locally a kernel copy between the
    files (no bytes through Python), else a window at a time."""
    if (
        size
        and storage.is_local
        and isinstance(out, io.BufferedWriter)
        and _kernel_copy(storage.path(source), out, size)
    ):
        return
    left = size
    with storage.open(source, "rb") as fh:
        while left:
            data = fh.read(min(left, COPY_WINDOW_BYTES))
            if not data:
                raise ShardError(
                    "tar_truncated", storage.url(source), None, f"{left} of its first {size} bytes missing"
                )
            out.write(data)
            left -= len(data)


def _kernel_copy(path: str, out: io.BufferedWriter, size: int) -> bool:
    """``os.copy_file_range`` of the first ``size`` bytes of ``path`` to ``out``'s position; False
    (nothing copied) where the kernel cannot copy between these files."""
    out.flush()
    start = out.tell()
    done = 0
    with open(path, "rb", buffering=0) as src:
        while done < size:
            try:
                n = os.copy_file_range(src.fileno(), out.fileno(), size - done)
            except OSError as err:
                if done == 0 and err.errno in _NO_KERNEL_COPY:
                    return False
                raise
            if n == 0:
                raise ShardError("tar_truncated", path, None, f"{size - done} of its first {size} bytes missing")
            done += n
    out.seek(start + size)  # the writer's own idea of its position, after the kernel moved the file's
    return True


def samples_size(storage: Storage, tar: str, table: pa.Table) -> int:
    """Bytes of the samples of ``tar`` that ``table`` (its ledger) places: a shard this project
    wrote holds them back to back from its start, so the next version copies them as one range.
    A gap or an overlap is refused (its ledger does not describe its tar); a tar shorter than
    that fails the copy."""
    placed = table.filter(pc.is_valid(table.column("offset"))).sort_by("offset")
    offsets, lengths = placed.column("offset").to_numpy(), placed.column("length").to_numpy()
    ends = offsets + lengths
    if len(offsets) and (offsets[0] != 0 or np.any(offsets[1:] != ends[:-1])):
        raise ShardError("tar_layout", storage.url(tar), None, "its ledger does not place the samples back to back")
    return int(ends[-1]) if len(ends) else 0


def _kept(table: pa.Table, due: set[int], tar: str) -> pa.Table:
    """The rows of a previous ledger that a new version keeps as they are: those not retried, their
    samples (same offsets, copied as one range) now in ``tar``."""
    keep = pc.invert(pc.is_in(table.column("row"), value_set=pa.array(sorted(due), pa.int64())))
    kept = table.filter(keep)
    shard = kept.column("shard")
    moved = pc.if_else(pc.is_valid(shard), pa.scalar(tar, pa.string()), pa.scalar(None, pa.string()))
    return kept.set_column(kept.column_names.index("shard"), "shard", moved)


def _write_version(
    storage: Storage, rel: str, kept: pa.Table, added: list[dict[str, Any]], schema: pa.Schema
) -> pa.Table:
    """A version's ledger: the kept rows and the added ones, in row order (a stable sort: a video's
    clips keep theirs); written last, it commits the version's shard."""
    for name in schema.names:  # a column the previous version's ledger predates
        if name not in kept.column_names:
            kept = kept.append_column(schema.field(name), pa.nulls(kept.num_rows, schema.field(name).type))
    parts = [kept.select(schema.names).cast(schema), pa.Table.from_pylist(added, schema=schema)]
    table = pa.concat_tables(parts).sort_by("row")
    write_parquet(storage, rel, table)
    return table


def _with_facts(table: pa.Table) -> pa.Table:
    """A download ledger with null fetch facts where it predates them."""
    for name in FETCH_FACTS:
        if name not in table.column_names:
            table = table.append_column(pa.field(name, COLUMNS[name]), pa.nulls(table.num_rows, COLUMNS[name]))
    return table


def _carry_thumbs(storage: Storage, ledger: str, table: pa.Table, judge: Judge) -> None:
    """The previous candidates' thumbnails, kept by the new version's (and counted against the cap per reason)."""
    path = thumbs_path(ledger)
    if not storage.exists(path):
        return
    reasons = dict(zip(table.column("key").to_pylist(), table.column("reason").to_pylist()))
    thumbs = read_table(storage, path)
    for key, blob in zip(thumbs.column("key").to_pylist(), thumbs.column("thumbnail").to_pylist()):
        reason = reasons.get(key)
        if reason is not None:
            judge.took_thumbnail(reason.split(":", 1)[0])
        judge.keep_thumbnail(key, blob)


@dataclass(frozen=True)
class RetryJob:
    """One chunk's retry, as the flow plans it.

    Args:
        ref: the chunk.
        previous: its current version's (tar, ledger) and candidates (tar, ledger) or None.
        version: the new version's, named by ``version_paths`` (and ``candidate_paths``).
        rows: the manifest rows due (``due_rows``).
    """

    ref: ChunkRef
    previous: tuple[Pair, Pair | None]
    version: tuple[Pair, Pair | None]
    rows: list[int]


def task_groups(jobs: list[RetryJob], rows: int, chunks: int = CHUNKS_PER_TASK) -> list[list[RetryJob]]:
    """The jobs in groups of one task each, of near-equal size: as few groups as give each at most
    about ``rows`` due rows (a download task's worth of fetching) and at most ``chunks`` chunks."""
    if not jobs:
        return []
    due = sum(len(job.rows) for job in jobs)
    n = min(len(jobs), max(-(-due // max(rows, 1)), -(-len(jobs) // chunks)))
    size, extra = divmod(len(jobs), n)
    groups, at = [], 0
    for i in range(n):
        take = size + (i < extra)
        groups.append(jobs[at : at + take])
        at += take
    return groups


def retry_chunk(
    ref: ChunkRef,
    storage: Storage,
    dcfg: DownloadConfig,
    vcfg: ValidateConfig | None,
    previous: tuple[Pair, Pair | None],
    version: tuple[Pair, Pair | None],
    rows: list[int],
    s3_options: dict[str, Any] | None = None,
    now: datetime | None = None,
    on_idle: Callable[[], object] | None = None,
) -> tuple[RetryResult, ShardResult | None]:
    """Build ``version`` ((tar, ledger), candidates or None) of a chunk from its committed
    ``previous`` one, fetching again only ``rows`` (manifest row ids due, ``due_rows``).

    The raw shard is the previous one's samples copied as bytes (one range: they keep their
    offsets), then the rows that now succeed; the ledger keeps every other row's entry as it
    was (pointing at the new shard) and gives the retried rows their new outcome, ``fetches`` +
    1 and ``fetched_at`` = ``now`` (the run's time). A previous version without a raw shard
    (``download.keep_raw: false``) gives one without. With ``vcfg`` (validation fused with the
    download, the normal run) the new version's candidates are the previous candidates' samples
    and ledger rows, copied, not judged again, then the recovered rows judged as
    ``tasks.stages.onepass`` judges: the work is that of the retried rows. Commit order as the
    one pass: tars, thumbnails, the candidate ledger, then the download ledger. A version already
    committed (a task run again) is counted, not redone.
    """
    job = RetryJob(ref, previous, version, rows)
    return retry_chunks([job], storage, dcfg, vcfg, s3_options, now, on_idle)[0]


def retry_chunks(
    jobs: list[RetryJob],
    storage: Storage,
    dcfg: DownloadConfig,
    vcfg: ValidateConfig | None,
    s3_options: dict[str, Any] | None = None,
    now: datetime | None = None,
    on_idle: Callable[[], object] | None = None,
) -> list[tuple[RetryResult, ShardResult | None]]:
    """``retry_chunk`` of each job (the chunks of one task, ``task_groups``; their rows are of one
    source), with one fetch of all their due rows: a few rows of each of many chunks are fetched
    as concurrently as the rows of one chunk. Every version is written before any is committed;
    each commits as ``retry_chunk`` says, one after the other."""
    start = time.perf_counter()
    at = now or clock.now()
    retries = [_Retry(job, storage, vcfg, at) for job in jobs]
    todo = [r for r in retries if r.result is None]
    by_row = {row: r for r in todo for row in r.fetches}
    refetch = [row for r in todo for row in r.refetch]
    with ExitStack() as stack:
        for r in todo:
            r.open(stack)
        pool: DecidePool[Any] | None = None
        if any(r.judge is not None for r in todo):

            def judge(item: Any) -> Verdict:
                return by_row[item[2]["row"]].decide(item)  # each chunk's own Judge (its thumbnails)

            pool = stack.enter_context(DecidePool(judge, DECODE_THREADS, failed_judge))
        for row, fetched in iter_completed(refetch, dcfg, s3_options, on_idle) if refetch else ():
            r = by_row[row["row"]]
            item = r.fetched(row, fetched)
            if item is not None and pool is not None:
                for one in pool.submit(item):
                    _retry_of(by_row, one).shard_add(one)
        if pool is not None:
            for one in pool.drain():
                _retry_of(by_row, one).shard_add(one)
        for r in todo:
            r.check()
    seconds = (time.perf_counter() - start) / max(len(todo), 1)
    return [r.result if r.result is not None else r.commit(seconds) for r in retries]


def _retry_of(by_row: dict[int, _Retry], verdict: Verdict | list[Verdict]) -> _Retry:
    """The retry a judged sample belongs to (a video's clips: a list of verdicts, of one row)."""
    first = verdict[0] if isinstance(verdict, list) else verdict
    return by_row[first.row["row"]]


class _Retry:
    """One chunk's retry in progress (``retry_chunks``): read at creation, written while its rows
    come back, committed last. ``result`` is set at once for a version already committed."""

    def __init__(self, job: RetryJob, storage: Storage, vcfg: ValidateConfig | None, at: datetime):
        self.job, self.storage, self.at = job, storage, at
        (prev_tar, prev_ledger), prev_cand = job.previous
        (tar, ledger), cand = job.version
        if (vcfg is None) != (cand is None) or (cand is not None and prev_cand is None):
            raise ValueError(f"{ledger}: candidates are made from the previous candidates, with a validation config")
        raw_kept = storage.exists(prev_tar)
        if not raw_kept and cand is None:
            raise ValueError(f"{prev_ledger} has no raw shard: its retry must be validated in the same pass")
        self.result: tuple[RetryResult, ShardResult | None] | None = None
        if (
            storage.exists(ledger)
            and (not raw_kept or storage.exists(tar))
            and (cand is None or storage.exists(cand[1]))
        ):
            self.result = _counted(storage, job.ref, (tar, ledger), cand, set(job.rows))
            self.fetches: dict[int, int] = {}
            self.refetch: list[dict[str, Any]] = []
            return
        wanted = set(job.rows)
        before = _with_facts(read_ledger(storage, prev_ledger))
        errors = before.filter(pc.equal(before.column("status"), ERROR))
        self.fetches = {
            r: f or 1
            for r, f in zip(errors.column("row").to_pylist(), errors.column("fetches").to_pylist())
            if r in wanted
        }
        manifest = read_chunk(storage, job.ref)
        self.chunk = manifest.column("row").to_pylist()
        due = pa.array(sorted(self.fetches), pa.int64())
        self.refetch = manifest.filter(pc.is_in(manifest.column("row"), value_set=due)).to_pylist()
        self.kept = _kept(before, set(self.fetches), tar)
        self.raw: ShardRun = (
            AppendRun(storage, tar, ledger, DOWNLOAD_LEDGER_SCHEMA, prev_tar, samples_size(storage, prev_tar, before))
            if raw_kept
            else LedgerRun(storage, tar, ledger, DOWNLOAD_LEDGER_SCHEMA)
        )
        self.shard: AppendRun | None = None
        self.judge: Judge | None = None
        self.judged = pa.table({})
        if cand is not None and prev_cand is not None and vcfg is not None:
            self.judged = read_ledger(storage, prev_cand[1])
            size = samples_size(storage, prev_cand[0], self.judged)
            self.shard = AppendRun(storage, cand[0], cand[1], LEDGER_SCHEMA, prev_cand[0], size)
            self.judge = Judge(vcfg)

    def open(self, stack: ExitStack) -> None:
        stack.enter_context(self.raw.writing())
        prev_cand = self.job.previous[1]
        if self.shard is not None and self.judge is not None and prev_cand is not None:
            stack.enter_context(self.shard.writing())
            _carry_thumbs(self.storage, prev_cand[1], self.judged, self.judge)

    def fetched(self, row: dict[str, Any], fetched: Fetched) -> Any:
        """Record a row fetched again; the item to judge when it is ok and candidates are made."""
        n, source = self.fetches[row["row"]] + 1, self.job.ref.source
        try:
            verdict = download_verdict(row, fetched, source, self.at, n)
        except Exception as err:  # noqa: BLE001 - one row's failure is its ledger row (runner.decided)
            verdict = Verdict(failed_row(row, source, err, self.at, n))
        self.raw.add(verdict)
        entry = verdict.row
        if self.shard is None or entry["status"] != OK:
            return None
        down = {"source": source, "row": entry["row"], "url": entry["url"], "origin": entry["origin"]}
        return entry["key"], verdict.members, down

    def decide(self, item: Any) -> Verdict:
        # A video's sample judges to a list of verdicts (its clips), which ShardRun.add takes.
        return cast(Verdict, cast(Judge, self.judge)(item))

    def shard_add(self, verdict: Verdict | list[Verdict]) -> None:
        if self.shard is not None:
            self.shard.add(verdict)

    def check(self) -> None:
        """Refuse the version (before its tars are in place) unless every chunk row has one ledger row."""
        placed = self.kept.column("row").to_pylist() + [r["row"] for r in self.raw.rows]
        check_every_row_once([{"row": r} for r in self.chunk], [{"row": r} for r in placed], self.raw.tar)

    def commit(self, seconds: float) -> tuple[RetryResult, ShardResult | None]:
        ref, storage = self.job.ref, self.storage
        cand = self.job.version[1]
        cand_result = None
        if self.shard is not None and self.judge is not None and cand is not None:
            self.judge.write_thumbs(storage, cand[1])
            schema = widened(LEDGER_SCHEMA, self.shard.rows, self.judged.column_names)
            kept = _kept(self.judged, set(), cand[0])
            cand_counts = Counts.of(_write_version(storage, cand[1], kept, self.shard.rows, schema))
            cand_result = ShardResult(
                ref.source, ref.index, cand[0], cand[1], cand_counts, seconds, samples=cand_counts.ok
            )
        counts = Counts.of(_write_version(storage, self.raw.ledger, self.kept, self.raw.rows, DOWNLOAD_LEDGER_SCHEMA))
        recovered = [r for r in self.raw.rows if r["status"] == OK]
        result = RetryResult(
            ref.source,
            ref.index,
            self.raw.tar,
            self.raw.ledger,
            counts,
            seconds,
            samples=counts.ok,
            bytes=self.raw.bytes_written,
            retried=len(self.fetches),
            recovered=len(recovered),
            fetched_bytes=sum(r["bytes"] or 0 for r in recovered),
        )
        return result, cand_result


def _counted(
    storage: Storage, ref: ChunkRef, down: Pair, cand: Pair | None, wanted: set[int]
) -> tuple[RetryResult, ShardResult | None]:
    """The results of a version an earlier attempt of the same retry committed."""
    table = read_ledger(storage, down[1], ["row", "status", "reason", "bytes"])
    counts = Counts.of(table)
    retried = table.filter(pc.is_in(table.column("row"), value_set=pa.array(sorted(wanted), pa.int64())))
    ok = retried.filter(pc.equal(retried.column("status"), OK))
    result = RetryResult(
        ref.source,
        ref.index,
        down[0],
        down[1],
        counts,
        0.0,
        skipped=True,
        samples=counts.ok,
        retried=retried.num_rows,
        recovered=ok.num_rows,
        fetched_bytes=int(pc.sum(ok.column("bytes")).as_py() or 0),
    )
    if cand is None:
        return result, None
    cand_counts = Counts.of(read_ledger(storage, cand[1], ["status", "reason", "bytes"]))
    return result, ShardResult(
        ref.source, ref.index, cand[0], cand[1], cand_counts, 0.0, skipped=True, samples=cand_counts.ok
    )
