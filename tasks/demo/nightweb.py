"""A loopback web of several origins whose behaviour changes between nights: outages, dead links, replaced images, opt-outs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

from aiohttp import web

from tasks.demo import ranges
from tasks.demo.filecache import FileCache, ServedFile
from tasks.demo.tracked import TrackedServer

Mode = Literal["up", "down", "hang"]
_HANG_POLL_S = 0.1


class Origin(TrackedServer):
    """One origin (scheme, host, port) of a :class:`NightWeb`: its own robots.txt, TDM-Rep and outages.

    Routes (GET; HEAD too):

    - ``/img/{name}``: the file of that name in ``root``, with ETag and Last-Modified (of the
      file's mtime, so a replaced file has new ones); a matching ``If-None-Match`` (or, without
      one, an ``If-Modified-Since`` no older than the file) is a 304 without a body; a Range is
      a 206 as :mod:`tasks.demo.ranges` answers it. A name in ``gone`` answers that status
      (404, 410) instead.
    - ``/robots.txt``: ``robots_txt``; 404 (allow all) when it is None.
    - ``/.well-known/tdmrep.json``: ``tdmrep`` as JSON; 404 when it is None.

    What the test process switches between nights, from its own thread (plain attributes,
    read by every request):

    - ``mode``: ``up``; ``down``, every request (robots.txt included) answers 503; ``hang``,
      every request is accepted and never answered (until the mode changes or the server
      stops; then the connection is closed without a response).
    - ``robots_txt``: the text of robots.txt, or None.
    - ``tdm_reservation`` (``1`` or ``0``) and ``tdm_policy`` (a URL): the TDM-Rep response
      headers of every file answer (200, 206 and 304), when set.
    - ``x_robots_tag``: an ``X-Robots-Tag`` header on every file answer, when set.
    - ``tdmrep``: the body of ``/.well-known/tdmrep.json`` (a list of rules), or None.
    - ``gone``: file name -> status (404, 410) answered for that file.
    - the files in ``root``: :meth:`replace` writes a new version of one.

    Stats as :class:`TrackedServer` keeps them (``hits`` by path, ``sent`` body bytes by path,
    ``requests``), plus ``not_modified``: the 304s answered, by path.

    Args:
        name: the origin's name in the web (``a``, ``b``, ...).
        root: folder of its files (created if missing).
        host: address to listen on. Default ``127.0.0.1``.
        url_host: the host name URLs use (``localhost`` for an origin that must be a domain of
            its own); default ``host``.
        port: preferred port; 0 (the default) takes an ephemeral one.
    """

    def __init__(
        self, name: str, root: str | Path, host: str = "127.0.0.1", url_host: str | None = None, port: int = 0
    ):
        super().__init__(host, port)
        self.name = name
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.url_host = url_host or host
        self.mode: Mode = "up"
        self.robots_txt: str | None = None
        self.tdm_reservation: int | None = None
        self.tdm_policy: str | None = None
        self.x_robots_tag: str | None = None
        self.tdmrep: list[dict[str, object]] | None = None
        self.gone: dict[str, int] = {}
        self.not_modified: dict[str, int] = {}
        # Small files, read once; re-read when a replaced file's mtime or size changes.
        self._files = FileCache(self.root, 64 * 1024 * 1024)

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"origin {self.name} is not listening; call start() first")
        return f"http://{self.url_host}:{self.port}"

    def file_url(self, name: str) -> str:
        """The URL of file ``name`` of this origin."""
        return f"{self.base_url}/img/{name}"

    def replace(self, name: str, data: bytes, mtime: float | None = None) -> None:
        """A new version of file ``name``: new bytes, and a new mtime (``mtime``, default a
        second after the old one's) so its ETag and Last-Modified change as a server's would."""
        path = self.root / name
        old = path.stat().st_mtime if path.exists() else 0.0
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_bytes(data)
        when = mtime if mtime is not None else max(old + 1, 1.0)
        os.utime(tmp, (when, when))
        os.replace(tmp, path)

    def reset_stats(self) -> None:
        with self.lock:
            self.not_modified.clear()
        super().reset_stats()

    # ----------------------------------------------------------------- routes

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._track])
        app.add_routes(
            [
                web.get("/img/{name}", self._img),
                web.get("/robots.txt", self._robots),
                web.get("/.well-known/tdmrep.json", self._tdmrep),
            ]
        )
        return app

    async def _outage(self, request: web.Request) -> web.StreamResponse | None:
        """The answer of an origin that is down or hangs; None when it is up."""
        if self.mode == "down":
            return web.Response(status=503, text="service unavailable\n")
        if self.mode == "hang":
            with self.streaming(request):
                while self.mode == "hang" and not await self.stopping_within(_HANG_POLL_S):
                    pass
            if request.transport is not None:
                request.transport.close()  # no status line ever: the client's deadline ends it
            raise web.HTTPServiceUnavailable()
        return None

    def _headers(self, f: ServedFile, ranged: bool) -> dict[str, str]:
        headers = ranges.validators(f, ranged)
        if self.tdm_reservation is not None:
            headers["tdm-reservation"] = str(self.tdm_reservation)
            if self.tdm_policy:
                headers["tdm-policy"] = self.tdm_policy
        if self.x_robots_tag is not None:
            headers["X-Robots-Tag"] = self.x_robots_tag
        return headers

    async def _img(self, request: web.Request) -> web.StreamResponse:
        down = await self._outage(request)
        if down is not None:
            return down
        name = request.match_info["name"]
        status = self.gone.get(name)
        if status is not None:
            return web.Response(status=status, text=f"status {status}\n")
        f = self._files.get(name)
        if ranges.not_modified(request, f):
            with self.lock:
                self.not_modified[request.path] = self.not_modified.get(request.path, 0) + 1
            return web.Response(status=304, headers=self._headers(f, True))
        part = ranges.wanted_part(request, f)
        with self.streaming(request):
            return await ranges.send(request, f, part, self._headers(f, True), lambda n: self._count_sent(request, n))

    async def _robots(self, request: web.Request) -> web.StreamResponse:
        return await self._policy_file(request, "robots.txt", lambda: self.robots_txt, "text/plain")

    async def _tdmrep(self, request: web.Request) -> web.StreamResponse:
        def body() -> str | None:
            return None if self.tdmrep is None else json.dumps(self.tdmrep)

        return await self._policy_file(request, "tdmrep.json", body, "application/json")

    async def _policy_file(
        self, request: web.Request, name: str, body: Callable[[], str | None], content_type: str
    ) -> web.StreamResponse:
        """An origin's policy file: its outage first, then ``body()`` as read now; 404 when None."""
        down = await self._outage(request)
        if down is not None:
            return down
        text = body()
        if text is None:
            raise web.HTTPNotFound(text=f"no {name}\n")
        return web.Response(text=text, content_type=content_type)


class NightWeb:
    """Several :class:`Origin` servers, one per name, each on its own loopback port and folder
    ``root/{name}``, so that robots.txt, TDM-Rep and outages are per origin.

    Start and stop them together (``with NightWeb(...) as web``); ``web[name]`` is an origin,
    to switch between nights; ``requests()`` counts what all of them were asked.

    Args:
        root: folder of the origins' folders.
        names: the origins.
        url_hosts: origin name -> the host name its URLs use (e.g. ``localhost``); the others
            use ``127.0.0.1``.
    """

    def __init__(self, root: str | Path, names: Iterable[str], url_hosts: dict[str, str] | None = None):
        hosts = url_hosts or {}
        self.root = Path(root)
        self.origins = {n: Origin(n, self.root / n, url_host=hosts.get(n)) for n in names}

    def __getitem__(self, name: str) -> Origin:
        return self.origins[name]

    def __iter__(self) -> Iterator[Origin]:
        return iter(self.origins.values())

    def start(self) -> NightWeb:
        try:
            for origin in self:
                origin.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for origin in self:
            if origin.mode == "hang":
                origin.mode = "up"  # hung handlers end at once instead of at their next poll
            origin.stop()

    def __enter__(self) -> NightWeb:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def requests(self) -> int:
        """Requests all origins were sent since their stats were last reset."""
        return sum(o.stats()["requests"] for o in self)

    def bodies(self) -> int:
        """Body bytes all origins sent since their stats were last reset."""
        # ``sent`` counts a request with a query twice (by path, and by path and query).
        return sum(n for o in self for path, n in o.stats()["sent"].items() if "?" not in path)

    def reset_stats(self) -> None:
        for origin in self:
            origin.reset_stats()
