"""Storage roots (local paths or s3:// URLs) reached through fsspec, with atomic writes."""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import posixpath
import signal
import tempfile
from dataclasses import dataclass
from typing import IO, Any, Iterator

import fsspec
from fsspec.core import url_to_fs


# Fault injection for the resilience tests; off (one dictionary lookup) unless this is set.
FAULT_ENV = "SHARDSMITH_FAULT"
_FAULT_ACTIONS = ("killgroup", "sigkill", "exit", "enospc")
_FAULT_POINTS = ("before", "write", "commit")


@dataclass(frozen=True)
class Fault:
    """One fault that the atomic writer injects where its point is reached for a matching path.

    Args:
        action: ``killgroup`` (SIGKILL to the whole process group: the flow, its workers, as
            when the machine dies), ``sigkill`` (this process only, as the OOM killer does),
            ``exit`` (``os._exit(1)``) or ``enospc`` (the write raises ``OSError(ENOSPC)``).
        point: ``before`` the file is opened, during its first ``write``, or after its
            ``commit`` (renamed or uploaded, before anything else happens).
        pattern: an fnmatch glob over the path relative to the storage root.
        marker: a file path; when set, the fault fires only where it can create that file
            exclusively, so once across every process of the run. Default: every time.

    ``SHARDSMITH_FAULT`` holds one or more ``ACTION:POINT:GLOB[:MARKER]``, separated by ``;``.
    """

    action: str
    point: str
    pattern: str
    marker: str | None = None

    def fire(self) -> None:
        if self.marker:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
        if self.action == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device (injected by SHARDSMITH_FAULT)")
        if self.action == "exit":
            os._exit(1)
        if self.action == "killgroup":
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def faults_for(rel: str) -> list[Fault]:
    """The faults ``SHARDSMITH_FAULT`` asks for at ``rel``; empty (and cheap) when it is unset."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return []
    out = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        parts = item.split(":", 3)
        if len(parts) < 3 or parts[0] not in _FAULT_ACTIONS or parts[1] not in _FAULT_POINTS:
            raise ValueError(f"{FAULT_ENV}: {item!r} is not ACTION:POINT:GLOB[:MARKER] with ACTION in {_FAULT_ACTIONS}, POINT in {_FAULT_POINTS}")
        fault = Fault(*parts)
        if fnmatch.fnmatchcase(rel, fault.pattern):
            out.append(fault)
    return out


def _inject(faults: list[Fault], point: str) -> None:
    for fault in faults:
        if fault.point == point:
            fault.fire()


def fault_point(rel: str, point: str) -> None:
    """Fire the faults asked for at ``rel`` and ``point``, for writers that bypass ``atomic_writer``."""
    _inject(faults_for(rel), point)


class _FaultyFile:
    """A file object whose first write fires the ``write`` faults; everything else passes through."""

    def __init__(self, fh: IO[bytes], faults: list[Fault]):
        self._fh = fh
        self._faults = faults

    def write(self, data: Any) -> int:
        if self._faults:
            n = self._fh.write(bytes(data)[: len(data) // 2])  # a torn write: half is on disk
            faults, self._faults = self._faults, []
            _inject(faults, "write")
            return n + self._fh.write(bytes(data)[n:])
        return self._fh.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


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

    def write_bytes(self, rel: str, data: bytes, fsync: bool = True) -> None:
        """Write ``data`` atomically: readers see the old object, or all of the new one.

        ``fsync=False`` leaves durability to one ``sync()`` after a batch of writes (thousands
        of small index files), which must come before whatever commits them.
        """
        with self.atomic_writer(rel, fsync=fsync) as fh:
            fh.write(data)

    def sync(self) -> None:
        """Make every write so far durable: one ``sync()`` for writes made with ``fsync=False``
        (object stores are durable when a PUT returns)."""
        if self.is_local:
            os.sync()

    @contextlib.contextmanager
    def atomic_writer(self, rel: str, fsync: bool = True) -> Iterator[IO[bytes]]:
        """A binary file that appears under ``rel`` only when the block exits without error.

        Locally: a temp file beside the target, fsynced, renamed over it, and the folder
        fsynced. On object stores: a local spool file uploaded in one PUT (a multipart upload
        for very large files, which is equally invisible until it completes).
        """
        target = self.path(rel)
        faults = faults_for(rel)
        _inject(faults, "before")
        if self.is_local:
            folder = os.path.dirname(target)
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix="-" + os.path.basename(target), dir=folder)
            try:
                with os.fdopen(fd, "wb") as fh:
                    yield _FaultyFile(fh, faults) if faults else fh
                    fh.flush()
                    if fsync:
                        os.fsync(fh.fileno())
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            if fsync:
                dfd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        else:
            with tempfile.NamedTemporaryFile(prefix="shardsmith-spool-") as spool:
                yield _FaultyFile(spool, faults) if faults else spool
                spool.flush()
                self.fs.put_file(spool.name, target)
        _inject(faults, "commit")
