"""Files served by the demo's web: one name under a root, read once into an LRU of bodies, typed by extension."""

from __future__ import annotations

import collections
import email.utils
import functools
import mimetypes
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

# Explicit so the answer does not depend on the host's mime.types file.
CONTENT_TYPES = {
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".png": "image/png",
    ".webp": "image/webp",
    ".gif": "image/gif",
    ".bmp": "image/bmp",
    ".tif": "image/tiff",
    ".tiff": "image/tiff",
    ".avif": "image/avif",
    ".heic": "image/heic",
    ".txt": "text/plain",
    ".html": "text/html",
    ".json": "application/json",
}


def content_type_for(name: str) -> str:
    """Content-Type for a file name, from its extension."""
    ext = os.path.splitext(name)[1].lower()
    return CONTENT_TYPES.get(ext) or mimetypes.guess_type(name)[0] or "application/octet-stream"


@dataclass(frozen=True)
class ServedFile:
    """A file's body as served, with the mtime it was read at and its Content-Type."""

    mtime_ns: int
    body: bytes
    content_type: str

    @functools.cached_property
    def etag(self) -> str:
        """A strong ETag of this version (mtime and size, as aiohttp's FileResponse and nginx make it)."""
        return f'"{self.mtime_ns:x}-{len(self.body):x}"'

    @functools.cached_property
    def last_modified(self) -> str:
        """The mtime as an HTTP date."""
        return email.utils.formatdate(self.mtime_ns / 1e9, usegmt=True)


class FileCache:
    """Files directly under ``root`` by name, kept in memory up to ``cache_bytes``.

    A file is re-read when its mtime or size changes; files over a quarter of the cache are
    served but not kept. Lookups raise aiohttp's 403 or 404, ready to be the response.

    Args:
        root: folder of the files; None has no files (every lookup is a 404).
        cache_bytes: memory for cached file bodies.
    """

    def __init__(self, root: Path | None, cache_bytes: int):
        self.root = root
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict[str, ServedFile] = collections.OrderedDict()
        self._cached_bytes = 0

    def get(self, name: str) -> ServedFile:
        """The file ``name``; a name that is not one plain segment is refused with 403."""
        if self.root is None:
            raise web.HTTPNotFound(text="no root\n")
        # One segment only: aiohttp has already decoded %2F into "/" here, so this is the
        # traversal guard; leading dots also keep hidden files (stamps, temp files) private.
        if not name or name.startswith(".") or "/" in name or "\\" in name or "\x00" in name:
            raise web.HTTPForbidden(text="forbidden\n")
        path = os.path.join(self.root, name)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise web.HTTPNotFound(text="not found\n") from None
        if not stat.S_ISREG(st.st_mode):
            raise web.HTTPNotFound(text="not found\n")
        cached = self._cache.get(path)
        if cached is not None and cached.mtime_ns == st.st_mtime_ns and len(cached.body) == st.st_size:
            self._cache.move_to_end(path)
            return cached
        # A blocking read on the loop: pool files are small and already in the page cache,
        # and an executor hop would cost more than the read.
        with open(path, "rb") as fh:
            body = fh.read()
        entry = ServedFile(st.st_mtime_ns, body, content_type_for(name))
        if cached is not None:
            del self._cache[path]
            self._cached_bytes -= len(cached.body)
        if len(body) <= self.cache_bytes // 4:
            self._cache[path] = entry
            self._cached_bytes += len(body)
            while self._cached_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= len(old.body)
        return entry
