"""A loopback web of images, polite and hostile, for the demo, the tests and the benchmarks."""

from __future__ import annotations

import argparse
import collections
import gzip
import os
import random
import sys
from pathlib import Path

from aiohttp import hdrs, web

from tasks.demo import ranges
from tasks.demo.filecache import FileCache, ServedFile
from tasks.demo.tracked import TrackedServer

DEFAULT_ROBOTS_TXT = "User-agent: *\nDisallow: /private/\n"
DEFAULT_TDM_POLICY = "https://rights.example/policies/tdm.json"

JPEG_MAGIC = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00"
_ZEROS = bytes(64 * 1024)
_DRIP_INTERVAL_S = 0.5
_TRICKLE_PIECES = 8
_CORRUPT_KEEP = 16  # bytes of the real file kept: magic number and first header bytes
_HTML_PAGE = (
    b"<!DOCTYPE html>\n<html><head><title>Photo of the day</title></head>\n"
    b"<body><h1>Photo of the day</h1><p>Sign in to see this image.</p></body></html>\n"
)


class ImageWeb(TrackedServer):
    """An aiohttp server on loopback that serves files from ``root`` through good and bad routes.

    Routes (GET; HEAD too):

    - ``/img/{name}``: the file, Content-Type from the extension, Content-Length, ETag and
      Last-Modified set; a Range (``bytes=N-``, ``bytes=N-M``, ``bytes=-N``) is a 206 with
      Content-Range unless an If-Range does not match; a first byte past the end is a 416. An
      ``If-None-Match`` naming the file's ETag (or, without one, an ``If-Modified-Since`` not
      before its Last-Modified) is a 304 with no body (counted in ``not_modified``). Every
      answer carries ``img_headers`` too.
    - ``/drop/{name}?after=N&times=K``: the first K (default 1) requests for this path and
      query send N bytes of their body (whole or ranged, as ``/img``) and close the connection
      (with ``stall=S``, S seconds later: a stalled transfer); later ones are ``/img``'s answer,
      of the file ``then`` names when the query has one (a file that changed between attempts).
      Without ``after`` no request is cut; ``etag=0`` sends Last-Modified as the only validator.
    - ``/norange/{name}``: the file whole (200) whatever Range asks, with ETag and
      Last-Modified; ``after``, ``times`` and ``then`` as ``/drop``.
    - ``/status/{code}``: that status with a short body.
    - ``/flaky/{n}/{name}``: 500 for the first ``n`` hits on this exact path, then the file.
    - ``/ratelimit/{seconds}/{n}/{name}``: 429 with ``Retry-After: {seconds}`` for the first
      ``n`` hits on this exact path, then the file.
    - ``/slow/{name}``: headers, then the body one byte every 0.5 s until the client leaves.
    - ``/trickle/{ms}/{name}``: headers, then the file in 8 pieces spread over ``ms``
      milliseconds: a slow server whose answer completes.
    - ``/delay/{ms}/{name}``: nothing for ``ms`` milliseconds, then the file.
    - ``/hang``: never answers, not even headers, until the server stops.
    - ``/endless``: a chunked image/jpeg of a JPEG prefix and then zeros, never ending.
    - ``/html-as-jpeg``: an HTML page labelled image/jpeg.
    - ``/truncated/{name}``: the first half of the file, as a complete response.
    - ``/corrupt/{name}``: the file's first 16 bytes (its magic number), then garbage to its
      full length (the same garbage for the same name), labelled as the file.
    - ``/empty/{name}``: 200 with the file's Content-Type and a body of 0 bytes.
    - ``/short/{name}``: Content-Length of the whole file, the first half of it, then the
      connection closes (a body cut off in transit).
    - ``/optout/{name}``: the file with ``X-Robots-Tag: noai, noimageai``.
    - ``/optout-other-bot/{name}``: the file with ``X-Robots-Tag: otherbot: noai`` (scoped to
      another user agent, so it is not an opt-out for us).
    - ``/redirect?to=URL``: 302 to URL.
    - ``/redirect-chain/{n}/{name}``: 302 to ``/redirect-chain/{n-1}/{name}``; the file at 0.
    - ``/private/{name}``: the file (the default robots.txt disallows ``/private/``).
    - ``/plain/{name}``: the file as ``/img`` serves it (Range too), but with no ETag and no
      Last-Modified: a server that gives no validators.
    - ``/tdm/{name}``: the file, as ``/img``, with ``tdm-reservation: 1`` and ``tdm-policy``
      (``tdm_policy``, or the query's ``policy``; none with ``policy=``).
    - ``/robots.txt``: ``robots_txt``; 404 when it is None; that status when it is an int.
    - ``/.well-known/tdmrep.json``: ``tdmrep_json`` (TDM-Rep's file) as application/json; 404
      when it is None; that status when it is an int.

    ``{name}`` is one path segment naming a file directly in ``root``; names with a separator
    or a leading dot are refused with 403, so an encoded ``..%2F`` cannot leave the root. The
    query string is ignored by every route, so ``/img/a.jpg?i=17`` gives benchmarks any number
    of distinct URLs over a small pool of files.

    Files are read once into an LRU of ``cache_bytes`` (re-read when their mtime changes): on
    a 2-core machine serving bytes from memory costs the server less than a sendfile response,
    which stats and opens the file in an executor thread per request.

    Args:
        root: folder of the files; None serves no files (every file route answers 404).
        host: address to listen on. Default ``127.0.0.1``.
        port: preferred port; 0 (the default) takes an ephemeral one. A nonzero port that is
            busy falls back to an ephemeral one, so check ``port`` / ``base_url`` after
            ``start()``.
        robots_txt: body of ``/robots.txt``; None answers 404, an int answers that HTTP
            status (e.g. 503, which RFC 9309 crawlers take as "disallow all"). Default disallows
            ``/private/`` for every user agent.
        cache_bytes: memory for cached file bodies. Default 256 MiB.
        tdmrep_json: body of ``/.well-known/tdmrep.json``, as ``robots_txt``. Default None (404).
        img_headers: response headers added to every ``/img`` answer (``X-Robots-Tag``,
            ``tdm-reservation``: a site that changes its configuration between runs may set
            them on the running server). Default none.
        tdm_policy: the ``tdm-policy`` of ``/tdm`` answers.

    The attributes of the same names may be changed while the server runs. Stats (``hits``, ``sent``, ``ranges`` ...) as :class:`TrackedServer` keeps them;
    ``reset_stats()`` also restarts the flaky, rate-limit and drop sequences. ``sent`` counts
    the body bytes that ``/img``, ``/drop`` and ``/norange`` wrote.
    """

    def __init__(
        self,
        root: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        robots_txt: str | int | None = DEFAULT_ROBOTS_TXT,
        cache_bytes: int = 256 * 1024 * 1024,
        tdmrep_json: str | bytes | int | None = None,
        img_headers: dict[str, str] | None = None,
        tdm_policy: str = DEFAULT_TDM_POLICY,
    ):
        super().__init__(host, port)
        self.root = Path(root) if root is not None else None
        self.robots_txt = robots_txt
        self.tdmrep_json = tdmrep_json
        self.img_headers: dict[str, str] = dict(img_headers or {})
        self.tdm_policy = tdm_policy
        # robots.txt and tdmrep.json sent gzip-compressed whatever the client asked for (a server
        # compressing text by its type, as nginx's gzip_types does); each one's Accept-Encoding is kept
        self.gzip_site_files = False
        self.site_file_encodings: list[str | None] = []
        self.not_modified: collections.Counter[str] = collections.Counter()
        self.cache_bytes = cache_bytes
        self._files = FileCache(self.root, cache_bytes)

    def reset_stats(self) -> None:
        super().reset_stats()
        with self.lock:
            self.not_modified.clear()

    # ----------------------------------------------------------------- files

    def _file(self, name: str) -> ServedFile:
        return self._files.get(name)

    def _file_response(self, name: str, headers: dict[str, str] | None = None) -> web.Response:
        f = self._file(name)
        return web.Response(body=f.body, content_type=f.content_type, headers=headers)

    # ----------------------------------------------------------------- routes

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._track])
        app.add_routes(
            [
                web.get("/img/{name}", self._img),
                web.get("/private/{name}", self._img),
                web.get("/tdm/{name}", self._tdm),
                web.get("/plain/{name}", self._plain),
                web.get("/drop/{name}", self._drop),
                web.get("/norange/{name}", self._drop),
                web.get("/status/{code}", self._status),
                web.get("/flaky/{n}/{name}", self._flaky),
                web.get("/ratelimit/{seconds}/{n}/{name}", self._ratelimit),
                web.get("/slow/{name}", self._slow),
                web.get("/trickle/{ms}/{name}", self._trickle),
                web.get("/delay/{ms}/{name}", self._delay),
                web.get("/endless", self._endless),
                web.get("/hang", self._hang),
                web.get("/html-as-jpeg", self._html_as_jpeg),
                web.get("/truncated/{name}", self._truncated),
                web.get("/corrupt/{name}", self._corrupt),
                web.get("/empty/{name}", self._empty),
                web.get("/short/{name}", self._short),
                web.get("/optout/{name}", self._optout),
                web.get("/optout-other-bot/{name}", self._optout_other_bot),
                web.get("/redirect", self._redirect),
                web.get("/redirect-chain/{n}/{name}", self._redirect_chain),
                web.get("/robots.txt", self._robots),
                web.get("/.well-known/tdmrep.json", self._tdmrep),
            ]
        )
        return app

    @staticmethod
    def _int(request: web.Request, key: str, low: int = 0, high: int = 1_000_000, default: int | None = None) -> int:
        """A path segment's integer, or the query's (``default`` when it has none)."""
        raw = request.match_info.get(key, request.query.get(key))
        if raw is None:
            if default is None:
                raise web.HTTPBadRequest(text=f"missing {key}\n")
            return default
        try:
            value = int(raw)
        except ValueError:
            raise web.HTTPBadRequest(text=f"{key} must be an integer, got {raw!r}\n") from None
        if not low <= value <= high:
            raise web.HTTPBadRequest(text=f"{key} must be in {low}..{high}, got {value}\n")
        return value

    async def _img(self, request: web.Request, extra: dict[str, str] | None = None) -> web.StreamResponse:
        f = self._file(request.match_info["name"])
        headers = {**ranges.validators(f), **self.img_headers, **(extra or {})}
        if ranges.not_modified(request, f):
            with self.lock:
                self.not_modified[request.path] += 1
            return web.Response(status=304, headers=headers)
        if "Range" in request.headers:
            return await self._send(request, f, ranged=True, extra=headers)
        self._count_sent(request, 0 if request.method == "HEAD" else len(f.body))
        return web.Response(body=f.body, content_type=f.content_type, headers=headers)

    async def _plain(self, request: web.Request) -> web.StreamResponse:
        f = self._file(request.match_info["name"])
        part = ranges.wanted_part(request, f)
        with self.streaming(request):
            return await ranges.send(
                request, f, part, {hdrs.ACCEPT_RANGES: "bytes"}, lambda n: self._count_sent(request, n)
            )

    async def _tdm(self, request: web.Request) -> web.StreamResponse:
        policy = request.query.get("policy", self.tdm_policy)
        return await self._img(request, {"tdm-reservation": "1", **({"tdm-policy": policy} if policy else {})})

    async def _drop(self, request: web.Request) -> web.StreamResponse:
        """``/drop`` and ``/norange``: cut short the first ``times`` requests for this URL."""
        after = self._int(request, "after", high=1 << 40, default=1 << 40)
        cut = self._hit_count(request, request.path_qs) <= self._int(request, "times", default=1)
        name = request.match_info["name"] if cut else request.query.get("then", request.match_info["name"])
        stall = self._int(request, "stall", high=3600, default=0)
        etag = self._int(request, "etag", high=1, default=1) == 1
        ranged = request.path.startswith("/drop/")
        return await self._send(request, self._file(name), ranged, after if cut else None, stall, etag)

    async def _send(
        self,
        request: web.Request,
        f: ServedFile,
        ranged: bool,
        cut_after: int | None = None,
        stall: int = 0,
        etag: bool = True,
        extra: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        part = ranges.wanted_part(request, f) if ranged else None
        with self.streaming(request):
            return await ranges.send(
                request,
                f,
                part,
                {**ranges.validators(f, ranged, etag), **(extra or {})},
                lambda n: self._count_sent(request, n),
                cut_after,
                (lambda: self.stopping_within(stall)) if stall else None,
            )

    async def _status(self, request: web.Request) -> web.StreamResponse:
        code = self._int(request, "code", 100, 599)
        if code < 200 or code in (204, 304):
            return web.Response(status=code)
        return web.Response(status=code, text=f"status {code}\n")

    async def _flaky(self, request: web.Request) -> web.StreamResponse:
        n = self._int(request, "n")
        if self._hit_count(request) <= n:
            return web.Response(status=500, text="flaky: try again\n")
        return self._file_response(request.match_info["name"])

    async def _ratelimit(self, request: web.Request) -> web.StreamResponse:
        seconds = self._int(request, "seconds")
        n = self._int(request, "n")
        if self._hit_count(request) <= n:
            return web.Response(status=429, text="slow down\n", headers={"Retry-After": str(seconds)})
        return self._file_response(request.match_info["name"])

    async def _delay(self, request: web.Request) -> web.StreamResponse:
        """The file after ``ms`` milliseconds: requests that overlap, then finish cleanly."""
        if await self.stopping_within(self._int(request, "ms", high=60_000) / 1000):
            raise web.HTTPServiceUnavailable()
        return self._file_response(request.match_info["name"])

    async def _hang(self, request: web.Request) -> web.StreamResponse:
        """No status line, no headers: a server that accepted the connection and went silent."""
        await self.stopping_within(24 * 3600)
        raise web.HTTPServiceUnavailable()

    async def _declared(self, request: web.Request, f: ServedFile) -> web.StreamResponse:
        """A streamed response whose headers, sent now, declare the whole file."""
        resp = web.StreamResponse()
        resp.content_type = f.content_type
        resp.content_length = len(f.body)
        await resp.prepare(request)
        return resp

    async def _slow(self, request: web.Request) -> web.StreamResponse:
        f = self._file(request.match_info["name"])
        resp = await self._declared(request, f)
        if request.method == "HEAD":
            return resp
        with self.streaming(request):
            for i in range(len(f.body)):
                try:
                    await resp.write(f.body[i : i + 1])
                except ConnectionError:
                    return resp  # the client left, which is the point of this route
                if await self.stopping_within(_DRIP_INTERVAL_S):
                    break
        resp.force_close()
        return resp

    async def _trickle(self, request: web.Request) -> web.StreamResponse:
        ms = self._int(request, "ms", high=600_000)
        f = self._file(request.match_info["name"])
        resp = await self._declared(request, f)
        if request.method == "HEAD":
            return resp
        step = -(-len(f.body) // _TRICKLE_PIECES)
        with self.streaming(request):
            for start in range(0, len(f.body), step):
                if await self.stopping_within(ms / 1000 / _TRICKLE_PIECES):
                    resp.force_close()
                    return resp
                try:
                    await resp.write(f.body[start : start + step])
                except ConnectionError:
                    return resp
        await resp.write_eof()
        return resp

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "image/jpeg"
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        chunk = JPEG_MAGIC + _ZEROS[len(JPEG_MAGIC) :]
        with self.streaming(request):
            try:
                while not self.stopping():
                    # write() waits for the socket to drain, so a slow reader paces this loop.
                    await resp.write(chunk)
                    chunk = _ZEROS
            except ConnectionError:
                return resp
        resp.force_close()
        return resp

    async def _html_as_jpeg(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_HTML_PAGE, content_type="image/jpeg")

    async def _truncated(self, request: web.Request) -> web.StreamResponse:
        f = self._file(request.match_info["name"])
        return web.Response(body=f.body[: len(f.body) // 2], content_type=f.content_type)

    async def _corrupt(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        f = self._file(name)
        head = f.body[:_CORRUPT_KEEP]
        # Seeded by the name: a retry, or the other tool of a benchmark, gets the same bytes.
        garbage = random.Random(name).randbytes(max(0, len(f.body) - len(head)))
        return web.Response(body=head + garbage, content_type=f.content_type)

    async def _empty(self, request: web.Request) -> web.StreamResponse:
        f = self._file(request.match_info["name"])
        return web.Response(body=b"", content_type=f.content_type)

    async def _short(self, request: web.Request) -> web.StreamResponse:
        f = self._file(request.match_info["name"])
        resp = await self._declared(request, f)
        if request.method == "HEAD":
            return resp
        await resp.write(f.body[: len(f.body) // 2])
        if request.transport is not None:
            request.transport.close()  # after the write is flushed: the client sees a cut body
        return resp

    async def _optout(self, request: web.Request) -> web.StreamResponse:
        return self._file_response(request.match_info["name"], {"X-Robots-Tag": "noai, noimageai"})

    async def _optout_other_bot(self, request: web.Request) -> web.StreamResponse:
        return self._file_response(request.match_info["name"], {"X-Robots-Tag": "otherbot: noai"})

    async def _redirect(self, request: web.Request) -> web.StreamResponse:
        target = request.query.get("to")
        if not target:
            raise web.HTTPBadRequest(text="missing ?to=URL\n")
        raise web.HTTPFound(target)

    async def _redirect_chain(self, request: web.Request) -> web.StreamResponse:
        n = self._int(request, "n", 0, 100)
        name = request.match_info["name"]
        if n == 0:
            return self._file_response(name)
        self._file(name)  # a chain to a missing file is a 404 at the first hop, not the last
        # An absolute Location, so even clients that do not resolve relative ones follow it.
        target = request.url.with_path(f"/redirect-chain/{n - 1}/{name}").with_query(request.query)
        raise web.HTTPFound(str(target))

    async def _robots(self, request: web.Request) -> web.StreamResponse:
        if self.robots_txt is None:
            raise web.HTTPNotFound(text="no robots.txt\n")
        if isinstance(self.robots_txt, int):
            return web.Response(status=self.robots_txt, text=f"status {self.robots_txt}\n")
        return self._site_file(request, self.robots_txt.encode(), "text/plain")

    def _site_file(self, request: web.Request, body: bytes, content_type: str) -> web.Response:
        self.site_file_encodings.append(request.headers.get("Accept-Encoding"))
        if not self.gzip_site_files:
            return web.Response(body=body, content_type=content_type)
        gz = gzip.compress(body)
        return web.Response(body=gz, content_type=content_type, headers={"Content-Encoding": "gzip"})

    async def _tdmrep(self, request: web.Request) -> web.StreamResponse:
        body = self.tdmrep_json
        if body is None:
            raise web.HTTPNotFound(text="no tdmrep.json\n")
        if isinstance(body, int):
            return web.Response(status=body, text=f"status {body}\n")
        return self._site_file(request, body.encode() if isinstance(body, str) else body, "application/json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tasks.demo.webserver", description=(ImageWeb.__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--root", required=True, help="folder of the files to serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=0, help="preferred port; a busy one falls back to an ephemeral port"
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        print(f"--root {args.root}: not a directory", file=sys.stderr)
        return 2
    server = ImageWeb(args.root, host=args.host, port=args.port)
    server.serve_forever(on_ready=lambda s: print(f"serving {s.base_url}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
