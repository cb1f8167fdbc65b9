"""The shard runner: every stage's loop over one shard (skip if committed, decide, write the shard, then its ledger, count)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, Generic, TypeVar, cast

import numpy as np
import pyarrow as pa

from tasks.formats.ledger import COUNT_COLUMNS, LEDGER_SCHEMA, Counts, read_ledger, widened, write_parquet
from tasks.formats.shards import HashingWriter, MemberRecord, SampleRecord, ShardWriter
from tasks.formats.spooled import Payload
from tasks.formats.storage import Storage

T = TypeVar("T")
# The reason of a sample whose decision raised (tasks/formats/reasons.py: "an unexpected
# exception while fetching or judging the row"); the exception goes into the detail.
DECIDE_FAILED = "fetch_failed"


@dataclass(frozen=True)
class ShardResult:
    """What one shard task reports to the flow: references and counts, never samples.

    The fields every phase shares. A phase that reports more returns a subclass that says so:
    reshard's ``OutputResult`` (tasks/stages/reshard_build.py), fine-tuning's
    ``PackShardResult`` (tasks/finetune/packs.py), precache's ``PrecacheResult``
    (tasks/stages/precache.py).

    Args:
        source, index: the source and the number of the input chunk (download, validate,
            fine-tuning samples); outputs numbered on their own (reshard, packs) set ``index``.
        tar, ledger: the output shard and the ledger that commits it.
        counts: per-status and per-reason counts of the ledger (``None`` where a phase does not
            count rows: reshard, packs and precache write only ok rows).
        seconds: spent on this shard (0 when skipped).
        skipped: committed by an earlier run; nothing was written.
        samples, bytes, sha256: samples in the shard, its size and digest (the release index's;
            0 and "" where a phase does not hash its shards).
        sample_records: the writer's records of the samples, in tar order (``records``).
    """

    source: str = ""
    index: int = 0
    tar: str = ""
    ledger: str = ""
    counts: Counts | None = None
    seconds: float = 0.0
    skipped: bool = False
    samples: int = 0
    bytes: int = 0
    sha256: str = ""
    sample_records: list[SampleRecord] | None = None

    @property
    def table(self) -> str:
        """The ledger (the name validation's candidates used)."""
        return self.ledger

    @property
    def rows(self) -> int:
        """Ledger rows: every input row of the shard."""
        return self.counts.rows if self.counts is not None else self.samples

    @property
    def ok(self) -> int:
        return self.counts.ok if self.counts is not None else self.samples

    @property
    def records(self) -> list[SampleRecord]:
        """The samples as the shard writer records them, in tar order."""
        return self.sample_records if self.sample_records is not None else []


def records_of_layout(layout: pa.Table) -> list[SampleRecord]:
    """Sample records from a ledger's key, offset, length and members columns."""
    from tasks.stages.reshard_check import Layout

    lay = Layout.of(layout)
    names, data, sizes = lay.names.to_pylist(), lay.data.tolist(), lay.sizes.tolist()
    bounds = np.concatenate([[0], np.cumsum(lay.counts)]).tolist()
    return [
        SampleRecord(
            key,
            offset,
            length,
            tuple(MemberRecord(names[k], data[k], sizes[k]) for k in range(bounds[i], bounds[i + 1])),
        )
        for i, (key, offset, length) in enumerate(zip(lay.keys, lay.offsets.tolist(), lay.lengths.tolist()))
    ]


@dataclass
class Verdict:
    """One sample decided by a stage: its ledger row, and what to write when it is kept.

    Args:
        row: the ledger row (column -> value); the runner fills in ``shard``, ``offset``,
            ``length`` and ``members`` when it writes the sample.
        members: the sample's members (extension -> bytes) to write, or ``None``.
        copy: instead of ``members``, the sample's bytes as they stand in another shard and its
            members as (name, data offset within those bytes, size): copied, not parsed.
        key: the sample's key in the shard (default ``row["key"]``).
    """

    row: dict[str, Any]
    members: dict[str, Payload] | None = None
    copy: tuple[bytes, list[tuple[str, int, int]]] | None = None
    key: str | None = None


class ShardRun:
    """One shard being written: samples as they are decided, then the ledger, which commits it.

    Args:
        storage: the storage root.
        tar, ledger: the output shard and its ledger, relative to the root.
        schema: the phase's ledger schema (``tasks.formats.ledger``).
        order: the column the ledger is sorted by (default ``row``: the tar holds samples in
            the order they were decided, the ledger in input order); ``None`` keeps that order.
    """

    def __init__(
        self, storage: Storage, tar: str, ledger: str, schema: pa.Schema = LEDGER_SCHEMA, order: str | None = "row"
    ):
        self.storage, self.tar, self.ledger, self.schema, self.order = storage, tar, ledger, schema, order
        self.rows: list[dict[str, Any]] = []
        self.hashing: HashingWriter | None = None
        self.writer: ShardWriter | None = None

    @contextmanager
    def writing(self) -> Iterator[ShardRun]:
        """The shard open for samples; on a clean exit its end blocks are written and it is renamed into place."""
        with self.storage.atomic_writer(self.tar) as fh:
            self.hashing = HashingWriter(cast(BinaryIO, fh))
            self.writer = ShardWriter(cast(BinaryIO, self.hashing))
            yield self
            self.writer.close()

    def add(self, verdict: Verdict | list[Verdict]) -> SampleRecord | None:
        """Write the sample when the verdict keeps one; its ledger row in any case. A list of
        verdicts (the clips of one video) adds each; the last record is returned."""
        if isinstance(verdict, list):
            last = None
            for one in verdict:
                last = self.add(one)
            return last
        row, rec = verdict.row, None
        key = verdict.key or row["key"]
        if verdict.members is not None or verdict.copy is not None:
            if self.writer is None:
                raise RuntimeError(f"{self.tar}: samples are written inside ShardRun.writing()")
            if verdict.copy is not None:
                rec = self.writer.copy_sample(key, *verdict.copy)
            else:
                rec = self.writer.write_sample(key, verdict.members or {})
            row.update(shard=self.tar, offset=rec.offset, length=rec.length, members=rec.members_as_dicts())
        self.rows.append(row)
        return rec

    def commit(self, metadata: dict[bytes, bytes] | None = None) -> pa.Table:
        """Write the ledger (after the shard is in place); its presence commits the shard."""
        order = self.order
        if order is not None:
            self.rows.sort(key=lambda r: r[order])
        schema = widened(self.schema, self.rows)  # a video source's rows add its videos' facts
        schema = schema if metadata is None else schema.with_metadata(metadata)
        table = pa.Table.from_pylist(self.rows, schema=schema)
        write_parquet(self.storage, self.ledger, table)
        return table

    @property
    def records(self) -> list[SampleRecord]:
        return self.writer.records if self.writer is not None else []

    @property
    def bytes_written(self) -> int:
        return self.writer.bytes_written if self.writer is not None else 0

    @property
    def sha256(self) -> str:
        return self.hashing.sha.hexdigest() if self.hashing is not None else ""


class LedgerRun(ShardRun):
    """A shard run that keeps its ledger and writes no shard: a kept sample's row has no
    ``shard``, ``offset``, ``length`` or ``members`` (the download of ``download.keep_raw: false``)."""

    @contextmanager
    def writing(self) -> Iterator[ShardRun]:
        yield self

    def add(self, verdict: Verdict | list[Verdict]) -> SampleRecord | None:
        self.rows.extend(v.row for v in (verdict if isinstance(verdict, list) else [verdict]))
        return None


def committed_shard(
    storage: Storage, tar: str, ledger: str, source: str = "", index: int = 0, columns: list[str] = COUNT_COLUMNS
) -> ShardResult | None:
    """The result of a shard an earlier run committed (its ledger exists, and its shard: a ledger
    whose shard is gone commits nothing, and the shard is made again), counted from its ledger;
    else ``None``."""
    if not storage.exists(ledger) or not storage.exists(tar):
        return None
    return counted_shard(source, index, tar, ledger, read_ledger(storage, ledger, columns))


def counted_shard(source: str, index: int, tar: str, ledger: str, table: pa.Table) -> ShardResult:
    """The result of a committed shard, counted from its ledger's table (read by the caller)."""
    counts = Counts.of(table)
    return ShardResult(source, index, tar, ledger, counts, 0.0, skipped=True, samples=counts.ok)


def decided(
    decide: Callable[[T], Verdict], item: T, failed: Callable[[T, Exception], dict[str, Any]] | None
) -> Verdict:
    """``decide(item)``; when it raises and ``failed`` is given, an error row instead (the shard goes on)."""
    if failed is None:
        return decide(item)
    try:
        return decide(item)
    except Exception as err:  # noqa: BLE001 - one sample's failure is its ledger row, not the shard's
        return Verdict(failed(item, err))


def failure_detail(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


class DecidePool(Generic[T]):
    """Decides samples on ``threads`` threads, at most two per thread in flight (bounded memory).

    ``submit`` returns the verdicts finished so far, in the order they finished; ``drain`` the rest.
    """

    def __init__(
        self,
        decide: Callable[[T], Verdict],
        threads: int,
        failed: Callable[[T, Exception], dict[str, Any]] | None = None,
    ):
        self.decide, self.failed = decide, failed
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="decide")
        self.limit = 2 * threads
        self.pending: set[Future] = set()

    def submit(self, item: T) -> Iterator[Verdict]:
        while len(self.pending) >= self.limit:
            yield from self._finished(block=True)
        self.pending.add(self.pool.submit(decided, self.decide, item, self.failed))
        yield from self._finished(block=False)

    def drain(self) -> Iterator[Verdict]:
        while self.pending:
            yield from self._finished(block=True)

    def _finished(self, block: bool) -> Iterator[Verdict]:
        done = wait(self.pending, return_when=FIRST_COMPLETED).done if block else {f for f in self.pending if f.done()}
        for fut in done:
            self.pending.discard(fut)
            yield fut.result()

    def __enter__(self) -> DecidePool[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        for fut in self.pending:
            fut.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)


def decide_all(
    items: Iterable[T],
    decide: Callable[[T], Verdict],
    failed: Callable[[T, Exception], dict[str, Any]] | None = None,
    threads: int = 0,
) -> Iterator[Verdict]:
    """Every item's verdict: in order, or on ``threads`` threads in the order they finish."""
    if threads <= 0:
        for item in items:
            yield decided(decide, item, failed)
        return
    with DecidePool(decide, threads, failed) as pool:
        for item in items:
            yield from pool.submit(item)
        yield from pool.drain()


def run_shard(
    storage: Storage,
    tar: str,
    ledger: str,
    items: Callable[[], Iterable[T]],
    decide: Callable[[T], Verdict],
    *,
    source: str = "",
    index: int = 0,
    schema: pa.Schema = LEDGER_SCHEMA,
    order: str | None = "row",
    failed: Callable[[T, Exception], dict[str, Any]] | None = None,
    threads: int = 0,
    check: Callable[[list[dict[str, Any]]], None] | None = None,
    before_commit: Callable[[], None] | None = None,
) -> ShardResult:
    """Run one stage over one shard: the one loop every stage shares.

    A shard whose ledger exists is committed: its result is counted from the ledger and nothing
    runs. Otherwise ``items()`` gives the inputs and ``decide`` turns each into a ``Verdict``
    (on ``threads`` threads when more than 0); kept samples go into the tar as they are
    decided. When ``failed`` is given, an item whose ``decide`` raises becomes the ledger row
    ``failed(item, error)`` makes (see ``DECIDE_FAILED``) and the shard goes on; without it the
    error is the shard's. ``check(rows)`` may refuse the shard before its tar is renamed into
    place; ``before_commit`` writes what goes beside the ledger. The ledger is written last.
    """
    start = time.perf_counter()
    done = committed_shard(storage, tar, ledger, source, index, [c for c in COUNT_COLUMNS if c in schema.names])
    if done is not None:
        return done
    run = ShardRun(storage, tar, ledger, schema, order)
    with run.writing():
        for verdict in decide_all(items(), decide, failed, threads):
            run.add(verdict)
        if check is not None:
            check(run.rows)
    if before_commit is not None:
        before_commit()
    counts = Counts.of(run.commit())
    return ShardResult(
        source,
        index,
        tar,
        ledger,
        counts,
        time.perf_counter() - start,
        samples=counts.ok,
        bytes=run.bytes_written,
        sha256=run.sha256,
    )
