"""The download stage: one manifest chunk in, one WebDataset shard and its ledger out."""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import time
import urllib.robotparser
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp

from tasks.ledger import Counts, LedgerRow, read_ledger, write_ledger
from tasks.manifests import ChunkRef, read_chunk, sample_key
from tasks.recipe import DownloadConfig
from tasks.reasons import OK
from tasks.shards import ShardWriter
from tasks.sniff import EXTENSIONS, is_truncated, sniff_format
from tasks.storage import Storage
from tasks.urlguard import AddressPolicy, BlockedAddress, GuardedResolver, check_url, resolve_file_url

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504, 520, 521, 522, 523, 524})
_DIRECTIVES_WITH_ARGS = frozenset({"unavailable_after", "max-snippet", "max-image-preview", "max-video-preview"})
_ROBOTS_MAX_BYTES = 512 * 1024
_CHUNK = 1 << 20  # body read size; images are 100 KB to MBs


@dataclass
class Fetched:
    """What fetching one URL ended in: bytes, or a reason."""

    reason: str | None = None
    data: bytes | None = None
    http_status: int | None = None
    attempts: int = 0
    detail: str | None = None


class _Retry(Exception):
    def __init__(self, reason: str, status: int | None, delay: float | None, detail: str):
        super().__init__(detail)
        self.reason, self.status, self.delay, self.detail = reason, status, delay, detail


class _Done(Exception):
    def __init__(self, fetched: Fetched):
        super().__init__(fetched.reason)
        self.fetched = fetched


