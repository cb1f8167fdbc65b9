"""The demo corpus as a service: made once into a folder, then its images and manifests served over HTTP."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from tasks.demo.corpus import expected_outcomes, write_manifests
from tasks.demo.images import EXPECTED_NAME, MANIFEST_FILES, ImageInfo, ensure_images
from tasks.demo.webserver import ImageWeb

# What /manifests/ serves: the three manifests and what the pipeline should make of them.
SERVED_MANIFESTS = {*MANIFEST_FILES.values(), EXPECTED_NAME}
_MANIFEST_TYPES = {
    ".csv": "text/csv",
    ".gz": "application/gzip",
    ".parquet": "application/vnd.apache.parquet",
    ".json": "application/json",
}


class CorpusWeb(ImageWeb):
    """The demo's image web (every route of ``ImageWeb``) plus the corpus's manifests and a health route.

    Added routes (GET):

    - ``/manifests/{name}``: ``photos.csv``, ``art.jsonl.gz``, ``scans.parquet`` and
      ``EXPECTED.json`` from ``out_dir/manifests/``, as stored (a ``.gz`` is sent as
      ``application/gzip`` without ``Content-Encoding``, so clients keep the bytes compressed);
      any other name is 404.
    - ``/health``: 200 ``ok`` once the manifests are written (``ready``), 503 before.

    Args:
        out_dir: the corpus folder (``images/``, ``manifests/``).
        host: address to listen on. Default ``127.0.0.1``.
        port: port to listen on; 0 (the default) takes an ephemeral one.
    """

    def __init__(self, out_dir: str | Path, host: str = "127.0.0.1", port: int = 0):
        super().__init__(Path(out_dir) / "images", host=host, port=port)
        self.manifests = Path(out_dir) / "manifests"
        self.ready = False

    def application(self) -> web.Application:
        app = super().application()
        app.add_routes([web.get("/manifests/{name}", self._manifest), web.get("/health", self._health)])
        return app

    async def _manifest(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        # A fixed list, not a folder listing: nothing else under manifests/ is ever served.
        if name not in SERVED_MANIFESTS or not self.ready:
            raise web.HTTPNotFound(text="not found\n")
        body = (self.manifests / name).read_bytes()
        return web.Response(body=body, content_type=_MANIFEST_TYPES[Path(name).suffix])

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if not self.ready:
            return web.Response(status=503, text="preparing the corpus\n")
        return web.Response(text="ok\n")


def prepare(out_dir: str | Path, n: int, seed: int, models: tuple[str, ...]) -> list[ImageInfo]:
    """Make (or reuse) the images and the tiny models under ``out_dir``; both are kept across restarts."""
    out_dir = Path(out_dir)
    images = ensure_images(out_dir, n, seed)
    if models:
        from tasks.demo.models import make_all

        make_all(out_dir / "models", models)
    return images


def publish(server: CorpusWeb, out_dir: str | Path, images: list[ImageInfo], base_url: str | None) -> dict[str, Any]:
    """Write manifests whose URLs start with ``base_url`` (default: where ``server`` listens), then mark it ready."""
    write_manifests(Path(out_dir), images, base_url or server.base_url)
    server.ready = True
    return expected_outcomes(Path(out_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.demo.service", description=__doc__)
    parser.add_argument("--out", required=True, type=Path, help="folder of the corpus; made once, reused on restart")
    parser.add_argument("--images", type=int, default=300, help="images in the corpus (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--models",
        default="vae,clip-text",
        help="tiny encoders for the precache phase, comma-separated; empty for none",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=0, help="port to listen on; a busy or forbidden nonzero port is an error"
    )
    parser.add_argument(
        "--base-url",
        help="how the pipeline reaches this server, e.g. http://demo-corpus (default: the address it listens on)",
    )
    args = parser.parse_args(argv)

    models = tuple(m for m in args.models.split(",") if m)
    images = prepare(args.out, args.images, args.seed, models)
    server = CorpusWeb(args.out, host=args.host, port=args.port)

    def on_ready(s: ImageWeb) -> None:
        # ImageWeb falls back to an ephemeral port when the one asked for is taken; manifests
        # that name port 80 would then point nowhere, so stop instead.
        if args.port and s.port != args.port:
            print(
                f"cannot listen on port {args.port} (busy, or below 1024 without the privilege); listening on {s.port} would break the manifests' URLs",
                file=sys.stderr,
                flush=True,
            )
            s.request_stop()
            return
        expected = publish(server, args.out, images, args.base_url)
        print(
            f"serving {s.base_url}: {expected['images']} images, {expected['rows']} manifest rows at {expected['base_url']}/manifests/",
            flush=True,
        )

    server.serve_forever(on_ready=on_ready)
    return 0 if server.ready else 1


if __name__ == "__main__":
    sys.exit(main())
