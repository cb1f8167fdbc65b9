"""Where a fetched body goes: read under a byte cap, or streamed to a file whose dropped transfer resumes with a range request."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

import aiohttp

from tasks.stages.fetched import Fetched, exception_detail

CHUNK = 1 << 20  # body read size; images are 100 KB to MBs, videos far more

# RFC 9110 14.4: "bytes first-last/complete", the complete length "*" when unknown.
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)", re.ASCII | re.IGNORECASE)
# A validator longer than this is not kept: it would only be sent back, and a row's ledger
# entry need not carry a server's kilobytes.
_VALIDATOR_CHARS = 512


def validators(resp: aiohttp.ClientResponse) -> tuple[str | None, str | None]:
    """(ETag, Last-Modified) of an answer, each None when absent, empty or over 512 characters:
    what a recheck of the row sends back (``If-None-Match`` / ``If-Modified-Since``)."""
    etag, last_modified = resp.headers.get("ETag"), resp.headers.get("Last-Modified")
    return (
        etag.strip() if etag and etag.strip() and len(etag) <= _VALIDATOR_CHARS else None,
        last_modified.strip()
        if last_modified and last_modified.strip() and len(last_modified) <= _VALIDATOR_CHARS
        else None,
    )


def content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """(first, last, complete length or None for ``*``) of a Content-Range value, or None."""
    match = _CONTENT_RANGE.fullmatch((value or "").strip())
    if match is None:
        return None
    return int(match[1]), int(match[2]), None if match[3] == "*" else int(match[3])


class Retry(Exception):
    """A transient failure of one attempt: the fetcher tries again, after ``delay`` s at least."""

    def __init__(self, reason: str, status: int | None, delay: float | None, detail: str):
        super().__init__(detail)
        self.reason, self.status, self.delay, self.detail = reason, status, delay, detail


class Body(Protocol):
    """What one URL's body becomes across the fetcher's attempts (the fetcher keeps the URL policy).

    ``deadline_s`` bounds one whole attempt (None: none); ``timeout`` is aiohttp's for its
    requests (None: the session's).
    """

    deadline_s: float | None
    timeout: aiohttp.ClientTimeout | None

    def headers(self) -> dict[str, str] | None:
        """Extra request headers for the next attempt."""

    def accepts(self, status: int) -> bool:
        """Whether a final (not redirect, not retried) status is the body's to receive."""

    async def receive(self, resp: aiohttp.ClientResponse) -> Fetched:
        """The outcome of one accepted response; raises :class:`Retry` for another attempt."""

    def read_object(self, fh: BinaryIO) -> Fetched:
        """The outcome of reading an opened file:// or s3:// object."""


async def stream_capped(
    resp: aiohttp.ClientResponse,
    cap: int,
    write: Callable[[bytes], object],
    held: int = 0,
    cap_name: str = "download.max_bytes",
) -> str | None:
    """Hand the body to ``write`` chunk by chunk: None, or why it stopped past ``cap``.

    Content-Length is not trusted either way: it refuses before a byte is read, and the bytes
    are counted as they come. ``held``: bytes of the same body already kept (a resumed
    transfer), which count towards the cap.
    """
    declared = resp.content_length
    whole = None if declared is None else held + declared
    after = f" after {held} bytes held" if held else ""
    if whole is not None and whole > cap:
        return f"Content-Length {declared}{after} is over {cap_name} ({cap})"
    total = held
    try:
        async for chunk in resp.content.iter_chunked(CHUNK):
            total += len(chunk)
            if total > cap:
                return f"more than {cap_name} ({cap}) received" + (
                    f", Content-Length {declared}{after}" if declared is not None else ""
                )
            write(chunk)
    except aiohttp.ClientPayloadError as err:
        expected = f"{whole} declared" if whole is not None else "an undeclared number of"
        raise aiohttp.ClientPayloadError(f"received {total} of {expected} bytes ({err})") from err
    return None


class _WriteError(Exception):
    """The local file, not the URL, failed: not retried, and not a connection's fault."""


class _TooSlow(Exception):
    """A streamed body averaging less than its minimum rate: the row's timeout."""


class FileBody:
    """A body streamed to ``dest`` across attempts: what arrived stays, and the next attempt asks for the rest.

    A resumed attempt sends ``Range: bytes=N-`` with ``If-Range`` (the first answer's strong
    ETag, else its Last-Modified; with neither, the transfer starts over) and appends a ``206``
    whose Content-Range starts at byte N (and whose complete length is the first answer's,
    when both are known). A ``200`` (a server that ignores ranges, or a file that changed, so
    If-Range did not match) starts the file over; a ``416`` or a ``206`` that does not continue
    the file starts over without Range, at the cost of an attempt.

    Args:
        dest: the file to write (the caller's, in a temp folder); what it held is replaced.
        cap: the most bytes the whole body may have.
        cap_name: the cap's name in details (``video.max_bytes``).
        stall_s: the longest wait for a response's headers or for the body's next bytes. There
            is no deadline for a whole body (a large one takes as long as it takes); a stall after
            bytes arrived is resumed like a dropped connection.
    """

    deadline_s: float | None = None

    def __init__(
        self, dest: Path, cap: int, cap_name: str, stall_s: float, min_rate: tuple[float, float] | None = None
    ):
        self.dest, self.cap, self.cap_name, self.stall_s = dest, cap, cap_name, stall_s
        # (bytes per second, after seconds): a response that averages less once that time has
        # passed ends the row (a server that trickles just inside stall_s would hold it for hours).
        self.min_rate = min_rate
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=stall_s, sock_read=stall_s)
        self.held = 0  # bytes at the start of dest that are the body's
        self.total: int | None = None  # the complete length, as the body's first answer declared it
        self.validator: str | None = None
        self.content_type: str | None = None
        self.resumed = 0
        # The first (200) answer's validators, which the record keeps for a later recheck.
        self.etag: str | None = None
        self.last_modified: str | None = None

    def headers(self) -> dict[str, str] | None:
        if not self.held or self.validator is None:
            return None
        return {"Range": f"bytes={self.held}-", "If-Range": self.validator}

    def accepts(self, status: int) -> bool:
        return status in (200, 206, 416)

    async def receive(self, resp: aiohttp.ClientResponse) -> Fetched:
        status = resp.status
        if status == 200:
            self._start(resp)
        elif status == 416 or not self._continues(resp):
            asked = f"Range bytes={self.held}-" if self.headers() else "no Range"
            shown = f"Content-Range {resp.headers.get('Content-Range')!r}" if status == 206 else f"HTTP {status}"
            detail = f"{shown} to {asked}: not the file whose first {self.held} bytes arrived"
            self._forget()  # the next attempt asks for the whole file
            raise Retry(f"http_{status}", status, None, detail)
        elif self.held:
            self.resumed += 1
        self.content_type = self.content_type or resp.headers.get("Content-Type")
        try:
            with self._open() as fh:
                problem = await stream_capped(resp, self.cap, self._writer(fh), self.held, self.cap_name)
        except _WriteError as err:
            return Fetched(reason="fetch_failed", http_status=status, detail=str(err))
        except _TooSlow as err:
            return Fetched(reason="timeout", http_status=status, detail=str(err))
        except aiohttp.SocketTimeoutError:
            if not self.held:
                raise
            raise Retry(
                "timeout", status, None, f"no bytes for {self.stall_s:g} s after {self.held} of {self._of()} bytes"
            ) from None
        if problem is not None:
            return Fetched(reason="too_large", http_status=status, detail=problem)
        if self.total is not None and self.held < self.total:  # a 206 may end before the file does
            raise Retry("connection_error", status, None, f"HTTP 206 ended at byte {self.held} of {self.total}")
        return self._done(status)

    def read_object(self, fh: BinaryIO) -> Fetched:
        with open(self.dest, "wb") as out:
            while chunk := fh.read(CHUNK):
                self.held += len(chunk)
                if self.held > self.cap:
                    return Fetched(reason="too_large", detail=f"more than {self.cap_name} ({self.cap})")
                out.write(chunk)
        return self._done(None)

    def _open(self) -> BinaryIO:
        """dest, opened to write after the bytes held (all of it when none are)."""
        try:
            fh = open(self.dest, "r+b" if self.held else "wb")  # noqa: SIM115 - the caller closes it
            try:
                fh.seek(self.held)
                fh.truncate()
            except OSError:
                fh.close()
                raise
        except OSError as err:
            raise _WriteError(f"writing {self.dest}: {exception_detail(err)}") from err
        return fh

    def _writer(self, fh: BinaryIO) -> Callable[[bytes], None]:
        started, first = time.monotonic(), self.held

        def write(chunk: bytes) -> None:
            try:
                fh.write(chunk)
                fh.flush()  # what is counted held is in the file, whatever ends the response
            except OSError as err:
                raise _WriteError(f"writing {self.dest}: {exception_detail(err)}") from err
            self.held += len(chunk)
            if self.min_rate is not None:
                rate, after = self.min_rate
                spent = time.monotonic() - started
                if spent > after and (self.held - first) / spent < rate:
                    raise _TooSlow(
                        f"{(self.held - first) / spent:.0f} bytes/s over {spent:.0f} s ({self.held} of {self._of()} bytes):"
                        f" under download.video_min_bytes_per_s ({rate:g})"
                    )

        return write

    def _start(self, resp: aiohttp.ClientResponse) -> None:
        """A whole body begins: what was held is dropped, and its validator and length are kept."""
        self._forget()
        etag = resp.headers.get("ETag")
        # A weak ETag cannot make a range request conditional (RFC 9110 13.1.5); a date can.
        self.validator = etag if etag and not etag.startswith("W/") else resp.headers.get("Last-Modified")
        self.total = resp.content_length
        self.content_type = resp.headers.get("Content-Type")
        self.etag, self.last_modified = validators(resp)

    def _continues(self, resp: aiohttp.ClientResponse) -> bool:
        """Whether a 206 continues the file at the byte held, with the complete length seen before."""
        match = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
        if match is None or int(match[1]) != self.held or int(match[2]) < self.held:
            return False
        if match[3] != "*":
            if self.total is not None and int(match[3]) != self.total:
                return False
            self.total = int(match[3])
        return True

    def _forget(self) -> None:
        self.held, self.total, self.validator = 0, None, None
        self.etag = self.last_modified = None

    def _of(self) -> str:
        return str(self.total) if self.total is not None else "an undeclared number of"

    def _done(self, status: int | None) -> Fetched:
        return Fetched(
            http_status=status,
            content_type=self.content_type,
            path=str(self.dest),
            size=self.held,
            resumed=self.resumed,
            etag=self.etag,
            last_modified=self.last_modified,
        )
