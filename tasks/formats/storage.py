"""Storage roots (local paths or s3:// URLs) reached through fsspec, with atomic writes."""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import tempfile
import uuid
from collections.abc import Iterator
from typing import IO, Any, cast

import fsspec
from fsspec.core import url_to_fs

from tasks.formats.faults import FaultyFile, faults_for, inject

# Release files are for other people: readable by anyone who can read the folder, unless the
# recipe asks for less (storage_options.file_mode). The process umask is not applied, since a
# umask of 077 on a shared machine would otherwise make every release private to its builder.
DEFAULT_FILE_MODE = 0o644
FILE_MODE_OPTION = "file_mode"
# What an object store gets unless storage_options say otherwise. Listings are never cached:
# workers in other processes write ledgers while the flow reads them, and a listing s3fs cached
# before them makes them read as missing. A store that stops answering fails in bounded time
# (botocore's defaults wait a minute per read, then retry up to four times over, silently).
REMOTE_DEFAULTS: dict[str, Any] = {"use_listings_cache": False}
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 60,
    "retries": {"max_attempts": 4, "mode": "standard"},
}


def file_modes(value: Any) -> tuple[int, int]:
    """(file mode, folder mode) for a ``file_mode`` setting: an int (YAML reads ``0640`` as
    octal) or an octal string (``"0640"``, ``"640"``, ``"0o640"``); None means 0644.

    Files may be at most 0644 and must stay readable and writable by their owner (releases are
    never rewritten in place, so group or world write would only let others alter them).
    Folders get the file mode plus search (x) wherever it grants read: 0644 -> 0755,
    0640 -> 0750, 0600 -> 0700.
    """
    if value is None:
        mode = DEFAULT_FILE_MODE
    elif isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f'{FILE_MODE_OPTION}: expected an octal mode such as "0640", got {value!r}')
    elif isinstance(value, int):
        mode = value
    else:
        text = value.strip().lower().removeprefix("0o")
        if not text or not all(c in "01234567" for c in text):
            raise ValueError(f'{FILE_MODE_OPTION}: {value!r} is not an octal mode such as "0640"')
        mode = int(text, 8)
    if mode & ~DEFAULT_FILE_MODE or mode & 0o600 != 0o600:
        raise ValueError(
            f"{FILE_MODE_OPTION}: {value!r} is not a mode between 0600 and 0644 (owner read-write; "
            'group and others at most read; no execute bits); quote it as "0640" in JSON'
        )
    return mode, mode | ((mode & 0o444) >> 2)


