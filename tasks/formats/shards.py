"""WebDataset tar shards: a deterministic writer that records member offsets, and the samples of an untrusted shard."""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from tasks.formats.spooled import CHUNK, Payload, SpooledBody
from tasks.formats.tar_format import (
    BLOCK,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_MEMBER_BYTES,
    DEFAULT_MAX_MEMBERS,
    END_OF_ARCHIVE,
    EXT_RE,
    FIXED_MTIME,
    KEY_RE,
    ZERO_BLOCK,
    padded,
)
from tasks.formats.tar_reader import ShardError, iter_tar_members

# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberRecord:
    """Where one member's data lies in a shard.

    Args:
        name: the member name, ``f"{key}.{ext}"``.
        offset: byte offset of the member's data (not its header) from the start of the shard.
        size: data bytes, without padding.
    """

    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class SampleRecord:
    """Where one sample lies in a shard, as the byte range a reshard can copy verbatim.

    Args:
        key: the sample key.
        offset: byte offset of the first header byte of the sample's first member.
        length: bytes from ``offset`` to the end of the last member's padding.
        members: one record per member, in the order written.
    """

    key: str
    offset: int
    length: int
    members: tuple[MemberRecord, ...]

    def members_as_dicts(self) -> list[dict[str, Any]]:
        """The members as ``{"name", "offset", "size"}`` dicts (the ledger's ``members`` column)."""
        return [{"name": m.name, "offset": m.offset, "size": m.size} for m in self.members]


class HashingWriter:
    """Passes a shard's bytes through to a file and hashes them as they go (sha256 for the index).

    Inline rather than on a helper thread: on two cores a thread cost more CPU (GIL handoffs)
    than it saved in wall time, and the flow keeps every core busy with other outputs anyway.
    """

    def __init__(self, fileobj: BinaryIO) -> None:
        self._fileobj = fileobj
        self.sha = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int | None:
        n = self._fileobj.write(data)
        if n:
            self.sha.update(data if n == len(data) else memoryview(data)[:n])
        return n

    def flush(self) -> None:
        self._fileobj.flush()


