"""A loopback server that keeps stats of what it was asked and what it sent, readable from any thread."""

from __future__ import annotations

import collections
import threading
from collections.abc import Awaitable, Callable

from aiohttp import web

from tasks.demo.loopback import LoopbackServer


class TrackedServer(LoopbackServer):
    """A :class:`LoopbackServer` that counts requests; its application installs ``_track`` as middleware.

    Stats, read from any thread (take ``lock`` to iterate ``hits`` while the server runs, or
    use ``stats()``): ``hits`` counts requests by path without the query and, for requests
    with one, also by path with the query; ``sent`` counts body bytes the routes that report
    them (``_count_sent``) wrote, keyed as ``hits``; ``ranges`` lists (path with query, Range,
    If-Range or None) for every request with a Range header; ``user_agents`` holds every
    User-Agent seen and ``authorizations`` every Authorization header (credentials must never
    arrive here); ``requests`` counts all requests; ``in_flight`` is the number of handlers
    running now (``in_flight_by_path``: by path without the query) and ``max_concurrent`` the
    highest it has been. ``reset_stats()`` starts them
    over.

    Args:
        host, port: as :class:`LoopbackServer`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        super().__init__(host, port)
        self.lock = threading.Lock()
        self.hits: collections.Counter[str] = collections.Counter()
        self.sent: collections.Counter[str] = collections.Counter()
        self.ranges: list[tuple[str, str, str | None]] = []
        self.user_agents: set[str] = set()
        self.authorizations: set[str] = set()
        self.requests = 0
        self.in_flight = 0
        self.in_flight_by_path: collections.Counter[str] = collections.Counter()
        self.max_concurrent = 0

    def reset_stats(self) -> None:
        """Forget hits, user agents and counts; max_concurrent restarts from what is in flight."""
        with self.lock:
            self.hits.clear()
            self.sent.clear()
            self.ranges.clear()
            self.user_agents.clear()
            self.authorizations.clear()
            self.requests = 0
            self.max_concurrent = self.in_flight

    def stats(self) -> dict:
        """A consistent copy of the stats."""
        with self.lock:
            return {
                "hits": collections.Counter(self.hits),
                "sent": collections.Counter(self.sent),
                "ranges": list(self.ranges),
                "user_agents": set(self.user_agents),
                "authorizations": set(self.authorizations),
                "requests": self.requests,
                "in_flight": self.in_flight,
                "in_flight_by_path": +self.in_flight_by_path,  # paths with handlers running only
                "max_concurrent": self.max_concurrent,
            }

    @web.middleware
    async def _track(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        path = request.path
        with self.lock:
            self.requests += 1
            self.hits[path] += 1
            if request.query_string:
                self.hits[request.path_qs] += 1
            asked = request.headers.get("Range")
            if asked is not None:
                self.ranges.append((request.path_qs, asked, request.headers.get("If-Range")))
            agent = request.headers.get("User-Agent")
            if agent is not None:
                self.user_agents.add(agent)
            auth = request.headers.get("Authorization")
            if auth is not None:
                self.authorizations.add(auth)
            self.in_flight += 1
            self.in_flight_by_path[path] += 1
            if self.in_flight > self.max_concurrent:
                self.max_concurrent = self.in_flight
        try:
            return await handler(request)
        finally:
            with self.lock:
                self.in_flight -= 1
                self.in_flight_by_path[path] -= 1

    def _hit_count(self, request: web.Request, key: str | None = None) -> int:
        with self.lock:
            return self.hits[key or request.path]

    def _count_sent(self, request: web.Request, n: int) -> None:
        with self.lock:
            self.sent[request.path] += n
            if request.query_string:
                self.sent[request.path_qs] += n