def opted_out(values: list[str], directives: frozenset[str], ua_token: str) -> bool:
    """Whether ``X-Robots-Tag`` header values carry an opt-out directive that applies to us.

    A value may be scoped to a user agent (``otherbot: noai, noml``); the scope holds for the
    directives after it in that value. Unscoped, ``*`` and our own token apply to us.
    """
    for value in values:
        scope: str | None = None
        for part in value.split(","):
            part = part.strip().lower()
            if not part:
                continue
            head, sep, rest = part.partition(":")
            if sep and head.strip() not in _DIRECTIVES_WITH_ARGS:
                scope, part = head.strip(), rest.strip()
            if scope not in (None, "*", ua_token):
                continue
            if part in directives:
                return True
    return False


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Fetcher:
    """Fetches URLs for one shard with bounded concurrency and the SSRF guard.

    Args:
        cfg: the recipe's download config (limits, retries, user agent, network policy).
        s3_options: fsspec options for ``s3://`` sources in allowlisted buckets.

    Use as ``async with Fetcher(cfg) as f: await f.fetch(url)``.
    """

    def __init__(self, cfg: DownloadConfig, s3_options: dict[str, Any] | None = None):
        self.cfg = cfg
        self.policy = AddressPolicy.from_config(cfg.network)
        self.s3_options = s3_options or {}
        self.ua_token = cfg.user_agent.split("/", 1)[0].split()[0].lower() if cfg.user_agent.strip() else "*"
        self._global = asyncio.Semaphore(cfg.max_inflight)
        self._hosts: dict[str, asyncio.Semaphore] = {}
        self._robots: dict[str, asyncio.Future] = {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "Fetcher":
        connector = aiohttp.TCPConnector(
            resolver=GuardedResolver(self.policy),
            limit=self.cfg.max_inflight + 8,
            limit_per_host=0,
            ttl_dns_cache=300,
            enable_cleanup_closed=True,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers={"User-Agent": self.cfg.user_agent, "Accept": "image/*,*/*;q=0.5"},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.timeout_s),
            auto_decompress=False,
            trust_env=False,
            # Images are 100 KB to MBs: larger reads cost fewer wake-ups than the 64 KiB default.
            read_bufsize=_CHUNK,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def _host_sem(self, host: str) -> asyncio.Semaphore:
        sem = self._hosts.get(host)
        if sem is None:
            sem = self._hosts[host] = asyncio.Semaphore(self.cfg.per_host)
        return sem

    async def fetch(self, url: str) -> Fetched:
        scheme = urlsplit(url).scheme.lower()
        reason = check_url(url, self.cfg.network, self.policy)
        if reason is not None:
            return Fetched(reason=reason)
        if scheme in ("file", "s3"):
            return await asyncio.to_thread(self._read_object, url)
        attempts = 0
        last: _Retry | None = None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                delay = min(self.cfg.backoff_s * 2 ** (attempt - 1), self.cfg.max_backoff_s)
                if last is not None and last.delay is not None:
                    delay = max(delay, last.delay)
                await asyncio.sleep(delay)
            attempts += 1
            try:
                fetched = await self._attempt(url)
            except _Retry as retry:
                last = retry
                if retry.reason == "rate_limited":
                    break
                continue
            fetched.attempts = attempts
            return fetched
        return Fetched(reason=last.reason, http_status=last.status, attempts=attempts, detail=last.detail)

    async def _attempt(self, url: str) -> Fetched:
        host = urlsplit(url).hostname or ""
        # The host's slot first: a request queued behind a busy host must not hold one of the
        # shard's global slots, or one dominant host starves all the others.
        async with self._host_sem(host), self._global:
            try:
                async with asyncio.timeout(self.cfg.timeout_s):
                    return await self._follow(url)
            except _Done as done:
                return done.fetched
            except TimeoutError:
                return Fetched(reason="timeout", detail=f"no complete response within {self.cfg.timeout_s:g} s")

    async def _follow(self, url: str) -> Fetched:
        for _hop in range(self.cfg.max_redirects + 1):
            if self.cfg.respect_robots_txt and not await self._robots_allow(url):
                return Fetched(reason="robots_disallowed")
            try:
                async with self._session.get(url, allow_redirects=False) as resp:
                    status = resp.status
                    if status in (301, 302, 303, 307, 308):
                        location = resp.headers.get("Location")
                        if not location:
                            return Fetched(reason=f"http_{status}", http_status=status, detail="redirect without Location")
                        url = urljoin(url, location)
                        reason = check_url(url, self.cfg.network, self.policy)
                        if reason is not None:
                            return Fetched(reason=reason, http_status=status, detail=f"redirect to {url}")
                        if urlsplit(url).scheme.lower() not in ("http", "https"):
                            return Fetched(reason="blocked_scheme", http_status=status, detail=f"redirect to {url}")
                        continue
                    if status in _RETRY_STATUS:
                        delay = parse_retry_after(resp.headers.get("Retry-After")) if status in (429, 503) else None
                        if delay is not None and delay > self.cfg.max_retry_after_s:
                            raise _Retry("rate_limited", status, None, f"Retry-After {delay:g} s")
                        raise _Retry(f"http_{status}", status, delay, f"HTTP {status}")
                    if status != 200:
                        return Fetched(reason=f"http_{status}", http_status=status)
                    if opted_out(resp.headers.getall("X-Robots-Tag", []), frozenset(self.cfg.opt_out_directives), self.ua_token):
                        return Fetched(reason="opted_out", http_status=status)
                    data = await self._read_capped(resp)
                    if data is None:
                        return Fetched(reason="too_large", http_status=status, detail=f"over {self.cfg.max_bytes} bytes")
                    return Fetched(data=data, http_status=status)
            except BlockedAddress as err:
                return Fetched(reason="blocked_address", detail=str(err))
            except aiohttp.ClientConnectorError as err:
                if isinstance(err.os_error, BlockedAddress):
                    return Fetched(reason="blocked_address", detail=str(err.os_error))
                if isinstance(err, aiohttp.ClientConnectorDNSError):
                    return Fetched(reason="dns_error", detail=str(err))
                if isinstance(err, (aiohttp.ClientConnectorCertificateError, aiohttp.ClientConnectorSSLError)):
                    return Fetched(reason="tls_error", detail=str(err))
                raise _Retry("connection_error", None, None, str(err)) from None
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as err:
                raise _Retry("connection_error", None, None, str(err) or type(err).__name__) from None
            except aiohttp.InvalidURL:
                return Fetched(reason="invalid_url")
            except aiohttp.ClientResponseError as err:
                return Fetched(reason="connection_error", detail=f"bad response: {err.message}")
        return Fetched(reason="too_many_redirects")

    async def _read_capped(self, resp: aiohttp.ClientResponse) -> bytes | None:
        """The body, or None past max_bytes; Content-Length is not trusted either way."""
        cap = self.cfg.max_bytes
        declared = resp.content_length
        if declared is not None and declared > cap:
            return None
        parts: list[bytes] = []
        total = 0
        async for chunk in resp.content.iter_chunked(_CHUNK):
            total += len(chunk)
            if total > cap:
                return None
            parts.append(chunk)
        return b"".join(parts)

    async def _robots_allow(self, url: str) -> bool:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        fut = self._robots.get(origin)
        if fut is None:
            fut = self._robots[origin] = asyncio.ensure_future(self._load_robots(origin))
        parser = await fut
        return parser.can_fetch(self.ua_token, url)

    async def _load_robots(self, origin: str) -> urllib.robotparser.RobotFileParser:
        """robots.txt per RFC 9309: 4xx allows all, 5xx or unreachable disallows all."""
        parser = urllib.robotparser.RobotFileParser(origin + "/robots.txt")
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                async with self._session.get(origin + "/robots.txt", allow_redirects=True, max_redirects=self.cfg.max_redirects) as resp:
                    if 400 <= resp.status < 500:
                        parser.allow_all = True
                        return parser
                    if resp.status != 200:
                        parser.disallow_all = True
                        return parser
                    body = await resp.content.read(_ROBOTS_MAX_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError):
            parser.disallow_all = True
            return parser
        parser.parse(body.decode("utf-8", "replace").splitlines())
        return parser

    def _read_object(self, url: str) -> Fetched:
        """file:// (under file_root) and s3:// (allowlisted buckets), with the same byte cap."""
        import fsspec

        cap = self.cfg.max_bytes
        try:
            if url.lower().startswith("file:"):
                path = resolve_file_url(url, self.cfg.network.file_root)
                if path is None:
                    return Fetched(reason="blocked_scheme", attempts=1)
                fh = open(path, "rb")  # noqa: SIM115 - closed below
            else:
                fh = fsspec.open(url, "rb", **self.s3_options).open()
            with fh:
                data = fh.read(cap + 1)
        except (OSError, ValueError) as err:
            return Fetched(reason="read_error", attempts=1, detail=str(err))
        if len(data) > cap:
            return Fetched(reason="too_large", attempts=1)
        return Fetched(data=data, attempts=1)


@dataclass(frozen=True)
class ShardResult:
    """What one download task reports to the flow: references and counts, never samples."""

    source: str
    index: int
    tar: str
    ledger: str
    counts: Counts
    seconds: float
    skipped: bool = False
    samples: int = field(default=0)


def judge(fetched: Fetched, allowed_formats: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(reason, format) for fetched bytes: sniffed format, allowlist, truncation."""
    if fetched.reason is not None:
        return fetched.reason, None
    data = fetched.data or b""
    if not data:
        return "empty_body", None
    fmt = sniff_format(data)
    if fmt is None:
        return "not_an_image", None
    if fmt not in allowed_formats:
        return "format_not_allowed", fmt
    if is_truncated(fmt, data):
        return "truncated_image", fmt
    return None, fmt


def shard_paths(dataset: str, ref: ChunkRef, config_hash: str) -> tuple[str, str]:
    """(tar, ledger) paths of a chunk's download shard; named by chunk content and config."""
    digest = hashlib.sha256(f"{ref.content_hash}:{config_hash}".encode()).hexdigest()[:16]
    stem = f"{dataset}/download/{ref.source}/{ref.index:06d}-{digest}"
    return stem + ".tar", stem + ".ledger.parquet"


def download_shard(
    ref: ChunkRef,
    storage: Storage,
    cfg: DownloadConfig,
    tar_rel: str,
    ledger_rel: str,
    s3_options: dict[str, Any] | None = None,
) -> ShardResult:
    """Download one chunk into one shard; a shard whose ledger exists is done and skipped."""
    start = time.perf_counter()
    if storage.exists(ledger_rel):
        counts = Counts.of(read_ledger(storage, ledger_rel))
        return ShardResult(ref.source, ref.index, tar_rel, ledger_rel, counts, 0.0, skipped=True, samples=counts.ok)
    table = read_chunk(storage, ref)
    rows = table.to_pylist()
    ledger: list[LedgerRow] = []
    with storage.atomic_writer(tar_rel) as fh:
        writer = ShardWriter(fh)
        for row, fetched in _fetch_in_order(rows, cfg, s3_options):
            key = sample_key(ref.source, row["row"])
            reason, fmt = (row["reason"], None) if row["reason"] else judge(fetched, cfg.allowed_formats)
            entry = LedgerRow(
                key=key,
                source=ref.source,
                row=row["row"],
                reason=reason,
                url=row["url"],
                format=fmt,
                http_status=fetched.http_status if fetched else None,
                attempts=fetched.attempts if fetched else 0,
                detail=(fetched.detail if fetched else None),
            )
            if entry.status == OK:
                data = fetched.data
                entry.bytes = len(data)
                entry.sha256 = hashlib.sha256(data).hexdigest()
                meta = _sample_json(row, key, ref.source, entry)
                members = {EXTENSIONS[fmt]: data, "json": meta}
                if row["caption"] is not None:
                    members["txt"] = row["caption"].encode("utf-8")
                rec = writer.write_sample(key, members)
                entry.shard, entry.offset, entry.length = tar_rel, rec.offset, rec.length
                entry.members = rec.members_as_dicts()
            ledger.append(entry)
        # A shard with no accepted sample is still committed (an empty tar), so every chunk
        # has the same two outputs.
        writer.close()
    counts = Counts.of(write_ledger(storage, ledger_rel, ledger))
    return ShardResult(ref.source, ref.index, tar_rel, ledger_rel, counts, time.perf_counter() - start, samples=counts.ok)


def _sample_json(row: dict[str, Any], key: str, source: str, entry: LedgerRow) -> bytes:
    meta: dict[str, Any] = {}
    if row.get("extra"):
        meta.update(json.loads(row["extra"]))
    meta.update(
        key=key,
        source=source,
        row=row["row"],
        url=row["url"],
        caption=row["caption"],
        license=row["license"],
        format=entry.format,
        bytes=entry.bytes,
        sha256=entry.sha256,
    )
    return json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")


def _fetch_in_order(rows: list[dict[str, Any]], cfg: DownloadConfig, s3_options: dict[str, Any] | None):
    """Yield (row, Fetched | None) in row order while fetching concurrently.

    A sliding window of 2 x max_inflight rows bounds memory: at most that many bodies wait to
    be written, each at most max_bytes.
    """
    async def run(queue: asyncio.Queue) -> None:
        async with Fetcher(cfg, s3_options) as fetcher:
            window = max(2 * cfg.max_inflight, 8)
            pending: dict[int, asyncio.Task] = {}
            nxt = 0

            def launch(i: int) -> None:
                row = rows[i]
                if row["reason"] or not row["url"]:
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_result(None)
                    pending[i] = fut
                else:
                    pending[i] = asyncio.ensure_future(fetcher.fetch(row["url"]))

            for i in range(min(window, len(rows))):
                launch(i)
            nxt = min(window, len(rows))
            for i in range(len(rows)):
                fetched = await pending.pop(i)
                await queue.put((rows[i], fetched))
                if nxt < len(rows):
                    launch(nxt)
                    nxt += 1
            await queue.put(None)

    # The tar writer is synchronous; run the event loop and hand results over in order.
    loop = asyncio.new_event_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * cfg.max_inflight)
    task = loop.create_task(run(queue))
    try:
        while True:
            item = loop.run_until_complete(queue.get())
            if item is None:
                break
            yield item
        loop.run_until_complete(task)
    finally:
        if not task.done():
            task.cancel()
            loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
