"""Fetching one URL under the URL policy: bounded concurrency, retries, and every failure a reason with a detail."""

from __future__ import annotations

import asyncio
import email.utils
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urljoin, urlsplit

import aiohttp
from yarl import URL

from tasks.formats.recipe_download import DownloadConfig
from tasks.policies import tdmrep
from tasks.policies.robots import RobotsRules, x_robots_verdict
from tasks.policies.ruling import Ruling
from tasks.policies.tdmrep import TdmRules, tdm_verdict
from tasks.policies.urlguard import AddressPolicy, GuardedResolver, check_url, resolve_file_url
from tasks.stages.fetch_body import CHUNK, Body, FileBody, Retry, stream_capped, validators
from tasks.stages.fetched import Fetched, classify, exception_detail, failure

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504, 520, 521, 522, 523, 524})
_REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
_ROBOTS_MAX_BYTES = 512 * 1024  # RFC 9309 asks parsers to read at least 500 KiB


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


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def _shown(url: str, limit: int = 200) -> str:
    """A URL for a detail: shortened, and without user info, so a secret is not copied into ledgers."""
    url = _USERINFO.sub(r"\1***@", url)
    return url if len(url) <= limit else url[: limit - 3] + "..."


def _status_text(resp: aiohttp.ClientResponse) -> str:
    return f"HTTP {resp.status} {resp.reason}" if resp.reason else f"HTTP {resp.status}"


