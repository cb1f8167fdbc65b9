"""A large member's bytes in an unlinked local file: written into shards and read by decoders without ever being held whole in memory."""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import weakref
from typing import BinaryIO

CHUNK = 1 << 20


class _PositionalReader(io.RawIOBase):
    """A seekable reader of a shared descriptor with a position of its own (``os.pread``), so
    several readers (the raw shard's writer, the decoder's passes) never disturb each other."""

    def __init__(self, body: SpooledBody):
        self._body, self._pos = body, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        data = os.pread(self._body.fileno(), min(view.nbytes, max(0, self._body.size - self._pos)), self._pos)
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._body.size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


class SpooledBody:
    """Bytes of one member (a video body) kept in a local file that no name points to.

    The file is unlinked as soon as it is opened, so nothing is left on disk whatever happens
    to the run: its space goes back when the last reference to the body does (or at ``close``).
    ``len()`` is its size; ``reader()`` gives an independent seekable reader.

    Args:
        fd: an open descriptor of the file (the body takes it over).
        size: the file's bytes.
    """

    def __init__(self, fd: int, size: int):
        self._fd, self.size = fd, size
        self._closer = weakref.finalize(self, os.close, fd)

    @classmethod
    def adopt(cls, path: str | os.PathLike[str]) -> SpooledBody:
        """Take over the file at ``path``: opened, then its name removed."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.unlink(path)
            return cls(fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def copy_from(cls, src: BinaryIO, size: int, folder: str | None = None) -> SpooledBody:
        """``size`` bytes of ``src`` copied to a new spooled file (fewer when ``src`` ends
        first: ``len()`` says what arrived)."""
        fd, path = tempfile.mkstemp(prefix="shardsmith-body-", dir=folder)
        os.unlink(path)
        body = cls(fd, 0)
        with os.fdopen(os.dup(fd), "wb") as out:
            left = size
            while left:
                chunk = src.read(min(left, CHUNK))
                if not chunk:
                    break
                out.write(chunk)
                left -= len(chunk)
        body.size = size - left
        return body

    def __len__(self) -> int:
        return self.size

    def fileno(self) -> int:
        if not self._closer.alive:
            raise ValueError("the spooled body is closed")
        return self._fd

    def reader(self) -> io.BufferedReader:
        """A new buffered reader from the first byte."""
        return io.BufferedReader(_PositionalReader(self), buffer_size=CHUNK)

    def head(self, n: int) -> bytes:
        return os.pread(self.fileno(), min(n, self.size), 0)

    def sha256(self) -> str:
        with self.reader() as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()

    def contains(self, needle: bytes) -> bool:
        """Whether ``needle`` occurs anywhere in the bytes (read in chunks that overlap by its length)."""
        tail = b""
        with self.reader() as fh:
            while chunk := fh.read(CHUNK):
                if needle in tail + chunk:
                    return True
                tail = chunk[-len(needle) + 1 :] if len(needle) > 1 else b""
        return False

    def read_all(self) -> bytes:
        """The whole body in memory (small bodies and tests)."""
        return os.pread(self.fileno(), self.size, 0)

    def close(self) -> None:
        self._closer()


Payload = bytes | SpooledBody


def media_source(data: Payload) -> BinaryIO:
    """A seekable reader of a payload, for decoders that take file objects (PyAV)."""
    return data.reader() if isinstance(data, SpooledBody) else io.BytesIO(data)
