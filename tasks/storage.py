"""Storage roots (local paths or s3:// URLs) reached through fsspec, with atomic writes."""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
from typing import IO, Any, Iterator

import fsspec
from fsspec.core import url_to_fs


class Storage:
    """A storage root; every path argument is relative to it.

    Args:
        root: a local directory or ``s3://bucket/prefix`` (any fsspec URL works for reading).
        options: fsspec storage options, e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}``.

    Pickles as (root, options), so Dask ships it to workers cheaply; the filesystem object is
    made again on first use there.
    """

    def __init__(self, root: str, options: dict[str, Any] | None = None):
        self.root = root.rstrip("/") if "://" in root else os.path.abspath(root)
        self.options = dict(options or {})
        self._fs: fsspec.AbstractFileSystem | None = None
        self._base: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], state["options"])

    def __repr__(self) -> str:
        return f"Storage({self.root!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Storage) and (self.root, self.options) == (other.root, other.options)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            self._fs, self._base = url_to_fs(self.root, **self.options)
        return self._fs

    @property
    def is_local(self) -> bool:
        return "://" not in self.root or self.root.startswith("file://")

    def path(self, rel: str) -> str:
        """Filesystem path (no protocol) of ``rel`` under the root."""
        self.fs  # noqa: B018 - sets _base
        return posixpath.join(self._base, rel) if rel else self._base

    def url(self, rel: str = "") -> str:
        """Full URL (or local path) of ``rel``, for people and for other tools."""
        return posixpath.join(self.root, rel) if rel else self.root

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def open(self, rel: str, mode: str = "rb") -> IO:
        return self.fs.open(self.path(rel), mode)

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def rm(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` atomically: readers see the old object, or all of the new one."""
        with self.atomic_writer(rel) as fh:
            fh.write(data)

    @contextlib.contextmanager
    def atomic_writer(self, rel: str) -> Iterator[IO[bytes]]:
        """A binary file that appears under ``rel`` only when the block exits without error.

        Locally: a temp file beside the target, fsynced, renamed over it, and the folder
        fsynced. On object stores: a local spool file uploaded in one PUT (a multipart upload
        for very large files, which is equally invisible until it completes).
        """
        target = self.path(rel)
        if self.is_local:
            folder = os.path.dirname(target)
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix="-" + os.path.basename(target), dir=folder)
            try:
                with os.fdopen(fd, "wb") as fh:
                    yield fh
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        else:
            with tempfile.NamedTemporaryFile(prefix="shardsmith-spool-") as spool:
                yield spool
                spool.flush()
                self.fs.put_file(spool.name, target)