class Fetcher:
    """Fetches URLs for one shard with bounded concurrency, under the URL policy and SSRF guard.

    Args:
        cfg: the recipe's download config (limits, retries, user agent, network policy).
        s3_options: fsspec options for ``s3://`` sources in allowlisted buckets.

    Use as ``async with Fetcher(cfg) as f: await f.fetch(url)`` (the body in memory, under
    ``download.max_bytes``) or ``await f.fetch_to(url, dest, max_bytes)`` (the body streamed to
    a file, resumed with a range request when the connection drops); ``await f.fetch_with(url,
    body)`` hands the answer to a :class:`Body` of the caller's (a recheck's conditional request).
    None raises but for a cancellation: every outcome, an unexpected exception included, is a
    :class:`Fetched`.

    robots.txt (``download.respect_robots_txt``) and TDM-Rep's ``/.well-known/tdmrep.json``
    (``download.respect_tdmrep``) are read once per origin for the Fetcher's life (one shard).
    """

    def __init__(self, cfg: DownloadConfig, s3_options: dict[str, Any] | None = None):
        self.cfg = cfg
        self.policy = AddressPolicy.from_config(cfg.network)
        self.s3_options = s3_options or {}
        self.ua_token = cfg.user_agent.split("/", 1)[0].split()[0].lower() if cfg.user_agent.strip() else "*"
        self._directives = frozenset(cfg.opt_out_directives)
        self._global = asyncio.Semaphore(cfg.max_inflight)
        self._hosts: dict[str, asyncio.Semaphore] = {}
        self._robots: dict[str, asyncio.Future] = {}
        self._tdmrep: dict[str, asyncio.Future] = {}
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.timeout_s)

    async def __aenter__(self) -> Fetcher:
        connector = aiohttp.TCPConnector(
            resolver=GuardedResolver(self.policy),
            limit=self.cfg.max_inflight + 8,
            limit_per_host=0,
            ttl_dns_cache=300,
            enable_cleanup_closed=True,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # identity: bodies are hashed and capped as sent (auto_decompress is off), so none is
            # asked for compressed (aiohttp's default asks for gzip and deflate)
            headers={"User-Agent": self.cfg.user_agent, "Accept": "image/*,*/*;q=0.5", "Accept-Encoding": "identity"},
            timeout=self._timeout,
            auto_decompress=False,
            trust_env=False,  # no proxies and no .netrc credentials from the environment
            # Images are 100 KB to MBs: larger reads cost fewer wake-ups than the 64 KiB default.
            read_bufsize=CHUNK,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        for fut in (*self._robots.values(), *self._tdmrep.values()):
            fut.cancel()
        if self._session is not None:
            await self._session.close()

    def _host_sem(self, host: str) -> asyncio.Semaphore:
        sem = self._hosts.get(host)
        if sem is None:
            sem = self._hosts[host] = asyncio.Semaphore(self.cfg.per_host)
        return sem

    def _check(self, url: str) -> Ruling[str]:
        return check_url(url, self.cfg.network, self.policy)

    async def fetch(self, url: str) -> Fetched:
        """Fetch one URL: the policy first, then up to ``retries`` more attempts for transient failures."""
        try:
            return await self._fetch(url, _MemoryBody(self))
        except BaseException as err:  # noqa: BLE001 - every exception is this URL's record
            return failure(err)

    async def fetch_with(self, url: str, body: Body) -> Fetched:
        """Fetch one URL under the policy of :meth:`fetch`, its answer handled by ``body``."""
        try:
            return await self._fetch(url, body)
        except BaseException as err:  # noqa: BLE001 - every exception is this URL's record
            return failure(err)

    async def fetch_to(self, url: str, dest: Path, max_bytes: int, *, cap_name: str = "max_bytes") -> Fetched:
        """Fetch one URL's body into the file ``dest``, chunk by chunk, under the policy of :meth:`fetch`.

        The body may have ``max_bytes`` (named ``cap_name`` in details); ``download.timeout_s``
        bounds each wait for headers or for the next bytes, not the whole body. A transfer that
        drops after bytes arrived resumes where it stopped (see :class:`FileBody`), within
        ``download.retries``. On success ``path`` is ``dest`` and ``size`` its bytes; on any
        other outcome, a cancellation included, ``dest`` is removed.
        """
        cfg = self.cfg
        floor = (cfg.video_min_bytes_per_s, cfg.video_min_rate_after_s) if cfg.video_min_bytes_per_s else None
        body = FileBody(dest, max_bytes, cap_name, cfg.timeout_s, floor)
        try:
            fetched = await self._fetch(url, body)
        except BaseException as err:  # noqa: BLE001 - every exception is this URL's record
            dest.unlink(missing_ok=True)  # before failure(), which raises a cancellation again
            fetched = failure(err)
        if fetched.reason is not None:
            dest.unlink(missing_ok=True)
        fetched.resumed = body.resumed
        return fetched

    async def _fetch(self, url: str, body: Body) -> Fetched:
        checked = self._check(url)
        if not checked.ok:
            return Fetched(reason=checked.reason, detail=checked.detail)
        if urlsplit(url).scheme.lower() in ("file", "s3"):
            return await asyncio.to_thread(self._read_object, url, body)
        last: Retry | None = None
        attempts = 0
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                delay = min(self.cfg.backoff_s * 2 ** (attempt - 1), self.cfg.max_backoff_s)
                if last is not None and last.delay is not None:
                    delay = max(delay, last.delay)
                await asyncio.sleep(delay)
            attempts += 1
            try:
                fetched = await self._attempt(url, body)
            except Retry as retry:
                last = retry
                if retry.reason == "rate_limited":
                    break
                continue
            fetched.attempts = attempts
            return fetched
        return Fetched(reason=last.reason, http_status=last.status, attempts=attempts, detail=last.detail)

    async def _attempt(self, url: str, body: Body) -> Fetched:
        host = URL(url).raw_host or ""
        # The host's slot first: a request queued behind a busy host must not hold one of the
        # shard's global slots, or one dominant host starves all the others.
        async with self._host_sem(host), self._global:
            deadline = asyncio.timeout(body.deadline_s)
            try:
                async with deadline:
                    return await self._follow(url, body)
            except Retry:
                raise
            except TimeoutError as err:
                if deadline.expired():
                    return Fetched(
                        reason="timeout",
                        detail=f"no complete response within download.timeout_s ({self.cfg.timeout_s:g} s)",
                    )
                return Fetched(reason="timeout", detail=exception_detail(err))
            except BaseException as err:  # noqa: BLE001 - classified; transient ones are retried
                fetched = failure(err)
                if classify(err)[1]:
                    raise Retry(fetched.reason, None, None, fetched.detail) from None
                return fetched

    async def _follow(self, url: str, body: Body) -> Fetched:
        for _hop in range(self.cfg.max_redirects + 1):
            if self.cfg.respect_robots_txt:
                robots = await self._robots_verdict(url)
                if not robots.ok:
                    return Fetched(reason=robots.reason, detail=robots.detail)
            # The origin's tdmrep.json is read before the request, and judged with the answer's
            # headers: a tdm-reservation header supersedes the file (either way).
            tdm_rules = await self._tdm_rules(url) if self.cfg.respect_tdmrep else None
            async with self._session.get(
                URL(url), allow_redirects=False, headers=body.headers(), timeout=body.timeout or self._timeout
            ) as resp:
                status = resp.status
                if status in _REDIRECT_STATUS:
                    location = resp.headers.get("Location")
                    if not location:
                        return Fetched(
                            reason=f"http_{status}",
                            http_status=status,
                            detail=f"{_status_text(resp)}: redirect without Location",
                        )
                    target = self._redirect_target(url, location)
                    url = target.value or location
                    if not target.ok:
                        return Fetched(
                            reason=target.reason,
                            http_status=status,
                            detail=f"redirect to {_shown(url)}: {target.detail}",
                        )
                    continue
                if status in _RETRY_STATUS:
                    delay = parse_retry_after(resp.headers.get("Retry-After")) if status in (429, 503) else None
                    if delay is not None and delay > self.cfg.max_retry_after_s:
                        raise Retry(
                            "rate_limited",
                            status,
                            None,
                            f"{_status_text(resp)}, Retry-After {delay:g} s over download.max_retry_after_s",
                        )
                    raise Retry(f"http_{status}", status, delay, _status_text(resp))
                if not body.accepts(status):
                    return Fetched(reason=f"http_{status}", http_status=status, detail=_status_text(resp))
                opt_out = x_robots_verdict(resp.headers.getall("X-Robots-Tag", []), self._directives, self.ua_token)
                if not opt_out.ok:
                    return Fetched(reason=opt_out.reason, http_status=status, detail=opt_out.detail)
                if self.cfg.respect_tdmrep:
                    tdm = tdm_verdict(
                        resp.headers.getall("tdm-reservation", []),
                        resp.headers.getall("tdm-policy", []),
                        tdm_rules,
                        url,
                    )
                    if not tdm.ok:
                        return Fetched(reason=tdm.reason, http_status=status, detail=tdm.detail)
                return await body.receive(resp)
        return Fetched(
            reason="too_many_redirects",
            detail=f"more than download.max_redirects ({self.cfg.max_redirects}); the last to {_shown(url)}",
        )

    def _redirect_target(self, url: str, location: str) -> Ruling[str]:
        """The absolute redirect target (the verdict's value), judged by the same checks as any URL."""
        try:
            target = urljoin(url, location)
            scheme = urlsplit(target).scheme.lower()
        except ValueError as err:
            return Ruling(location, "invalid_url", f"cannot parse the Location: {err}")
        if scheme not in ("http", "https"):
            return Ruling(
                target, "blocked_scheme", f"a redirect to {scheme or 'no'} scheme; only http and https are followed"
            )
        return self._check(target)

    async def _read_capped(self, resp: aiohttp.ClientResponse) -> tuple[bytes | None, str | None]:
        """(body, None), or (None, why) past max_bytes; Content-Length is not trusted either way."""
        parts: list[bytes] = []
        problem = await stream_capped(resp, self.cfg.max_bytes, parts.append)
        return (None, problem) if problem is not None else (b"".join(parts), None)

    async def _robots_verdict(self, url: str) -> Ruling[str]:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        fut = self._robots.get(origin)
        if fut is None:
            fut = self._robots[origin] = asyncio.ensure_future(self._load_robots(origin))
        # Shielded: a row that times out or is cancelled must not cancel the origin's shared load.
        rules = await asyncio.shield(fut)
        return rules.verdict(url, self.ua_token)

    async def _load_robots(self, origin: str) -> RobotsRules:
        """robots.txt per RFC 9309: 4xx allows all; 5xx, unreachable or unreadable disallows all.

        Redirects are followed by hand, each target checked like any URL.
        """
        url = origin + "/robots.txt"
        try:
            got = await self._site_file(url, _ROBOTS_MAX_BYTES)
        except Exception as err:  # noqa: BLE001 - RFC 9309: an unreachable robots.txt disallows all
            return RobotsRules.disallow_all(
                f"{url} could not be read ({exception_detail(err)}): disallow all (RFC 9309)", classify(err)[0]
            )
        if got.refused is not None:
            refused = got.refused
            return RobotsRules.disallow_all(
                f"robots.txt redirects to a refused URL ({refused.reason}: {refused.detail}): disallow all"
            )
        if got.status is None:
            return RobotsRules.disallow_all(f"{url}: more than {self.cfg.max_redirects} redirects: disallow all")
        if 400 <= got.status < 500:
            return RobotsRules.allow_all(f"{got.url} answered {got.status_text}: allow all")
        if got.status != 200:
            # A 5xx is an outage, not a refusal: the row carries it, and a later run retries it.
            reason = f"http_{got.status}" if got.status >= 500 else "robots_disallowed"
            return RobotsRules.disallow_all(f"{got.url} answered {got.status_text}: disallow all (RFC 9309)", reason)
        return RobotsRules.parse(got.body[:_ROBOTS_MAX_BYTES], got.url)

    async def _tdm_rules(self, url: str) -> TdmRules:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        fut = self._tdmrep.get(origin)
        if fut is None:
            fut = self._tdmrep[origin] = asyncio.ensure_future(self._load_tdmrep(origin))
        return await asyncio.shield(fut)  # shielded: as robots.txt, one row must not cancel the load

    async def _load_tdmrep(self, origin: str) -> TdmRules:
        """TDM-Rep's file on the origin: any answer but a 200 (after redirects, each target checked
        like any URL), a file over ``tdmrep.MAX_BYTES`` or one that is not valid JSON reserves nothing.

        It has half of ``download.timeout_s``: the rows of the origin wait for it within their own
        deadline, and an origin that never answers for an optional file must not time them out.
        """
        url = origin + tdmrep.TDMREP_PATH
        try:
            got = await self._site_file(
                url, tdmrep.MAX_BYTES, accept="application/json", timeout_s=self.cfg.timeout_s / 2
            )
        except Exception as err:  # noqa: BLE001 - an unreadable file is no reservation
            return TdmRules.none(f"{url} could not be read ({exception_detail(err)})")
        if got.refused is not None:
            return TdmRules.none(f"{url} redirects to a refused URL ({got.refused.reason})")
        if got.status != 200:
            return TdmRules.none(f"{got.url} answered {got.status_text or 'too many redirects'}")
        if got.over:
            return TdmRules.none(f"{got.url} is over {tdmrep.MAX_BYTES} bytes: ignored")
        return TdmRules.parse(got.body, got.url)

    async def _site_file(
        self, url: str, cap: int, accept: str | None = None, timeout_s: float | None = None
    ) -> _SiteFile:
        """A site-wide file (robots.txt, tdmrep.json) within ``timeout_s`` (default
        ``download.timeout_s``): redirects followed by hand, each target checked like any URL; the
        body read up to ``cap`` bytes (``over`` when there were more). Raises what the request raises."""
        headers = {"Accept": accept} if accept else None
        async with asyncio.timeout(timeout_s or self.cfg.timeout_s):
            for _hop in range(self.cfg.max_redirects + 1):
                async with self._session.get(URL(url), allow_redirects=False, headers=headers) as resp:
                    location = resp.headers.get("Location")
                    if resp.status in _REDIRECT_STATUS and location:
                        target = self._redirect_target(url, location)
                        url = target.value or location
                        if not target.ok:
                            return _SiteFile(url, resp.status, _status_text(resp), b"", False, target)
                        continue
                    if resp.status != 200:
                        return _SiteFile(url, resp.status, _status_text(resp), b"", False, None)
                    body = bytearray()
                    async for chunk in resp.content.iter_chunked(64 * 1024):
                        body += chunk
                        if len(body) > cap:
                            break
                    data, over = bytes(body[: cap + 1]), len(body) > cap
                    coding = resp.headers.get("Content-Encoding", "").strip().lower()
                    if coding in ("gzip", "x-gzip", "deflate"):  # sent compressed though identity was asked for
                        data, over = _inflated(data, cap, over)
                    return _SiteFile(url, 200, _status_text(resp), data, over, None)
            return _SiteFile(url, None, "", b"", False, None)

    def _read_object(self, url: str, body: Body) -> Fetched:
        """file:// (under file_root) and s3:// (allowlisted buckets), with the same byte cap."""
        import fsspec

        try:
            if url.lower().startswith("file:"):
                path = resolve_file_url(url, self.cfg.network.file_root)
                if path is None:
                    return Fetched(
                        reason="blocked_scheme", attempts=1, detail="file:// URL outside download.network.file_root"
                    )
                fh = open(path, "rb")  # noqa: SIM115 - closed below
            else:
                fh = fsspec.open(url, "rb", **self.s3_options).open()
            with fh:
                fetched = body.read_object(fh)
        except Exception as err:  # noqa: BLE001 - any storage client error is this row's read_error
            return Fetched(reason="read_error", attempts=1, detail=exception_detail(err))
        fetched.attempts = 1
        return fetched


def _inflated(data: bytes, cap: int, over: bool) -> tuple[bytes, bool]:
    """A gzip, zlib or raw deflate body inflated to at most ``cap`` bytes and one (a bomb stops
    there; ``over`` when there was more); the body as it came where it is none of these."""
    for wbits in (32 + zlib.MAX_WBITS, -zlib.MAX_WBITS):  # gzip or zlib by their header; raw deflate
        inflate = zlib.decompressobj(wbits)
        try:
            out = inflate.decompress(data, cap + 1)
        except zlib.error:
            continue
        more = len(out) > cap or bool(inflate.unconsumed_tail)
        if not (inflate.eof or over or more):  # a whole body that is no complete stream: not compressed
            continue
        return out, over or more
    return data, over


@dataclass(frozen=True)
class _SiteFile:
    """A site-wide file as read: its final URL, status (None: too many redirects), body (at most
    the cap and one byte: ``over`` says there was more), and the refused redirect, if one was."""

    url: str
    status: int | None
    status_text: str
    body: bytes
    over: bool
    refused: Ruling[str] | None


class _MemoryBody:
    """The body in memory (images): ``download.max_bytes`` at most, each attempt within ``timeout_s``."""

    timeout: aiohttp.ClientTimeout | None = None

    def __init__(self, fetcher: Fetcher):
        self.fetcher = fetcher
        self.deadline_s: float | None = fetcher.cfg.timeout_s

    def headers(self) -> dict[str, str] | None:
        return None

    def accepts(self, status: int) -> bool:
        return status == 200

    async def receive(self, resp: aiohttp.ClientResponse) -> Fetched:
        data, problem = await self.fetcher._read_capped(resp)
        if data is None:
            return Fetched(reason="too_large", http_status=resp.status, detail=problem)
        etag, last_modified = validators(resp)
        return Fetched(
            data=data,
            http_status=resp.status,
            content_type=resp.headers.get("Content-Type"),
            etag=etag,
            last_modified=last_modified,
        )

    def read_object(self, fh: BinaryIO) -> Fetched:
        cap = self.fetcher.cfg.max_bytes
        data = fh.read(cap + 1)
        if len(data) > cap:
            return Fetched(reason="too_large", detail=f"more than download.max_bytes ({cap})")
        return Fetched(data=data)
