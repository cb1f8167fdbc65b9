"""Fetch a shard's manifest rows concurrently and hand each result on as it completes, every row exactly once."""

from __future__ import annotations

import asyncio
import queue
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.formats.recipe_download import DownloadConfig
from tasks.policies.sniff import VIDEO_FORMATS
from tasks.stages.fetch import Fetcher
from tasks.stages.fetched import Fetched, failure, judge, judge_file

Row = dict[str, Any]
# How long cancelled fetches get to unwind once the shard deadline has passed.
_UNWIND_S = 5.0
# A caller that waited this long for a result, every row's fetch started, waits on the network.
IDLE_S = 1.0


async def fetch_row(fetcher: Fetcher, row: Row, allowed_formats: tuple[str, ...], spool: Path | None = None) -> Fetched:
    """One manifest row's fetched and judged bytes, or its reason; never raises but for a cancellation.

    A row the manifest already rejected keeps that reason and the manifest's detail. With a
    ``spool`` folder (a video source) the body streams to a file there, and a dropped transfer
    resumes (``Fetcher.fetch_to``); ``take_body`` reads it when the shard writes it.
    """
    verdict = _manifest_verdict(row)
    if verdict is not None:
        return verdict
    try:
        if spool is not None:
            cap = fetcher.cfg.max_bytes
            fetched = await fetcher.fetch_to(
                row["url"], spool / f"{row['row']}", cap, cap_name="download.video_max_bytes"
            )
        else:
            fetched = await fetcher.fetch(row["url"])
    except BaseException as err:  # noqa: BLE001 - every exception is this row's record
        return failure(err)
    try:
        return judge_file(fetched, allowed_formats) if spool is not None else judge(fetched, allowed_formats)
    except BaseException as err:  # noqa: BLE001 - judging touches no network: always unexpected
        failed = failure(err)
        return Fetched(
            reason="fetch_failed",
            http_status=fetched.http_status,
            attempts=fetched.attempts,
            detail=f"judging the bytes: {failed.detail}",
        )


def _manifest_verdict(row: Row) -> Fetched | None:
    # ``detail`` is read with get(): chunks written before it was a column lack it.
    if row.get("reason"):
        return Fetched(reason=row["reason"], detail=row.get("detail"))
    if not row.get("url"):
        return Fetched(reason="missing_url", detail=row.get("detail") or "the row has no URL")
    return None


async def fetch_completed(
    rows: Iterable[Row],
    cfg: DownloadConfig,
    s3_options: dict[str, Any] | None = None,
    all_started: Callable[[], None] | None = None,
    spool: Path | None = None,
) -> AsyncIterator[tuple[Row, Fetched]]:
    """Yield ``(row, Fetched)`` for every row, in the order the fetches complete (bodies
    streamed to files in ``spool`` when given, see :func:`fetch_row`).

    One slow or hanging row never holds back the rows after it. Memory stays bounded: at most
    ``2 x max_inflight`` rows are under way or done and not yet taken (so at most that many
    bodies of at most ``max_bytes`` are held), and the Fetcher caps concurrent requests at
    ``max_inflight``. When ``cfg.shard_timeout_s`` has passed since the start, the rows still
    pending, and those not started, are yielded as ``timeout`` with a detail saying so.
    ``all_started`` is called once, when the last row's fetch has started.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + cfg.shard_timeout_s
    window = max(2 * cfg.max_inflight, 8)
    todo = iter(rows)
    pending: dict[asyncio.Future, Row] = {}
    async with Fetcher(cfg, s3_options) as fetcher:

        def fill() -> None:
            nonlocal all_started
            while len(pending) < window:
                row = next(todo, None)
                if row is None:
                    if all_started is not None:
                        all_started()
                        all_started = None  # once
                    return
                pending[asyncio.ensure_future(fetch_row(fetcher, row, cfg.allowed_formats, spool))] = row

        try:
            fill()
            while pending:
                remaining = end - loop.time()
                if remaining <= 0:
                    break
                done, _ = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    row = pending.pop(fut)
                    yield row, _outcome(fut)
                    fill()
            if not pending:
                return
            # The shard deadline passed: stop what is under way, record it, and what never started.
            for fut in pending:
                fut.cancel()
            await asyncio.wait(pending, timeout=_UNWIND_S)
            why = f"the shard deadline (download.shard_timeout_s = {cfg.shard_timeout_s:g} s) passed before this row"
            for fut, row in list(pending.items()):
                del pending[fut]
                finished = fut.done() and not fut.cancelled()
                yield row, _outcome(fut) if finished else Fetched(reason="timeout", detail=f"{why} finished")
            for row in todo:
                verdict = _manifest_verdict(row)
                yield row, verdict if verdict is not None else Fetched(reason="timeout", detail=f"{why} was started")
        finally:
            for fut in pending:
                fut.cancel()
            if pending:
                await asyncio.wait(pending, timeout=_UNWIND_S)


def _outcome(fut: asyncio.Future) -> Fetched:
    """A finished row future's record; fetch_row returns one, so anything else is a failure too."""
    if fut.cancelled():
        return Fetched(reason="fetch_failed", detail="CancelledError: the fetch was cancelled")
    err = fut.exception()
    if err is not None:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise err
        return Fetched(reason="fetch_failed", detail=f"{type(err).__name__}: {err}")
    return fut.result()


