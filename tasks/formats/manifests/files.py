"""One manifest file: its record, the error that stops a source, and its bytes opened hashed as stored."""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
from fsspec.core import url_to_fs

# Errors that mean the bytes are not a readable gzip stream (BadGzipFile is an OSError, so
# it is named before the OSErrors that mean a transient read failure and are left to retries).
GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)
# Open and list errors that retrying will not fix, with the errno whose words name them.
_PERMANENT_OPEN_ERRORS = {
    FileNotFoundError: errno.ENOENT,
    IsADirectoryError: errno.EISDIR,
    NotADirectoryError: errno.ENOTDIR,
    PermissionError: errno.EACCES,
}
PERMANENT_OPEN_ERRORS = tuple(_PERMANENT_OPEN_ERRORS)
_COPY_BYTES = 1 << 20


class ManifestError(ValueError):
    """A manifest that cannot be read at all (a bad row is counted, never raised).

    Args:
        manifest: the manifest file (or source) as configured, without query string or credentials.
        what: what is wrong, for people.
        line: 1-based line (parquet: row) where it went wrong, when known.

    The message is ``"{manifest}:{line}: {what}"``, or ``"{manifest}: {what}"`` without a line.
    """

    def __init__(self, manifest: str, what: str, line: int | None = None):
        self.manifest = manifest
        self.what = what
        self.line = line
        where = f"{manifest}:{line}" if line is not None else manifest
        super().__init__(f"{where}: {what}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Dask and Prefect pickle exceptions; the default would call __init__ with the message only.
        return (type(self), (self.manifest, self.what, self.line))


@dataclass(frozen=True)
class ManifestFile:
    """One manifest file of a source, as ``list_manifest_files`` finds it.

    Args:
        url: the file as fsspec opens it (local path, ``http(s)://``, ``s3://``), as configured.
        display: the file for messages and row origins: no query string, no credentials.
        rel: its path relative to the source's root folder (posix); the file name for a
            single-file source.
        tag: for a folder or pattern source, 8 hex digits of the sha256 of ``rel``: it keys
            the file's rows and chunks, so adding or removing other files moves nothing;
            empty for a single-file source.
        fmt: ``csv``, ``tsv``, ``jsonl`` or ``parquet``.
        gzipped: the bytes are gzip-compressed (``.gz``).
        size: bytes as listed, -1 when not listed (single files are not).
    """

    url: str
    display: str
    rel: str
    tag: str
    fmt: str
    gzipped: bool
    size: int = -1

    @property
    def multi(self) -> bool:
        """Part of a folder or pattern source (rows keyed by file tag and row in the file)."""
        return bool(self.tag)


def display(manifest: str) -> str:
    """A manifest for messages: no query string or credentials (presigned URLs carry secrets).
    Only a web URL has a query: in an object store's (``s3://bucket/a?b#c.tar``) ``?`` and
    ``#`` are the key's own characters, kept, or two keys would read as one."""
    if "://" not in manifest:
        return manifest
    try:
        parts = urlsplit(manifest)
        netloc = parts.netloc.rpartition("@")[2]
        if parts.scheme.lower() not in ("http", "https"):
            return f"{parts.scheme}://{netloc}{manifest.split('://', 1)[1][len(parts.netloc) :]}"
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:
        return manifest.split("?", 1)[0]


def file_tag(rel: str) -> str:
    """The 8-hex key of a file of a multi-file source: sha256 of its path under the source root."""
    return hashlib.sha256(rel.encode("utf-8")).hexdigest()[:8]


def scheme_of(manifest: str) -> str:
    """A manifest's URL scheme in lower case; ``""`` for a plain path."""
    return manifest.split("://", 1)[0].lower() if "://" in manifest else ""


def cannot(where: str, verb: str, err: BaseException) -> ManifestError:
    """The ManifestError for a permanent open or list error (one of ``PERMANENT_OPEN_ERRORS``).

    Named by the class, not the message: fsspec puts the full URL (query string and all) in
    the strerror of remote errors.
    """
    code = next(code for cls, code in _PERMANENT_OPEN_ERRORS.items() if isinstance(err, cls))
    return ManifestError(where, f"cannot {verb}: {os.strerror(code)}")


def open_options(manifest: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    scheme = scheme_of(manifest)
    if scheme in ("", "file", "local"):
        return {}
    if scheme in ("http", "https"):
        # block_size=0: one streaming GET instead of range requests, which not every server
        # supports and which a single sequential pass does not need.
        return {"block_size": 0}
    return dict(storage_options or {})


class HashingReader(io.RawIOBase):
    """Passes reads through, hashing and counting the bytes as stored (before decompression)."""

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self.digest = hashlib.sha256()
        self.bytes = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read() if size is None or size < 0 else self._raw.read(size)
        self.digest.update(data)
        self.bytes += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        """Read to the end, so the hash covers the whole file whatever the parser left unread."""
        while self.read(_COPY_BYTES):
            pass


@contextlib.contextmanager
def open_hashed(file: ManifestFile, storage_options: dict[str, Any] | None) -> Iterator[HashingReader]:
    """The file's bytes as stored, hashed as they are read; ManifestError when it cannot be opened.

    ``storage_options`` are fsspec options for object stores; local paths and http(s) URLs
    ignore them, since they are usually the storage root's S3 options and would break the
    HTTP client. Connection trouble and 5xx are raised as they are: transient, left to retries.
    """
    where = file.display
    try:
        # Compression is layered over the hashing wrapper by the readers rather than by
        # fsspec, so the hash is of the bytes as stored.
        raw = fsspec.open(file.url, "rb", **open_options(file.url, storage_options)).open()
    except PERMANENT_OPEN_ERRORS as err:
        raise cannot(where, "open", err) from None
    except (ValueError, ImportError) as err:  # unknown protocol, or its package is missing
        raise ManifestError(where, f"cannot open: {err}") from None
    except Exception as err:
        status = getattr(err, "status", None)
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
            raise ManifestError(where, f"cannot open: HTTP {status}") from None
        raise
    try:
        yield HashingReader(raw)
    finally:
        raw.close()


def local_path(file: ManifestFile) -> str | None:
    """The file's local path when it is on this machine's disk (parquet is then read in place)."""
    scheme = scheme_of(file.url)
    if scheme == "":
        return file.url
    if scheme in ("file", "local"):
        return url_to_fs(file.url)[1]
    return None
