"""Conditional and byte-range answers for the loopback web: If-None-Match, If-Modified-Since, Range and If-Range as RFC 9110 asks, and bodies sent in pieces that can stop short."""

from __future__ import annotations

import email.utils
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from tasks.demo.filecache import ServedFile

# Written at a time: the socket buffer never holds a copy of a large body, and a body cut
# after N bytes is cut there.
PIECE = 256 * 1024


def validators(f: ServedFile, ranges: bool = True, etag: bool = True) -> dict[str, str]:
    """Last-Modified of the file, its ETag unless ``etag`` is False, and Accept-Ranges when ``ranges`` are served."""
    headers: dict[str, str] = {hdrs.LAST_MODIFIED: f.last_modified}
    if etag:
        headers[hdrs.ETAG] = f.etag
    if ranges:
        headers[hdrs.ACCEPT_RANGES] = "bytes"
    return headers


def wanted_part(request: web.Request, f: ServedFile) -> tuple[int, int] | None:
    """The ``[start, end)`` of the file a request asks for, or None for the whole file.

    None: no Range, an If-Range that is not this version's ETag or Last-Modified (the file
    changed, so the client gets it whole), or a Range this server does not read (several
    ranges; RFC 9110 lets a server answer those with the whole file). A first byte past the
    end raises 416 with ``Content-Range: bytes */size``.
    """
    if hdrs.RANGE not in request.headers:
        return None
    if_range = request.headers.get(hdrs.IF_RANGE)
    if if_range is not None and if_range not in (f.etag, f.last_modified):
        return None
    try:
        asked = request.http_range
    except ValueError:
        return None
    size = len(f.body)
    start = asked.start if asked.start >= 0 else max(0, size + asked.start)  # "bytes=-N": the last N
    end = size if asked.stop is None else min(asked.stop, size)
    if start >= size:
        raise web.HTTPRequestRangeNotSatisfiable(headers={hdrs.CONTENT_RANGE: f"bytes */{size}"})
    return start, end


async def send(
    request: web.Request,
    f: ServedFile,
    part: tuple[int, int] | None,
    headers: dict[str, str],
    sent: Callable[[int], None],
    cut_after: int | None = None,
    pause: Callable[[], Awaitable[object]] | None = None,
) -> web.StreamResponse:
    """The file (200) or its ``part`` (206 with Content-Range), written in pieces.

    ``sent`` is told each piece's size as it is written. With ``cut_after``, the connection closes
    after that many body bytes (after awaiting ``pause``, a stall, when given): the client sees
    its declared length cut short in transit.
    """
    start, end = part or (0, len(f.body))
    resp = web.StreamResponse(status=206 if part else 200, headers=headers)
    if part:
        resp.headers[hdrs.CONTENT_RANGE] = f"bytes {start}-{end - 1}/{len(f.body)}"
    resp.content_type = f.content_type
    resp.content_length = end - start
    await resp.prepare(request)
    if request.method == "HEAD":
        return resp
    stop = end if cut_after is None else min(end, start + cut_after)
    body = memoryview(f.body)
    try:
        for at in range(start, stop, PIECE):
            piece = body[at : min(at + PIECE, stop)]
            sent(len(piece))  # before the write: a client that has the bytes finds them counted
            await resp.write(piece)
    except ConnectionError:
        return resp  # the client left
    if stop < end:
        if pause is not None:
            await pause()
        if request.transport is not None:
            request.transport.close()  # after the pieces are flushed: the client sees a cut body
        return resp
    await resp.write_eof()
    return resp


def not_modified(request: web.Request, f: ServedFile) -> bool:
    """Whether a conditional GET is answered 304 (RFC 9110 13.2.2): If-None-Match decides when
    present (weak comparison, ``*`` matches), else If-Modified-Since (the file not newer)."""
    if_none_match = request.headers.get(hdrs.IF_NONE_MATCH)
    if if_none_match is not None:
        tags = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
        return "*" in tags or f.etag.removeprefix("W/") in tags
    since = request.headers.get(hdrs.IF_MODIFIED_SINCE)
    if since is None:
        return False
    try:
        when = email.utils.parsedate_to_datetime(since)
    except (TypeError, ValueError):
        return False  # an invalid date is ignored (RFC 9110 13.1.3)
    return when.timestamp() >= f.mtime_ns // 1_000_000_000
