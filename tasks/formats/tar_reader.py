"""A streaming tar reader for untrusted shards: bounded reads, no extraction, one reason per refusal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from tasks.formats.spooled import SpooledBody
from tasks.formats.tar_format import (
    BLOCK,
    COMPRESSION_MAGICS,
    DECIMAL_RE,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_MEMBER_BYTES,
    DEFAULT_MAX_MEMBERS,
    DEVICE_TYPES,
    OCTAL_RE,
    REGULAR_TYPES,
    SKIP_CHUNK,
    ZERO_BLOCK,
    padded,
)

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
        data: the member's bytes (a :class:`SpooledBody` for a spilled one), or ``None`` when
            read with ``read_data=False``.
    """

    name: str
    offset: int
    size: int
    header_offset: int
    data: bytes | SpooledBody | None

    @property
    def end(self) -> int:
        """Byte offset just past the member's padding."""
        return self.offset + padded(self.size)


def _checksum_ok(block: bytes) -> bool:
    raw = block[148:156].split(b"\x00", 1)[0].strip(b" ")
    if not OCTAL_RE.fullmatch(raw):
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
    if not OCTAL_RE.fullmatch(text):
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
        if space < 0 or not DECIMAL_RE.fullmatch(buf[pos:space]):
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
    spill: Callable[[str], bool] | None = None,
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
        spill: members whose name it accepts are copied to a :class:`SpooledBody` in chunks
            instead of read into memory (videos, up to hundreds of MB each; default none).
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

    def end_payload(got: int, size: int, what: str, header_at: int, member: str | None) -> None:
        """After ``got`` of a payload's ``size`` bytes were taken: refuse a short one, read its padding."""
        nonlocal pos
        if got < size:
            raise error("tar_truncated", f"input ends inside the {what}", member=member, offset=header_at)
        pad = padded(size) - size
        if pad and len(_read_exact(fileobj, pad)) < pad:
            raise error("tar_truncated", f"input ends in the {what}'s padding", member=member, offset=header_at)
        pos += size + pad

    def read_payload(size: int, what: str, header_at: int, member: str | None) -> bytes:
        data = _read_exact(fileobj, size)
        end_payload(len(data), size, what, header_at, member)
        return data

    def spill_payload(size: int, what: str, header_at: int, member: str) -> SpooledBody:
        body = SpooledBody.copy_from(fileobj, size)
        end_payload(len(body), size, what, header_at, member)
        return body

    def skip_payload(size: int, what: str, header_at: int, member: str | None) -> None:
        nonlocal pos
        left = padded(size)
        while left:
            got = len(_read_exact(fileobj, min(left, SKIP_CHUNK)))
            if got == 0:
                raise error("tar_truncated", f"input ends inside the {what}", member=member, offset=header_at)
            left -= got
        pos += padded(size)

    while True:
        header_at = pos
        block = _read_exact(fileobj, BLOCK)
        if first:
            if not block:
                raise error("not_a_tar", "input is empty", offset=0)
            if len(block) < BLOCK or (block != ZERO_BLOCK and not _checksum_ok(block)):
                if block.startswith(COMPRESSION_MAGICS):
                    raise error("tar_compressed", "input is compressed; shards are plain tar", offset=0)
                raise error("not_a_tar", "first block is not a tar header", offset=0)
            first = False
        elif len(block) < BLOCK:
            if not block:
                raise error("tar_truncated", "input ends without the end-of-archive block", offset=header_at)
            raise error("tar_truncated", "input ends inside a header block", offset=header_at)
        pos += BLOCK

        if block == ZERO_BLOCK:
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
            if not DECIMAL_RE.fullmatch(pax_size):
                raise error("tar_bad_header", "unparsable PAX size", offset=header_at)
            size = int(pax_size)

        shown = raw_name.decode("utf-8", "backslashreplace")
        count += 1
        if count > max_members:
            raise error("tar_too_many_members", f"more than max_members={max_members}", member=shown, offset=member_at)

        if typeflag == b"2":
            raise error("tar_symlink", "symbolic link member", member=shown, offset=member_at)
        if typeflag == b"1":
            raise error("tar_hardlink", "hard link member", member=shown, offset=member_at)
        if typeflag in DEVICE_TYPES:
            raise error("tar_device", "device or fifo member", member=shown, offset=member_at)
        # Old tars mark a directory as a NUL-typed file whose name ends in '/'. tarfile looks at
        # the header's own name, other readers at the long name; either makes it a directory,
        # and a directory with data is refused below, so no reader sees a file we skipped.
        is_dir = typeflag == b"5" or (typeflag == b"\x00" and (raw_name.endswith(b"/") or header_name.endswith(b"/")))
        if typeflag not in REGULAR_TYPES and not is_dir:
            raise error(
                "tar_unsupported_member",
                f"member type {typeflag.decode('latin-1')!r} is not a file or directory",
                member=shown,
                offset=member_at,
            )
        if sparse:
            raise error("tar_unsupported_member", "GNU sparse file", member=shown, offset=member_at)

        if is_dir:
            dir_name = raw_name.rstrip(b"/")
            if dir_name not in (b"", b"."):
                _clean_name(dir_name, path, member_at)
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
        data: bytes | SpooledBody | None
        if read_data and (skip_larger_than is None or size <= skip_larger_than) and spill is not None and spill(name):
            data = spill_payload(size, "member data", member_at, name)
        elif read_data and (skip_larger_than is None or size <= skip_larger_than):
            data = read_payload(size, "member data", member_at, name)
        else:
            skip_payload(size, "member data", member_at, name)
            data = None
        yield TarMember(name=name, offset=data_at, size=size, header_offset=member_at, data=data)