@dataclass(frozen=True)
class _End:
    error: BaseException | None


class _Pump:
    """Runs :func:`fetch_completed` on an event loop of its own thread; results cross a queue.

    At most ``max_inflight`` results wait for the caller (``room``), on top of the rows
    ``fetch_completed`` holds. The thread always ends by queueing an ``_End``, carrying the
    exception if the loop itself failed, so the caller never waits on a dead producer.
    ``on_idle`` is called once, in the caller's thread, the first time the caller has waited
    :data:`IDLE_S` for a result after every row's fetch started (what is left is network
    waiting on the last rows: slow servers, timeouts), or else when the last result has been
    taken (what is left is the caller's own commit: closing its shards, waiting on the disk).
    """

    def __init__(
        self,
        rows: Iterable[Row],
        cfg: DownloadConfig,
        s3_options: dict[str, Any] | None,
        on_idle: Callable[[], object] | None = None,
        spool: Path | None = None,
    ):
        self.on_idle = on_idle
        self.spool = spool
        self.started = threading.Event()
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.loop = asyncio.new_event_loop()
        self.room: asyncio.Semaphore | None = None
        self.task = self.loop.create_task(self._main(rows, cfg, s3_options))
        # DNS lookups and file/S3 reads run in the loop's default executor: size it to the
        # requests in flight rather than to the (small) number of cores.
        self.loop.set_default_executor(
            ThreadPoolExecutor(max_workers=min(32, cfg.max_inflight + 4), thread_name_prefix="shardsmith-fetch-io")
        )
        self.thread = threading.Thread(target=self._run, name="shardsmith-fetch", daemon=True)
        self.thread.start()

    async def _main(self, rows: Iterable[Row], cfg: DownloadConfig, s3_options: dict[str, Any] | None) -> None:
        self.room = asyncio.Semaphore(cfg.max_inflight)
        results = fetch_completed(rows, cfg, s3_options, self.started.set, self.spool)
        try:
            async for item in results:
                await self.room.acquire()
                self.items.put(item)
        finally:
            await results.aclose()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        error: BaseException | None = None
        try:
            self.loop.run_until_complete(self.task)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            error = err
        finally:
            self.items.put(_End(error))
            try:
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                # close() shuts the executor down without waiting for a lookup that hangs.
                self.loop.close()

    def get(self) -> tuple[Row, Fetched] | _End:
        while True:
            try:
                item = self.items.get(timeout=IDLE_S)
            except queue.Empty:
                if not self.thread.is_alive() and self.items.empty():
                    return _End(RuntimeError("the fetch thread ended without a result"))
                if self.started.is_set():
                    self.idle()
                continue
            if not isinstance(item, _End):
                self._call(self.room.release)
            return item

    def idle(self) -> None:
        """Call ``on_idle`` now, unless it was called before."""
        on_idle, self.on_idle = self.on_idle, None
        if on_idle is not None:
            on_idle()

    def close(self) -> None:
        if self.thread.is_alive():
            self._call(self.task.cancel)
            self.thread.join(timeout=2 * _UNWIND_S + 5)

    def _call(self, fn: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:
            pass  # the loop has closed: it has nothing left to release or cancel


def iter_completed(
    rows: Iterable[Row],
    cfg: DownloadConfig,
    s3_options: dict[str, Any] | None = None,
    on_idle: Callable[[], object] | None = None,
) -> Iterator[tuple[Row, Fetched]]:
    """:func:`fetch_completed` for synchronous callers, fetching on while the caller works.

    The event loop runs in a thread of its own, so requests progress while the caller writes
    (or decodes) what came back. Leaving the loop early stops the fetching; an exception of
    the fetch machinery itself (not of a row) is raised here. ``on_idle``: see :class:`_Pump`
    (the flows give a Dask worker its thread slot back there, so neither a shard's slowest rows
    nor its commit hold the next shard back).
    """
    # A video source's bodies stream to files (bounded memory, resumable transfers), in a
    # folder that lives as long as the caller takes results: it reads each when it writes it.
    spool = tempfile.TemporaryDirectory(prefix="shardsmith-bodies-") if _streams(cfg) else None
    pump = _Pump(rows, cfg, s3_options, on_idle, Path(spool.name) if spool is not None else None)
    try:
        while True:
            item = pump.get()
            if isinstance(item, _End):
                if item.error is not None and not isinstance(item.error, asyncio.CancelledError):
                    raise item.error
                pump.idle()
                return
            yield item
    finally:
        pump.close()
        if spool is not None:
            spool.cleanup()


def _streams(cfg: DownloadConfig) -> bool:
    """Bodies go to files for sources of videos (their download keeps video containers)."""
    return any(f in VIDEO_FORMATS for f in cfg.allowed_formats)