def _fsync_folder(folder: str) -> None:
    """Make a rename or link in ``folder`` durable."""
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _write_temp(path: str, data: bytes, mode: int) -> str:
    """A complete, fsynced file beside ``path`` under a name no other writer uses; returns it."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


# S3 answers a conditional PUT that lost to another writer with 412 PreconditionFailed, or 409
# ConditionalRequestConflict while the other write is still in flight.
_LOST_RACE_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})


def lost_race(err: BaseException) -> bool:
    """Whether ``err`` from a conditional S3 request means another writer got there first."""
    if isinstance(err, FileExistsError):
        return True
    response = getattr(err.__cause__, "response", None) or getattr(err, "response", None) or {}
    return response.get("Error", {}).get("Code") in _LOST_RACE_CODES


class Storage:
    """A storage root; every path argument is relative to it.

    Args:
        root: a local directory or ``s3://bucket/prefix`` (any fsspec URL works for reading).
        options: fsspec storage options, e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}``,
            plus shardsmith's own ``file_mode`` (default ``0644``; see ``file_modes``): the
            mode of every local file written or placed, folders getting the matching ``0755``
            and so on. It is taken out before the options reach fsspec; object stores ignore
            it (their access is the bucket's policy).

    Pickles as (root, options), so Dask ships it to workers cheaply; the filesystem object is
    made again on first use there.
    """

    def __init__(self, root: str, options: dict[str, Any] | None = None):
        self.root = root.rstrip("/") if "://" in root else os.path.abspath(root)
        self.options = dict(options or {})
        self.file_mode, self.dir_mode = file_modes(self.options.get(FILE_MODE_OPTION))
        self._fs: fsspec.AbstractFileSystem | None = None
        self._base = ""  # set with _fs, on first use

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["root"], state["options"])

    def __repr__(self) -> str:
        return f"Storage({self.root!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Storage) and (self.root, self.options) == (other.root, other.options)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            fs_options = {k: v for k, v in self.options.items() if k != FILE_MODE_OPTION}
            if not self.is_local:
                fs_options = {**REMOTE_DEFAULTS, **fs_options}
            if self.root.startswith(("s3://", "s3a://")):
                fs_options["config_kwargs"] = {**S3_CONFIG_DEFAULTS, **(fs_options.get("config_kwargs") or {})}
            self._fs, self._base = url_to_fs(self.root, **fs_options)
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

    def make_folder(self, rel: str) -> str:
        """Create the local folder ``rel`` and any missing parents with the folder mode
        (the umask not applied); returns its path. Object stores have no folders."""
        path = self.path(rel)
        if self.is_local:
            self._make_local_folder(path)
        return path

    def _make_local_folder(self, path: str) -> None:
        if os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        if parent != path:
            self._make_local_folder(parent)
        try:
            os.mkdir(path)
        except FileExistsError:
            return  # made by another writer meanwhile, which sets its mode
        os.chmod(path, self.dir_mode)

    def set_mode(self, rel: str) -> None:
        """Give the local file ``rel`` the file mode (for files made by link or copy); a file
        that has it already is left alone, so one owned by another account passes."""
        if self.is_local:
            path = self.path(rel)
            if os.stat(path).st_mode & 0o7777 != self.file_mode:
                os.chmod(path, self.file_mode)

    def create_exclusive(self, rel: str, data: bytes) -> str | None:
        """Create ``rel`` holding ``data`` only if nothing is there; ``FileExistsError`` if
        something is, even when another writer creates it at the same moment.

        Locally: ``link()`` of a complete, fsynced temp file, which fails if the name exists.
        On S3: one PUT with ``If-None-Match: *``, which the store refuses (412, or 409 while a
        concurrent conditional write is in flight) if the key exists. Returns the new object's
        ETag on object stores, None locally.
        """
        target = self.path(rel)
        if not self.is_local:
            bucket, _, key = target.partition("/")
            try:
                resp = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            except OSError as err:
                if lost_race(err):
                    raise FileExistsError(errno.EEXIST, f"{self.url(rel)} exists", self.url(rel)) from err
                raise
            self.fs.invalidate_cache(target)
            return resp.get("ETag")
        folder = os.path.dirname(target)
        self._make_local_folder(folder)
        tmp = _write_temp(target, data, self.file_mode)
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, f"{self.url(rel)} exists", self.url(rel)) from None
        finally:
            os.unlink(tmp)
        _fsync_folder(folder)
        return None

    def replace_local(self, rel: str, data: bytes) -> None:
        """Replace the local file ``rel`` with ``data`` by rename (for the lock's heartbeat)."""
        target = self.path(rel)
        os.replace(_write_temp(target, data, self.file_mode), target)

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
        staged = self.stage(rel)
        try:
            yield staged.file
        except BaseException:
            staged.discard()
            raise
        staged.commit(fsync)

    def stage(self, rel: str) -> StagedFile:
        """A file for ``rel`` written now and committed later (``StagedFile.commit``), so that a
        writer can go on with its next file while the disk writes this one back."""
        return StagedFile(self, rel)


class StagedFile:
    """A file that appears under its name only at ``commit()``; ``discard()`` drops it.

    Locally a temp file beside the target (mode set, folders made); on object stores a local
    spool file. ``file`` is open for writing until ``commit`` or ``discard``.
    """

    def __init__(self, storage: Storage, rel: str) -> None:
        self._target = storage.path(rel)
        self._storage = storage
        self._faults = faults_for(rel)
        inject(self._faults, "before")
        self._tmp: str | None = None  # the local temp file; None on object stores
        fh: IO[bytes]
        if storage.is_local:
            folder = os.path.dirname(self._target)
            storage._make_local_folder(folder)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix="-" + os.path.basename(self._target), dir=folder)
            try:
                os.fchmod(fd, storage.file_mode)  # mkstemp makes 0600
                fh = os.fdopen(fd, "wb")
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            self._tmp = tmp
        else:
            fh = cast("IO[bytes]", tempfile.NamedTemporaryFile(prefix="shardsmith-spool-"))
        self._fh = fh
        self.file: IO[bytes] = cast("IO[bytes]", FaultyFile(fh, self._faults)) if self._faults else fh

    def commit(self, fsync: bool = True) -> None:
        """Make the file appear under its name: locally fsynced (unless ``fsync=False``),
        renamed over the target and the folder fsynced; on object stores uploaded."""
        try:
            self._fh.flush()
            if self._tmp is not None:
                if fsync:
                    os.fsync(self._fh.fileno())
                self._fh.close()
                os.replace(self._tmp, self._target)
            else:
                self._storage.fs.put_file(self._fh.name, self._target)
                self._fh.close()
        except BaseException:
            self.discard()
            raise
        if self._tmp is not None and fsync:
            _fsync_folder(os.path.dirname(self._target))
        inject(self._faults, "commit")

    def discard(self) -> None:
        """Drop the file; nothing appears under its name."""
        with contextlib.suppress(OSError):  # closing flushes, which a full disk fails again
            self._fh.close()
        if self._tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
