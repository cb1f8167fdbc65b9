"""What fetching one URL ended in: the record of its bytes or its reason, exceptions classified into reasons, fetched bytes judged."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from dataclasses import dataclass

import aiohttp

from tasks.formats.spooled import SpooledBody
from tasks.policies.sniff import SNIFF_BYTES, bytes_verdict
from tasks.policies.urlguard import BlockedAddress, InvalidHost


@dataclass
class Fetched:
    """What fetching one URL (and judging its bytes) ended in: bytes, or a reason with a detail.

    A body fetched into memory (``Fetcher.fetch``) is ``data``; one streamed to a file
    (``Fetcher.fetch_to``) is ``path`` with its ``size`` in bytes, ``data`` None; a video read
    from a tar or a file is ``data`` as a :class:`SpooledBody`. ``resumed``
    counts the attempts that continued a dropped transfer with a range request (part of
    ``attempts``). ``etag`` and ``last_modified``: the validators of the final answer, which a
    recheck of the row sends back (``If-None-Match`` / ``If-Modified-Since``).
    """

    reason: str | None = None
    data: bytes | SpooledBody | None = None
    http_status: int | None = None
    attempts: int = 0
    detail: str | None = None
    content_type: str | None = None
    format: str | None = None
    path: str | None = None
    size: int | None = None
    resumed: int = 0
    etag: str | None = None
    last_modified: str | None = None


def exception_detail(err: BaseException) -> str:
    """``TypeName: message`` of an exception, for a ledger detail."""
    name = type(err).__name__
    text = str(err)
    if isinstance(err, aiohttp.ClientConnectorError) and err.os_error is not None:
        inner = err.os_error
        if isinstance(inner, (BlockedAddress, InvalidHost)):
            return str(inner)  # our own message names the host and the addresses
        name += f" ({type(inner).__name__})"
        if inner.strerror is None:  # aiohttp shows strerror, which a one-argument OSError lacks
            text = text.removesuffix(" [None]") + f" [{inner}]"
    return f"{name}: {text}" if text else name


def classify(err: BaseException) -> tuple[str, bool]:
    """(reason, worth a retry) for an exception raised while fetching one URL.

    Known classes keep the reasons people look for (a host that cannot be encoded is an
    ``invalid_url``, a failed lookup a ``dns_error`` ...); anything else is ``fetch_failed``.
    """
    # The guard's refusals reach us raised by the resolver, wrapped by aiohttp's connector.
    inner = err.os_error if isinstance(err, aiohttp.ClientConnectorError) else err
    if isinstance(inner, BlockedAddress):
        return "blocked_address", False
    if isinstance(inner, InvalidHost):
        return "invalid_url", False
    if isinstance(err, aiohttp.ClientConnectorDNSError):
        return "dns_error", False
    if isinstance(err, aiohttp.ClientSSLError):
        return "tls_error", False
    if isinstance(err, aiohttp.ClientConnectorError):
        return "connection_error", True
    if isinstance(err, ssl.SSLError):
        return "tls_error", False
    if isinstance(err, aiohttp.InvalidURL):
        return "invalid_url", False
    if isinstance(err, TimeoutError):
        return "timeout", False
    if isinstance(err, socket.gaierror):
        return "dns_error", False
    if isinstance(
        err, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionError)
    ):
        return "connection_error", True
    if isinstance(err, (aiohttp.ClientError, OSError)):
        return "connection_error", False
    return "fetch_failed", False


def failure(err: BaseException) -> Fetched:
    """The record of an exception raised while fetching or judging one row.

    Interpreter exits, and a cancellation of the running task (the shard deadline, a shutdown),
    propagate; a CancelledError that some step raised on its own is a failure like any other.
    """
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        raise err
    if isinstance(err, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise err
    return Fetched(reason=classify(err)[0], detail=exception_detail(err))


def judge(fetched: Fetched, allowed_formats: tuple[str, ...]) -> Fetched:
    """Judge fetched bytes in place (sniffed format, allowlist, truncation); a refused body is dropped."""
    if fetched.reason is None:
        data = fetched.data or b""
        if isinstance(data, SpooledBody):  # judged on its start, as a streamed body is (judge_file)
            verdict = bytes_verdict(data.head(SNIFF_BYTES), allowed_formats, fetched.content_type, len(data))
        else:
            verdict = bytes_verdict(data, allowed_formats, fetched.content_type)
        fetched.reason, fetched.format, fetched.detail = verdict.reason, verdict.value, verdict.detail
        if not verdict.ok:
            fetched.data = None
    return fetched


def take_body(fetched: Fetched) -> bytes | SpooledBody | None:
    """The body: the bytes held, or, for a body streamed to a file, that file taken over as a
    :class:`SpooledBody` (its name removed: the shard writes it and the judge reads it from the
    file, never whole in memory)."""
    if fetched.data is None and fetched.path is not None:
        body = SpooledBody.adopt(fetched.path)
        fetched.path = None
        return body
    return fetched.data


def judge_file(fetched: Fetched, allowed_formats: tuple[str, ...]) -> Fetched:
    """Judge a body streamed to a file in place, as :func:`judge` judges bytes, from its first
    ``SNIFF_BYTES``; a refused file is removed.

    A file longer than that is judged on format and allowlist only: the end markers that show
    an image's truncation are past the prefix (a video's index is the video probe's to check).
    """
    if fetched.reason is None and fetched.path is not None:
        with open(fetched.path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
        verdict = bytes_verdict(head, allowed_formats, fetched.content_type, fetched.size)
        fetched.reason, fetched.format, fetched.detail = verdict.reason, verdict.value, verdict.detail
        if not verdict.ok:
            os.unlink(fetched.path)
            fetched.path = None
    return fetched