def _tarfile_header(name: str, size: int) -> bytes:
    """A member's ustar header as :mod:`tarfile` writes it (the reference for :func:`_member_header`)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.uid = 0
    info.gid = 0
    info.uname = ""
    info.gname = ""
    info.mtime = FIXED_MTIME
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


# Every header field but name, size and checksum is the same in every member: the bytes
# tarfile writes for them, taken once. The checksum is the byte sum with its own field blank,
# so theirs is summed once too.
_TEMPLATE = _tarfile_header("x", 0)
_MODE_TO_GID, _MTIME, _TYPE_ON = _TEMPLATE[100:124], _TEMPLATE[136:148], _TEMPLATE[156:]
_FIXED_SUM = sum(_MODE_TO_GID) + sum(_MTIME) + 8 * ord(" ") + sum(_TYPE_ON)
_USTAR_MAX_SIZE = 8**11 - 1  # 11 octal digits


def _member_header(name: str, size: int) -> bytes:
    """The same bytes as :func:`_tarfile_header`, about 15 times faster (a shard writes one per member)."""
    raw = name.encode("utf-8")
    if len(raw) > 100 or not 0 <= size <= _USTAR_MAX_SIZE:
        return _tarfile_header(name, size)  # raises as tarfile does
    size_field = b"%011o\0" % size
    checksum = b"%06o\0 " % (_FIXED_SUM + sum(raw) + sum(size_field))
    return b"".join((raw.ljust(100, b"\0"), _MODE_TO_GID, size_field, _MTIME, checksum, _TYPE_ON))


class ShardWriter:
    """Writes a WebDataset tar to a binary stream and records every member's offset and size.

    Output depends only on the samples and their order: members are sorted by extension and
    every header carries mode 0o644, uid/gid 0, empty owner names and ``FIXED_MTIME``. The
    stream is only written to (never seeked or told), so pipes and single-PUT uploads work;
    offsets count from the first byte this writer writes.

    Args:
        fileobj: a binary file object opened for writing. The writer neither flushes to disk
            nor closes it: the caller owns the temp-file, fsync and rename steps.

    Used as a context manager, the end-of-archive blocks are written only on a clean exit, so
    a shard abandoned by an exception is not a valid tar.
    """

    def __init__(self, fileobj: BinaryIO) -> None:
        self._fileobj = fileobj
        self._pos = 0
        self._records: list[SampleRecord] = []
        self._keys: set[str] = set()
        self._closed = False
        # Set when a write to the stream failed part-way: positions no longer match the bytes.
        self._broken = False

    @property
    def records(self) -> list[SampleRecord]:
        """The samples written so far, in order."""
        return list(self._records)

    @property
    def bytes_written(self) -> int:
        """Bytes written to the stream so far, including the end-of-archive blocks once closed."""
        return self._pos

    @property
    def closed(self) -> bool:
        return self._closed

    def write_sample(self, key: str, members: dict[str, Payload]) -> SampleRecord:
        """Write one sample as members ``f"{key}.{ext}"`` in sorted order of ``ext``.

        A member may be a :class:`SpooledBody` (a video body in a local file): it is copied in
        chunks, never held whole.

        Raises ``ValueError`` for an invalid or repeated key, an invalid extension, a member
        name longer than 100 bytes or an empty sample, before writing anything.
        """
        if self._closed:
            raise ValueError(f"ShardWriter is closed; cannot write sample {key!r}")
        if self._broken:
            raise ValueError(f"ShardWriter failed an earlier write; cannot write sample {key!r}")
        if not isinstance(key, str) or not KEY_RE.fullmatch(key):
            raise ValueError(
                f"invalid sample key {key!r}: use ASCII letters, digits, '_' and '-' only "
                "(no '.' or '/': webdataset splits the key at the first dot of the basename)"
            )
        if key in self._keys:
            raise ValueError(f"sample key {key!r} was already written to this shard")
        if not members:
            raise ValueError(f"sample {key!r} has no members")
        planned: list[tuple[str, memoryview | SpooledBody]] = []
        for ext in sorted(members):
            if not isinstance(ext, str) or not EXT_RE.fullmatch(ext):
                raise ValueError(
                    f"invalid extension {ext!r} in sample {key!r}: use [a-z0-9_] with single "
                    "inner dots (e.g. 'jpg', 'latent.npy')"
                )
            data = members[ext]
            if not isinstance(data, (bytes, bytearray, memoryview, SpooledBody)):
                raise TypeError(f"member {ext!r} of sample {key!r} is {type(data).__name__}, not bytes")
            name = f"{key}.{ext}"
            # ustar keeps names in a 100-byte field; our names have no '/' to split into prefix.
            if len(name.encode("utf-8")) > 100:
                raise ValueError(f"member name {name!r} of sample {key!r} is longer than 100 bytes")
            planned.append((name, data if isinstance(data, SpooledBody) else memoryview(data).cast("B")))

        start = self._pos
        records = []
        for name, view in planned:
            size = len(view) if isinstance(view, SpooledBody) else view.nbytes
            header = _member_header(name, size)
            self._write(header)
            records.append(MemberRecord(name=name, offset=self._pos, size=size))
            if isinstance(view, SpooledBody):
                self._write_file(view, name)
            else:
                self._write(view)
            pad = padded(size) - size
            if pad:
                self._write(ZERO_BLOCK[:pad])
        record = SampleRecord(key=key, offset=start, length=self._pos - start, members=tuple(records))
        self._keys.add(key)
        self._records.append(record)
        return record

    def copy_sample(self, key: str, raw: bytes | memoryview, members: Iterable[tuple[str, int, int]]) -> SampleRecord:
        """Append a sample's bytes (headers, data, padding) copied from another shard.

        ``raw`` is the byte range a ``SampleRecord`` describes and ``members`` its members as
        (name, data offset relative to the start of ``raw``, size). Nothing is parsed again:
        this is what makes resharding run near copy speed. The key must be unchanged, since
        member names live inside the copied headers.
        """
        if self._closed or self._broken:
            raise ValueError(f"ShardWriter cannot write sample {key!r}: closed or broken")
        if key in self._keys:
            raise ValueError(f"sample key {key!r} was already written to this shard")
        view = memoryview(raw).cast("B")
        if view.nbytes == 0 or view.nbytes % BLOCK:
            raise ValueError(f"raw bytes of sample {key!r} are not whole tar blocks ({view.nbytes} bytes)")
        start = self._pos
        records = []
        for name, rel, size in members:
            if not name.startswith(key + ".") or rel < BLOCK or rel + size > view.nbytes:
                raise ValueError(f"member {name!r} of sample {key!r} does not lie inside its raw bytes")
            records.append(MemberRecord(name=name, offset=start + rel, size=size))
        self._write(view)
        record = SampleRecord(key=key, offset=start, length=view.nbytes, members=tuple(records))
        self._keys.add(key)
        self._records.append(record)
        return record

    def close(self) -> None:
        """Write the two zero blocks that end a tar. Idempotent; the stream stays open."""
        if self._closed:
            return
        if self._broken:
            raise ValueError("ShardWriter failed an earlier write; refusing to end the archive")
        self._write(END_OF_ARCHIVE)
        flush = getattr(self._fileobj, "flush", None)
        if flush is not None:
            flush()
        self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()

    def _write_file(self, body: SpooledBody, name: str) -> None:
        left = len(body)
        with body.reader() as fh:
            while left:
                chunk = fh.read(min(left, CHUNK))
                if not chunk:
                    self._broken = True  # the header promised more bytes than follow
                    raise OSError(f"member {name!r}: its spooled file ended {left} bytes short")
                self._write(chunk)
                left -= len(chunk)

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            # Raw (unbuffered) streams may accept fewer bytes than offered; keep going.
            while view.nbytes:
                n = self._fileobj.write(view)
                if n is None:
                    raise OSError("non-blocking stream accepted no bytes")
                if n >= view.nbytes:
                    self._pos += view.nbytes
                    return
                self._pos += n
                view = view[n:]
        except BaseException:
            self._broken = True
            raise


@dataclass
class Sample:
    """One webdataset sample: the consecutive members that share a key.

    Args:
        key: the member name up to the first ``.`` of its basename, folder prefix included.
        members: extension (the rest of the name) to bytes (a :class:`SpooledBody` for a
            member the reader spilled to a file).
        offset: header offset of the sample's first member.
        length: bytes from ``offset`` to the end of the last member's padding.
    """

    key: str
    members: dict[str, Payload] = field(default_factory=dict)
    offset: int = 0
    length: int = 0


def split_key(name: str) -> tuple[str, str] | None:
    """webdataset's key rule: ``("a/b", "jpg.json")`` for ``"a/b.jpg.json"``; None without one."""
    folder, slash, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem or not ext:
        return None
    return folder + slash + stem, ext


