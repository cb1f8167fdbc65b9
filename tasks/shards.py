"""WebDataset tar shards: a deterministic writer that records member offsets, and a streaming reader for untrusted tars."""

from __future__ import annotations

import hashlib
import re
import tarfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterable, Iterator

FIXED_MTIME = 0

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_END_OF_ARCHIVE = bytes(2 * BLOCK)
_SKIP_CHUNK = 1 << 20  # bounded reads when discarding member data

DEFAULT_MAX_MEMBER_BYTES = 64 * 2**20
DEFAULT_MAX_MEMBERS = 1_000_000
DEFAULT_MAX_HEADER_BYTES = 64 * 1024

# Every reason a ShardError can carry. These are per-shard failures (the shard raises and is
# retried), so they are not ledger reasons; they are stable snake_case all the same.
SHARD_ERROR_REASONS: dict[str, str] = {
    "not_a_tar": "the input is empty or its first block is not a tar header",
    "tar_compressed": "the input starts with a gzip, bzip2, xz or zstd magic; shards are plain tar",
    "tar_truncated": "the input ends inside a header or member, or before the end-of-archive block",
    "tar_bad_checksum": "a header block after the first fails its checksum",
    "tar_bad_header": "a header field (size, name prefix, PAX record) is malformed, an extension "
    "header has no member after it, or a directory carries data",
    "tar_header_too_large": "a GNU long name or PAX header is larger than max_header_bytes",
    "tar_symlink": "a symbolic link member",
    "tar_hardlink": "a hard link member",
    "tar_device": "a character device, block device or fifo member",
    "tar_absolute_name": "a member name that starts with /",
    "tar_parent_reference": "a member name with a .. path component",
    "tar_member_too_large": "a member larger than max_member_bytes",
    "tar_too_many_members": "more members than max_members",
    "tar_unsupported_member": "a member type other than file or directory (sparse, volume, vendor types)",
    "tar_bad_name": "a member name that is empty, not UTF-8, holds a NUL, or has no key.ext form",
    "tar_key_not_grouped": "a sample key appears again after other keys (webdataset would split the sample)",
    "tar_duplicate_member": "the same key.ext twice within one sample",
    "tar_missing_member": "a sample lacks a member extension that the caller requires",
}

# Checked only when the first block is not a valid header: a plain tar whose first member
# name happens to start with "BZh" must still read as a tar.
_COMPRESSION_MAGICS = (
    b"\x1f\x8b",  # gzip
    b"BZh",  # bzip2
    b"\xfd7zXZ\x00",  # xz
    b"\x28\xb5\x2f\xfd",  # zstd
)

_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")
_EXT_RE = re.compile(r"[a-z0-9_]+(?:\.[a-z0-9_]+)*")
_OCTAL_RE = re.compile(rb"[0-7]+")
_DECIMAL_RE = re.compile(rb"[0-9]+")

_REGULAR_TYPES = (b"0", b"\x00")
_DEVICE_TYPES = (b"3", b"4", b"6")


