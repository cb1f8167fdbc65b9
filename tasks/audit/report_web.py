"""Links to a run's reports that open in a browser, and the read-only server behind them."""

from __future__ import annotations

import html
import mimetypes
import os
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote, urlsplit

from tasks.formats.storage import Storage

REPORT_URL_ENV = "SHARDSMITH_REPORT_URL"
EXPIRES_ENV = "SHARDSMITH_REPORT_URL_EXPIRES_S"
# The longest an S3 (SigV4) presigned URL may live: a week, so a report stays reachable from
# the UI through the following night's run.
DEFAULT_EXPIRES_S = 7 * 24 * 3600
REPORTS = "reports"  # only {dataset}/reports/... is served: not shards, ledgers or manifests
# The pages we serve are our reports and offline Data Docs: neither needs a script or
# anything from another origin.
CSP = "default-src 'self' data:; script-src 'none'; object-src 'none'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'"


@dataclass(frozen=True)
class Link:
    """Where a browser opens a file of a run's reports.

    Args:
        url: an http(s) URL, or the file's path when nothing serves it.
        browsable: whether ``url`` is an http(s) URL a browser opens by itself.
        note: for a path, how to serve it.
    """

    url: str
    browsable: bool
    note: str = ""


def report_link(storage: Storage, rel: str, base_url: str | None = None, expires_s: int | None = None) -> Link:
    """The link to ``rel`` (a file under the storage root) for people, in this order:

    1. under ``base_url`` (default: ``$SHARDSMITH_REPORT_URL``), the URL of a
       ``shardsmith report --serve`` (or any server) of this storage root;
    2. on S3, a presigned GET URL, valid ``expires_s`` seconds (default
       ``$SHARDSMITH_REPORT_URL_EXPIRES_S`` or a week), answered as HTML when it is a page;
    3. the local path, with a note on how to serve it.
    """
    base = os.environ.get(REPORT_URL_ENV, "") if base_url is None else base_url
    if base:
        return Link(base.rstrip("/") + "/" + quote(rel.lstrip("/")), True)
    if storage.root.startswith("s3://"):
        expires = int(expires_s or os.environ.get(EXPIRES_ENV) or DEFAULT_EXPIRES_S)
        return Link(_presign(storage, rel, expires), True)
    return Link(
        storage.url(rel),
        False,
        f"to open it in a browser, run `shardsmith report --serve --storage {storage.root}` and set {REPORT_URL_ENV} to the URL it prints",
    )


def _presign(storage: Storage, rel: str, expires_s: int) -> str:
    """A presigned GET URL (Signature V4: buckets made since 2020 refuse V2, which botocore
    still picks for us-east-1) that answers with the file's content type (objects are stored
    as octet-stream, which a browser would download instead of showing)."""
    import fsspec

    options = dict(storage.options)
    options["config_kwargs"] = {**(options.get("config_kwargs") or {}), "signature_version": "s3v4"}
    fs = fsspec.filesystem("s3", **options)
    return fs.url(storage.path(rel), expires=expires_s, ResponseContentType=_content_type(rel))


def _content_type(name: str) -> str:
    kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return f"{kind}; charset=utf-8" if kind.startswith("text/") or kind == "application/json" else kind


def safe_rel(url_path: str) -> str | None:
    """The storage path a request path names, or None when it must not be served: anything
    outside ``{dataset}/reports/``, ``..`` or ``.`` segments (also percent-encoded), backslashes,
    NUL and control characters, hidden names."""
    path = unquote(urlsplit(url_path).path)
    if any(ord(c) < 0x20 or c in "\\\x7f" for c in path):
        return None
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") or p.startswith(".") for p in parts):
        return None
    if len(parts) >= 2 and parts[1] != REPORTS:
        return None
    return "/".join(parts)


class _Handler(BaseHTTPRequestHandler):
    server_version = "shardsmith-reports"
    sys_version = ""
    storage: Storage  # set on the subclass made per server

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: the terminal shows the URL to open, not every request

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        rel = safe_rel(self.path)
        if rel is None:
            return self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8", body)
        st = self.storage
        if rel and "/" not in rel:  # a dataset's folder: only its reports are shown
            return self._redirect(quote(f"/{rel}/{REPORTS}/"))
        if st.is_local:
            # A link inside the reports folder must not lead outside the storage root.
            real, root = os.path.realpath(st.path(rel)), os.path.realpath(st.path(""))
            if real != root and not real.startswith(root + os.sep):
                return self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8", body)
        try:
            if rel == "" or st.fs.isdir(st.path(rel)):
                if not self.path.split("?", 1)[0].endswith("/"):
                    return self._redirect(quote("/" + rel) + "/")
                if rel and st.exists(f"{rel}/index.html"):
                    rel = f"{rel}/index.html"
                else:
                    return self._send(HTTPStatus.OK, self._listing(rel), "text/html; charset=utf-8", body)
            data = st.read_bytes(rel)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
            return self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8", body)
        self._send(HTTPStatus.OK, data, _content_type(rel), body)

    def _listing(self, rel: str) -> bytes:
        names = self.storage.listdir(rel)
        if rel == "":  # the datasets that have reports
            names = [n for n in names if self.storage.exists(f"{n}/{REPORTS}")]
            targets = [(n, f"{quote(n)}/{REPORTS}/") for n in names]
        else:
            depth = rel.count("/")
            targets = [
                (
                    n,
                    quote(n)
                    + ("/report.html" if depth == 1 and self.storage.exists(f"{rel}/{n}/report.html") else "/"),
                )
                for n in names
            ]
        items = "".join(f'<li><a href="{html.escape(href)}">{html.escape(name)}</a></li>' for name, href in targets)
        title = html.escape("/" + rel)
        return (
            f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
            f"<body><h1>{title}</h1><ul>{items or '<li>(empty)</li>'}</ul></body></html>\n"
        ).encode()

    def _redirect(self, location: str) -> None:
        self.send_response(HTTPStatus.MOVED_PERMANENTLY)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send(self, status: HTTPStatus, data: bytes, content_type: str, body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")  # a run's report changes after every phase
        self.end_headers()
        if body:
            self.wfile.write(data)


class ReportServer:
    """Serve a storage root's report folders read-only over HTTP (``shardsmith report --serve``).

    Args:
        storage: the storage root (local or S3) whose ``{dataset}/reports/`` are served.
        host: address to listen on; loopback by default, since anyone who reaches the port
            reads every report (put an authenticating proxy in front to share it).
        port: port to listen on; 0 (default) picks a free one.
    """

    def __init__(self, storage: Storage, host: str = "127.0.0.1", port: int = 0):
        handler = type("Handler", (_Handler,), {"storage": storage})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        address, port = self._server.server_address[:2]
        host = str(address)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def start(self) -> ReportServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name="report-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()


def link_markdown(link: Link, text: str) -> str:
    """A markdown link when a browser can open it, else the path as code with the note."""
    if link.browsable:
        return f"[{text}]({link.url})"
    return f"{text}: `{link.url}` ({link.note})"