def iter_samples(
    fileobj: BinaryIO,
    *,
    path: str | None = None,
    required: Iterable[str] = (),
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
    max_members: int = DEFAULT_MAX_MEMBERS,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    spill: Callable[[str], bool] | None = None,
) -> Iterator[Sample]:
    """Stream an untrusted tar as webdataset samples, with the checks of ``iter_tar_members``.

    Raises ``ShardError`` with ``tar_bad_name`` for a name without a ``key.ext`` form,
    ``tar_key_not_grouped`` when a key reappears after another key, ``tar_duplicate_member``
    for the same name twice in a sample, and ``tar_missing_member`` when a sample lacks one of
    the ``required`` extensions. Extensions are kept as written (webdataset lowercases them).

    Args:
        fileobj: a binary stream positioned at the start of the tar.
        path: the shard's name, carried into errors (default ``None``).
        required: extensions every sample must have (default none).
        max_member_bytes, max_members, max_header_bytes, spill: as for ``iter_tar_members``.
    """
    required = tuple(required)
    seen: set[str] = set()
    current: Sample | None = None
    end = 0

    def fault(reason: str, member: str, detail: str, offset: int) -> ShardError:
        return ShardError(reason, path=path, member=member, detail=detail, offset=offset)

    def finish(sample: Sample) -> Sample:
        missing = [ext for ext in required if ext not in sample.members]
        if missing:
            raise fault(
                "tar_missing_member", sample.key, f"sample lacks required extension(s) {missing}", sample.offset
            )
        sample.length = end - sample.offset
        return sample

    for member in iter_tar_members(
        fileobj,
        path=path,
        max_member_bytes=max_member_bytes,
        max_members=max_members,
        max_header_bytes=max_header_bytes,
        read_data=True,
        spill=spill,
    ):
        parts = split_key(member.name)
        if parts is None:
            raise fault("tar_bad_name", member.name, "member name has no key.ext form", member.header_offset)
        key, ext = parts
        if current is None or key != current.key:
            if key in seen:
                raise fault(
                    "tar_key_not_grouped",
                    member.name,
                    f"key {key!r} appears again after other keys",
                    member.header_offset,
                )
            if current is not None:
                yield finish(current)
            seen.add(key)
            current = Sample(key=key, offset=member.header_offset)
        if ext in current.members:
            raise fault("tar_duplicate_member", member.name, "the same name twice in one sample", member.header_offset)
        current.members[ext] = member.data  # type: ignore[assignment]  # read_data=True
        end = member.end
    if current is not None:
        yield finish(current)