def _padded(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK * BLOCK


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


def _member_header(name: str, size: int) -> bytes:
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

    def write_sample(self, key: str, members: dict[str, bytes]) -> SampleRecord:
        """Write one sample as members ``f"{key}.{ext}"`` in sorted order of ``ext``.

        Raises ``ValueError`` for an invalid or repeated key, an invalid extension, a member
        name longer than 100 bytes or an empty sample, before writing anything.
        """
        if self._closed:
            raise ValueError(f"ShardWriter is closed; cannot write sample {key!r}")
        if self._broken:
            raise ValueError(f"ShardWriter failed an earlier write; cannot write sample {key!r}")
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(
                f"invalid sample key {key!r}: use ASCII letters, digits, '_' and '-' only "
                "(no '.' or '/': webdataset splits the key at the first dot of the basename)"
            )
        if key in self._keys:
            raise ValueError(f"sample key {key!r} was already written to this shard")
        if not members:
            raise ValueError(f"sample {key!r} has no members")
        planned: list[tuple[str, memoryview]] = []
        for ext in sorted(members):
            if not isinstance(ext, str) or not _EXT_RE.fullmatch(ext):
                raise ValueError(
                    f"invalid extension {ext!r} in sample {key!r}: use [a-z0-9_] with single "
                    "inner dots (e.g. 'jpg', 'latent.npy')"
                )
            data = members[ext]
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(
                    f"member {ext!r} of sample {key!r} is {type(data).__name__}, not bytes"
                )
            name = f"{key}.{ext}"
            # ustar keeps names in a 100-byte field; our names have no '/' to split into prefix.
            if len(name.encode("utf-8")) > 100:
                raise ValueError(f"member name {name!r} of sample {key!r} is longer than 100 bytes")
            planned.append((name, memoryview(data).cast("B")))

        start = self._pos
        records = []
        for name, view in planned:
            header = _member_header(name, view.nbytes)
            self._write(header)
            records.append(MemberRecord(name=name, offset=self._pos, size=view.nbytes))
            self._write(view)
            pad = _padded(view.nbytes) - view.nbytes
            if pad:
                self._write(_ZERO_BLOCK[:pad])
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
        self._write(_END_OF_ARCHIVE)
        flush = getattr(self._fileobj, "flush", None)
        if flush is not None:
            flush()
        self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()

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


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------


class ShardError(Exception):
    """A shard that cannot be read safely; a per-shard failure that the flow retries.

    Args:
        reason: a stable snake_case reason from ``SHARD_ERROR_REASONS``.
        path: the shard's path or URL, when the caller named it (default ``None``).
        member: the member name involved, when there is one (default ``None``).
        detail: free text for people (default ``""``).
        offset: byte offset of the header involved (default ``None``).
    """

    def __init__(
        self,
        reason: str,
        path: str | None = None,
        member: str | None = None,
        detail: str = "",
        offset: int | None = None,
    ) -> None:
        self.reason = reason
        self.path = path
        self.member = member
        self.detail = detail
        self.offset = offset
        where = f"shard {path!r}" if path is not None else "shard <unnamed>"
        if member is not None:
            # Names come from untrusted input and may be up to max_header_bytes long.
            shown = member if len(member) <= 200 else member[:200] + "..."
            where += f", member {shown!r}"
        if offset is not None:
            where += f", header at byte {offset}"
        message = f"{reason}: {where}"
        if detail:
            message += f": {detail}"
        super().__init__(message)

    def __reduce__(self):
        # Dask and Prefect pickle exceptions across processes; rebuild from the fields.
        return (type(self), (self.reason, self.path, self.member, self.detail, self.offset))


@dataclass(frozen=True)
class TarMember:
    """One regular-file member of a tar, as read.

    Args:
        name: the member name, with any leading ``./`` removed.
        offset: byte offset of the member's data.
        size: data bytes, without padding.
        header_offset: byte offset of the member's first header block, including any GNU long
            name or PAX headers before it (so ``header_offset .. end`` is the whole member).
        data: the member's bytes, or ``None`` when read with ``read_data=False``.
    """

    name: str
    offset: int
    size: int
    header_offset: int
    data: bytes | None

    @property
    def end(self) -> int:
        """Byte offset just past the member's padding."""
        return self.offset + _padded(self.size)


def _checksum_ok(block: bytes) -> bool:
    raw = block[148:156].split(b"\x00", 1)[0].strip(b" ")
    if not _OCTAL_RE.fullmatch(raw):
        return False
    stored = int(raw, 8)
    unsigned = sum(block[:148]) + 8 * 0x20 + sum(block[156:])
    if stored == unsigned:
        return True
    # Some historic tars summed signed chars; tar accepts both.
    high = sum(1 for b in block[:148] if b > 127) + sum(1 for b in block[156:] if b > 127)
    signed = unsigned - 256 * high
    return stored == signed


def _parse_number(raw: bytes) -> int | None:
    """A numeric header field: octal text, or GNU base-256 (first byte 0x80). None if invalid."""
    if raw[:1] == b"\x80":
        return int.from_bytes(raw[1:], "big")
    if raw[:1] == b"\xff":
        return None  # negative base-256
    text = raw.split(b"\x00", 1)[0].strip(b" ")
    if not text:
        return 0
    if not _OCTAL_RE.fullmatch(text):
        return None
    return int(text, 8)


def _read_exact(fileobj: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes; fewer only at end of input. Pipes and sockets return short reads."""
    chunk = fileobj.read(n)
    if not isinstance(chunk, (bytes, bytearray)):
        raise TypeError(f"fileobj.read returned {type(chunk).__name__}; open the shard in binary mode")
    if len(chunk) == n or not chunk:
        return bytes(chunk)
    parts = [chunk]
    got = len(chunk)
    while got < n:
        chunk = fileobj.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _parse_pax(buf: bytes, path: str | None, offset: int) -> dict[str, bytes]:
    """PAX records ``"%d %s=%s\\n"``; the length counts the whole record, so each step advances."""

    def error(reason: str, detail: str) -> ShardError:
        return ShardError(reason, path=path, detail=detail, offset=offset)

    records: dict[str, bytes] = {}
    pos = 0
    n = len(buf)
    while pos < n:
        if buf[pos] == 0:
            # Some writers NUL-pad the extended data; nothing but padding may follow.
            if buf[pos:].strip(b"\x00"):
                raise error("tar_bad_header", "PAX data continues after NUL padding")
            break
        space = buf.find(b" ", pos, min(n, pos + 20))
        if space < 0 or not _DECIMAL_RE.fullmatch(buf[pos:space]):
            raise error("tar_bad_header", f"malformed PAX record length at byte {pos} of the header")
        length = int(buf[pos:space])
        end = pos + length
        if length <= space - pos + 2 or end > n or buf[end - 1] != 0x0A:
            raise error("tar_bad_header", f"malformed PAX record at byte {pos} of the header")
        keyword, eq, value = buf[space + 1 : end - 1].partition(b"=")
        if not eq or not keyword:
            raise error("tar_bad_header", f"PAX record without keyword=value at byte {pos} of the header")
        try:
            records[keyword.decode("utf-8")] = value
        except UnicodeDecodeError:
            raise error("tar_bad_header", "PAX keyword is not UTF-8") from None
        pos = end
    return records


def _clean_name(raw: bytes, path: str | None, offset: int) -> str:
    """Decode and check a member name; a leading ``./`` goes, absolute and ``..`` names raise."""

    def error(reason: str, detail: str, member: str) -> ShardError:
        return ShardError(reason, path=path, member=member, detail=detail, offset=offset)

    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        shown = raw.decode("utf-8", "backslashreplace")
        raise error("tar_bad_name", "member name is not UTF-8", shown) from None
    if "\x00" in name:
        raise error("tar_bad_name", "member name holds a NUL byte", name.replace("\x00", "\\x00"))
    while name.startswith("./"):
        name = name[2:]
    if name.startswith("/"):
        raise error("tar_absolute_name", "absolute member name", name)
    if ".." in name.split("/"):
        raise error("tar_parent_reference", "member name refers to a parent directory", name)
    return name


def iter_tar_members(
    fileobj: BinaryIO,
    *,
    path: str | None = None,
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
    max_members: int = DEFAULT_MAX_MEMBERS,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    read_data: bool = True,
    skip_larger_than: int | None = None,
) -> Iterator[TarMember]:
    """Stream the regular-file members of an untrusted tar, refusing anything unsafe.

    Reads with ``fileobj.read`` only (no seek), so pipes and HTTP bodies work. Directories are
    skipped; links, devices, absolute or ``..`` names, sparse and unknown member types raise
    ``ShardError``. The archive must end with a zero block: input that stops at a member
    boundary without one is ``tar_truncated``, since samples after the cut would be lost
    silently. Nothing after the end-of-archive block is read.

    Args:
        fileobj: a binary stream positioned at the start of the tar.
        path: the shard's name, carried into errors (default ``None``).
        max_member_bytes: largest member accepted (default 64 MiB); checked from the header,
            before any data is read.
        max_members: most members (files and directories) accepted (default 1,000,000).
        max_header_bytes: largest GNU long name or PAX header (default 64 KiB).
        read_data: when False, member data is read and discarded in bounded chunks and
            ``data`` is ``None`` (default True).
        skip_larger_than: members larger than this (and within ``max_member_bytes``) are
            discarded like that and yielded with ``data`` ``None``, so a caller can refuse one
            sample without giving up the shard (default ``None``: none skipped).
    """

    def error(reason: str, detail: str = "", *, member: str | None = None, offset: int | None = None):
        return ShardError(reason, path=path, member=member, detail=detail, offset=offset)

    pos = 0
    count = 0
    first = True
    # Extension headers apply to the next real header.
    ext_start: int | None = None
    long_name: bytes | None = None
    pax: dict[str, bytes] = {}

    def read_payload(size: int, what: str, header_at: int, member: str | None) -> bytes:
        nonlocal pos
        data = _read_exact(fileobj, size)
        if len(data) < size:
            raise error("tar_truncated", f"input ends inside the {what}", member=member, offset=header_at)
        pad = _padded(size) - size
        if pad and len(_read_exact(fileobj, pad)) < pad:
            raise error("tar_truncated", f"input ends in the {what}'s padding", member=member, offset=header_at)
        pos += size + pad
        return data

    def skip_payload(size: int, what: str, header_at: int, member: str | None) -> None:
        nonlocal pos
        left = _padded(size)
        while left:
            got = len(_read_exact(fileobj, min(left, _SKIP_CHUNK)))
            if got == 0:
                raise error("tar_truncated", f"input ends inside the {what}", member=member, offset=header_at)
            left -= got
        pos += _padded(size)

    while True:
        header_at = pos
        block = _read_exact(fileobj, BLOCK)
        if first:
            if not block:
                raise error("not_a_tar", "input is empty", offset=0)
            if len(block) < BLOCK or (block != _ZERO_BLOCK and not _checksum_ok(block)):
                if block.startswith(_COMPRESSION_MAGICS):
                    raise error("tar_compressed", "input is compressed; shards are plain tar", offset=0)
                raise error("not_a_tar", "first block is not a tar header", offset=0)
            first = False
        elif len(block) < BLOCK:
            if not block:
                raise error("tar_truncated", "input ends without the end-of-archive block", offset=header_at)
            raise error("tar_truncated", "input ends inside a header block", offset=header_at)
        pos += BLOCK

        if block == _ZERO_BLOCK:
            if ext_start is not None:
                raise error("tar_bad_header", "extension header with no member after it", offset=ext_start)
            return
        if not _checksum_ok(block):
            raise error("tar_bad_checksum", "header checksum does not match", offset=header_at)

        typeflag = block[156:157]
        size = _parse_number(block[124:136])
        if size is None:
            raise error("tar_bad_header", "unparsable size field", offset=header_at)

        # Extension headers: bounded, then they modify the next header.
        if typeflag in (b"L", b"K", b"x", b"g"):
            if size > max_header_bytes:
                raise error(
                    "tar_header_too_large",
                    f"extension header of type {typeflag.decode('latin-1')!r} is {size} bytes "
                    f"(max_header_bytes={max_header_bytes})",
                    offset=header_at,
                )
            payload = read_payload(size, "extension header", header_at, None)
            # Global headers ('g', e.g. git archive's commit id) are ignored and belong to no
            # member; 'K' (a long link target) precedes a link, refused below with its reason.
            if typeflag == b"g":
                continue
            if ext_start is None:
                ext_start = header_at
            if typeflag == b"L":
                long_name = payload.rstrip(b"\x00")
            elif typeflag == b"x":
                pax = _parse_pax(payload, path, header_at)
            continue

        # A real header: resolve its name from the extensions before it, then forget them.
        member_at = ext_start if ext_start is not None else header_at
        header_name = block[0:100].split(b"\x00", 1)[0]
        # POSIX ustar keeps a name prefix at 345; GNU tar stores times there; old tars leave it
        # zero. tarfile joins any non-empty prefix, so refuse a prefix we would not join.
        prefix = block[345:500].split(b"\x00", 1)[0]
        if block[257:263] == b"ustar\x00":
            if prefix:
                header_name = prefix + b"/" + header_name
        elif block[257:265] != b"ustar  \x00" and prefix:
            raise error("tar_bad_header", "name prefix in a header that is not POSIX ustar", offset=header_at)
        if "path" in pax and pax["path"]:
            raw_name: bytes = pax["path"]
        elif long_name is not None:
            raw_name = long_name
        else:
            raw_name = header_name
        pax_size = pax.get("size")
        sparse = any(k.startswith("GNU.sparse.") for k in pax)
        ext_start, long_name, pax = None, None, {}
        if pax_size:
            if not _DECIMAL_RE.fullmatch(pax_size):
                raise error("tar_bad_header", "unparsable PAX size", offset=header_at)
            size = int(pax_size)

        shown = raw_name.decode("utf-8", "backslashreplace")
        count += 1
        if count > max_members:
            raise error(
                "tar_too_many_members", f"more than max_members={max_members}", member=shown, offset=member_at
            )

        if typeflag == b"2":
            raise error("tar_symlink", "symbolic link member", member=shown, offset=member_at)
        if typeflag == b"1":
            raise error("tar_hardlink", "hard link member", member=shown, offset=member_at)
        if typeflag in _DEVICE_TYPES:
            raise error("tar_device", "device or fifo member", member=shown, offset=member_at)
        # Old tars mark a directory as a NUL-typed file whose name ends in '/'. tarfile looks at
        # the header's own name, other readers at the long name; either makes it a directory,
        # and a directory with data is refused below, so no reader sees a file we skipped.
        is_dir = typeflag == b"5" or (
            typeflag == b"\x00" and (raw_name.endswith(b"/") or header_name.endswith(b"/"))
        )
        if typeflag not in _REGULAR_TYPES and not is_dir:
            raise error(
                "tar_unsupported_member",
                f"member type {typeflag.decode('latin-1')!r} is not a file or directory",
                member=shown,
                offset=member_at,
            )
        if sparse:
            raise error("tar_unsupported_member", "GNU sparse file", member=shown, offset=member_at)

        if is_dir:
            name = raw_name.rstrip(b"/")
            if name not in (b"", b"."):
                _clean_name(name, path, member_at)
            # tarfile and GNU tar disagree on whether a directory's size skips data; refuse both.
            if size:
                raise error("tar_bad_header", f"directory with size {size}", member=shown, offset=member_at)
            continue

        name = _clean_name(raw_name, path, member_at)
        if not name or name.endswith("/"):
            raise error("tar_bad_name", "empty file name, or one ending in /", member=shown, offset=member_at)
        if size > max_member_bytes:
            raise error(
                "tar_member_too_large",
                f"{size} bytes (max_member_bytes={max_member_bytes})",
                member=name,
                offset=member_at,
            )
        data_at = pos
        if read_data and (skip_larger_than is None or size <= skip_larger_than):
            data: bytes | None = read_payload(size, "member data", member_at, name)
        else:
            skip_payload(size, "member data", member_at, name)
            data = None
        yield TarMember(name=name, offset=data_at, size=size, header_offset=member_at, data=data)


@dataclass
class Sample:
    """One webdataset sample: the consecutive members that share a key.

    Args:
        key: the member name up to the first ``.`` of its basename, folder prefix included.
        members: extension (the rest of the name) to bytes.
        offset: header offset of the sample's first member.
        length: bytes from ``offset`` to the end of the last member's padding.
    """

    key: str
    members: dict[str, bytes] = field(default_factory=dict)
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
        max_member_bytes, max_members, max_header_bytes: as for ``iter_tar_members``.
    """
    required = tuple(required)
    seen: set[str] = set()
    current: Sample | None = None
    end = 0

    def finish(sample: Sample) -> Sample:
        missing = [ext for ext in required if ext not in sample.members]
        if missing:
            raise ShardError(
                "tar_missing_member",
                path=path,
                member=sample.key,
                detail=f"sample lacks required extension(s) {missing}",
                offset=sample.offset,
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
    ):
        parts = split_key(member.name)
        if parts is None:
            raise ShardError(
                "tar_bad_name",
                path=path,
                member=member.name,
                detail="member name has no key.ext form",
                offset=member.header_offset,
            )
        key, ext = parts
        if current is None or key != current.key:
            if key in seen:
                raise ShardError(
                    "tar_key_not_grouped",
                    path=path,
                    member=member.name,
                    detail=f"key {key!r} appears again after other keys",
                    offset=member.header_offset,
                )
            if current is not None:
                yield finish(current)
            seen.add(key)
            current = Sample(key=key, offset=member.header_offset)
        if ext in current.members:
            raise ShardError(
                "tar_duplicate_member",
                path=path,
                member=member.name,
                detail="the same name twice in one sample",
                offset=member.header_offset,
            )
        current.members[ext] = member.data  # type: ignore[assignment]  # read_data=True
        end = member.end
    if current is not None:
        yield finish(current)
