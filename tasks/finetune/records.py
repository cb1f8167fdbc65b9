"""LLaVA-style records files read incrementally: JSONL by byte ranges, JSON arrays streamed."""

from __future__ import annotations

import codecs
import gzip
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, cast

BLOCK = 1 << 20  # bytes per read; memory holds about two of them plus one record
_WS = b" \t\n\r\x0b\x0c"  # what bytes.strip() removes: a line of only these is blank


class RecordsError(ValueError):
    """A records file that cannot be read at all; the message names the file and the byte."""


@dataclass
class RawRecord:
    """One input record as read: ``record`` is None when it could not be parsed.

    Args:
        row: 0-based record number in the file (a non-blank JSONL line, or an array element).
        record: the parsed object.
        reason, detail: why it could not be parsed (``unparsable_row``); the detail names the
            byte offset.
        offset: byte offset where the record starts (of the decompressed text for ``.gz``).
    """

    row: int
    record: Any = None
    reason: str | None = None
    detail: str | None = None
    offset: int = 0


def records_format(name: str) -> str:
    """``json`` (one array of records) or ``jsonl`` (a record per line), from the file name."""
    base = name[:-3] if name.endswith(".gz") else name
    if base.endswith(".jsonl") or base.endswith(".ndjson"):
        return "jsonl"
    if base.endswith(".json"):
        return "json"
    raise RecordsError(f"{name}: records must be .json or .jsonl (optionally .gz)")


def splittable(name: str) -> bool:
    """Whether the file can be read in byte ranges by several tasks (plain JSONL only)."""
    return records_format(name) == "jsonl" and not name.endswith(".gz")


def byte_ranges(size: int, range_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``range_bytes`` covering ``size`` bytes (one empty range for 0)."""
    if size <= 0:
        return [(0, 0)]
    return [(start, min(start + range_bytes, size)) for start in range(0, size, range_bytes)]


def read_blocks(fh: IO[bytes] | gzip.GzipFile, size: int = BLOCK) -> Iterator[bytes]:
    while block := fh.read(size):
        yield block


def _unparsable(row: int, offset: int, what: str) -> RawRecord:
    return RawRecord(row, None, "unparsable_row", f"byte {offset}: {what}"[:240], offset)


# A JSON escape of a UTF-16 surrogate: json reads a lone one ("\\ud83d" without its pair) into a
# string that no UTF-8 writer takes, so a record holding one is refused where it is read.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _parsed(row: int, offset: int, record: Any, source: str, begin: int = 0, end: int | None = None) -> RawRecord:
    """``record`` (parsed from ``source[begin:end]``) as a row: ``unparsable_row`` when it holds a lone surrogate."""
    if _SURROGATE_ESCAPE.search(source, begin, len(source) if end is None else end) is not None:
        try:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            lone = ord(err.object[err.start])
            return _unparsable(row, offset, f"\\u{lone:04x} escaped without its pair: not Unicode text")
    return RawRecord(row, record, offset=offset)


# --- JSONL ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One non-blank JSONL line: where it starts, its bytes (None when over the cap), its size."""

    offset: int
    data: bytes | None
    size: int


def iter_lines(blocks: Iterable[bytes], offset: int, end: int | None, cap: int) -> Iterator[Line]:
    """Non-blank lines of ``blocks`` (which begin at byte ``offset``, a line start) that start
    before ``end`` (None: the end of the stream); the line that straddles ``end`` is read whole.

    A line whose content (its newline excluded) is over ``cap`` bytes is yielded with ``data``
    None and is never held: its pieces are dropped as they arrive. A line of only whitespace is
    blank, whatever its length. The plan's count and the ranges' reads both frame lines here, so
    they agree on every record's row.
    """
    pieces: list[bytes] = []
    held = 0  # bytes held in pieces
    size = 0  # bytes of the current line so far
    over = False  # the current line went over the cap
    text = False  # a dropped piece of it was not whitespace
    pos = offset
    for block in blocks:
        i, n = 0, len(block)
        while i < n:
            if size == 0 and end is not None and pos >= end:
                return
            nl = block.find(b"\n", i)
            stop = n if nl < 0 else nl + 1
            piece = block[i:stop] if i or stop < n else block
            size += stop - i
            if not over and held + len(piece) - (nl >= 0) > cap:
                over = True
                text = any(p.strip(_WS) for p in pieces) or bool(piece.strip(_WS))
                pieces, held = [], 0
            elif over:
                text = text or bool(piece.strip(_WS))
            else:
                pieces.append(piece)
                held += len(piece)
            i = stop
            if nl >= 0:
                line = _line(pos, pieces, size, over, text)
                if line is not None:
                    yield line
                pos += size
                pieces, held, size, over, text = [], 0, 0, False, False
    if size and (end is None or pos < end):  # a last line without a newline
        line = _line(pos, pieces, size, over, text)
        if line is not None:
            yield line


def _line(pos: int, pieces: list[bytes], size: int, over: bool, text: bool) -> Line | None:
    if over:
        return Line(pos, None, size) if text else None
    data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    # Most lines start with "{": the first byte settles it without copying the line.
    return Line(pos, data, size) if data[:1].strip(_WS) or data.strip(_WS) else None


def range_lines(fh: IO[bytes], start: int, end: int | None, cap: int, block: int = BLOCK) -> Iterator[Line]:
    """The lines a task owns: those starting in ``[start, end)`` of a seekable file.

    A task after the first starts at the first line that begins at or after ``start``: it reads
    from ``start - 1`` and skips to the byte after the first newline, looking no further than
    ``end``: a range that no line starts in reads only to its end.
    """
    if start == 0:
        yield from iter_lines(read_blocks(fh, block), 0, end, cap)
        return
    fh.seek(start - 1)
    pos = start - 1
    for data in read_blocks(fh, block):
        nl = data.find(b"\n")
        if nl >= 0:
            yield from iter_lines(_chain(data[nl + 1 :], read_blocks(fh, block)), pos + nl + 1, end, cap)
            return
        pos += len(data)
        if end is not None and pos >= end:
            return


def _chain(first: bytes, blocks: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from blocks


def jsonl_records(lines: Iterable[Line], first_row: int, cap: int) -> Iterator[RawRecord]:
    """Parse each line as one record; a bad line is one ``unparsable_row`` naming its byte offset."""
    row = first_row
    for line in lines:
        if line.data is None:
            yield _unparsable(row, line.offset, f"line of {line.size} bytes over max_record_bytes {cap}")
        else:
            try:
                text = line.data.decode("utf-8-sig" if line.offset == 0 else "utf-8")  # a byte order mark first
                yield _parsed(row, line.offset, json.loads(text), text)
            except UnicodeDecodeError as err:
                yield _unparsable(row, line.offset, f"not UTF-8: {err.reason} at byte {err.start} of the line")
            except ValueError as err:
                yield _unparsable(row, line.offset, str(err))
        row += 1


# --- JSON array -------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS_RE = re.compile(r"[ \t\n\r]*")
_AFTER = re.compile(r"[ \t\n\r]*(,)?[ \t\n\r]*")  # what follows an element: a comma, or not
_STRUCTURE = re.compile(r'[\[\]{},"]')
_IN_STRING = re.compile(r'["\\]')


class _Window:
    """Decoded text over a stream of blocks: the unread part only, with its byte offset.

    Undecodable bytes are kept as lone surrogates (``surrogateescape``) so that byte offsets
    stay exact; a record holding one is refused when its text is encoded back.
    """

    def __init__(self, blocks: Iterable[bytes]):
        self._blocks = iter(blocks)
        self._decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.text = ""
        self.pos = 0
        self.offset = 0  # byte offset of text[pos]
        self.eof = False
        self.ascii = True  # the window is ASCII: characters are bytes (str.isascii is O(1))

    def fill(self, chars: int) -> None:
        """Read until ``chars`` characters are unread, or to the end of the stream."""
        while not self.eof and len(self.text) - self.pos < chars:
            block = next(self._blocks, None)
            if block is None:
                self.eof = True
                tail = self._decoder.decode(b"", final=True)
            else:
                tail = self._decoder.decode(block)
            self.text = self.text[self.pos :] + tail
            self.pos = 0
            self.ascii = self.text.isascii()

    def peek(self) -> str:
        self.fill(1)
        return self.text[self.pos : self.pos + 1]

    def take(self, end: int) -> str:
        """Consume ``text[pos:end]``; returns it."""
        piece = self.text[self.pos : end]
        self.offset += len(piece) if piece.isascii() else len(piece.encode("utf-8", "surrogateescape"))
        self.pos = end
        return piece

    def skip_ws(self) -> None:
        while True:
            self.take(cast("re.Match[str]", _WS_RE.match(self.text, self.pos)).end())  # matches the empty string
            if self.pos < len(self.text) or self.eof:
                return
            self.fill(1)

    def skip_element(self) -> bool:
        """Consume to the next ``,`` or ``]`` outside strings and brackets; False at the end of
        the stream. Strings and nesting are followed, not validated: it frames a broken element."""
        depth, in_string, escaped = 0, False, False
        while True:
            if self.pos >= len(self.text):
                if self.eof:
                    return False
                self.fill(1)
                continue
            if escaped:
                self.take(self.pos + 1)
                escaped = False
                continue
            match = (_IN_STRING if in_string else _STRUCTURE).search(self.text, self.pos)
            if match is None:
                self.take(len(self.text))
                continue
            ch = match.group()
            if not in_string and depth == 0 and ch in ",]":
                self.take(match.start())
                return True
            self.take(match.end())
            if in_string:
                escaped, in_string = ch == "\\", ch != '"'
            elif ch == '"':
                in_string = True
            elif ch in "[{":
                depth += 1
            elif ch in "]}" and depth:
                depth -= 1  # a stray "}" at depth 0 is part of the broken element


def _utf8_size(text: str, start: int, end: int) -> int | None:
    """Bytes of ``text[start:end]`` in UTF-8; None when it holds an undecodable byte."""
    try:
        return len(text[start:end].encode("utf-8"))
    except UnicodeEncodeError:
        return None


def json_array_records(blocks: Iterable[bytes], cap: int, name: str) -> Iterator[RawRecord]:
    """Elements of a JSON array, one at a time, each parsed by the standard library's decoder.

    Memory holds the unread window (``cap`` plus one block), never the array. An element over
    ``cap`` bytes, not UTF-8, or malformed is one ``unparsable_row``, and reading resumes at the
    next element when its brackets and strings still frame it; when they do not (an unclosed
    string or bracket), the rest of the array is one ``unparsable_row`` and the records before it
    are kept. Empty elements (``[1,,2]``, a trailing comma) hold no record and make no row. A
    file that is empty or not an array raises ``RecordsError``.
    """
    w = _Window(blocks)
    if w.peek() == "\ufeff":
        w.take(w.pos + 1)  # a UTF-8 byte order mark, as json.loads(bytes) accepts
    w.skip_ws()
    first = w.peek()
    if first != "[":
        what = "is empty" if not first else f"starts with {first!r}"
        raise RecordsError(f"{name}: the file {what}, expected a JSON array of records")
    w.take(w.pos + 1)
    row = 0
    w.skip_ws()
    while True:
        if len(w.text) - w.pos < cap + 2:
            w.fill(cap + 2)  # an element within the cap is whole in the window, with what follows
        first = w.text[w.pos : w.pos + 1]
        if first == "]":
            break
        start = w.offset
        if not first:
            yield _unparsable(row, start, "the file ends inside the array: no closing ']'")
            return
        begin = w.pos
        try:
            record, end = _DECODER.raw_decode(w.text, w.pos)
            error = None if end < len(w.text) or w.eof else "longer than the window"
        except ValueError as err:
            where = f" at character {err.pos - w.pos} of the element" if isinstance(err, json.JSONDecodeError) else ""
            record, error = None, f"{getattr(err, 'msg', err)}{where}"
        if error is None:
            # The common case in one step: a valid element, then a comma or the closing bracket
            # within the window. Anything else takes the general path below.
            quick = end - w.pos if w.ascii else _utf8_size(w.text, w.pos, end)
            after = cast("re.Match[str]", _AFTER.match(w.text, end))  # matches the empty string
            stop = after.end()
            if quick is not None and stop < len(w.text) and (after.group(1) or w.text[stop] == "]"):
                w.offset += quick + stop - end
                w.pos = stop
                yield (
                    _parsed(row, start, record, w.text, begin, end)
                    if quick <= cap
                    else _unparsable(row, start, f"record of {quick} bytes over max_record_bytes {cap}")
                )
                row += 1
                continue
        if error is None:
            try:
                piece = w.take(end)
                if not piece.isascii():  # O(1) in CPython: most sets are ASCII (json.dumps' default)
                    piece.encode("utf-8")
            except UnicodeEncodeError as err:
                error = (
                    f"not UTF-8: byte 0x{ord(err.object[err.start]) & 0xFF:02x} at character {err.start} of the element"
                )
            size = w.offset - start
            w.skip_ws()
            if error is None and w.peek() not in (",", "]", ""):
                error = f"{w.peek()!r} after a value where ',' or ']' belongs"
        if error is not None and not w.skip_element():
            yield _unparsable(
                row,
                start,
                f"{error}; no element boundary follows, so the rest of the array ({w.offset - start} bytes) is this one row",
            )
            return
        if error is not None:
            size = w.offset - start  # up to the separator
        if size > cap:
            yield _unparsable(row, start, f"record of {size} bytes over max_record_bytes {cap}")
        elif error is None:
            yield _parsed(row, start, record, piece)
        elif size:
            yield _unparsable(row, start, error)
        else:
            row -= 1  # an empty element: no record, no row
        row += 1
        if w.peek() == ",":
            w.take(w.pos + 1)
            w.skip_ws()
    w.take(w.pos + 1)
    w.skip_ws()
    if w.peek():
        yield _unparsable(row, w.offset, "content after the closing ']' of the array, not read")


# --- whole files ------------------------------------------------------------------------------


def file_blocks(fh: IO[bytes], name: str, block: int = BLOCK) -> Iterator[bytes]:
    """The file's bytes in blocks, decompressed when the name ends in ``.gz``; a corrupt or
    truncated gzip stream raises ``RecordsError`` naming the decompressed byte it stopped at."""
    if not name.endswith(".gz"):
        yield from read_blocks(fh, block)
        return
    import zlib

    done = 0
    try:
        for data in read_blocks(gzip.GzipFile(fileobj=fh), block):
            done += len(data)
            yield data
    except (OSError, EOFError, zlib.error) as err:
        raise RecordsError(f"{name}: cannot decompress after byte {done}: {err}") from None


def iter_records(fh: IO[bytes], name: str, max_record_bytes: int = 1 << 20, block: int = BLOCK) -> Iterator[RawRecord]:
    """Every record of a JSON or JSONL file (gzip when the name ends in ``.gz``), in file order,
    read incrementally: memory holds about one block and one record, whatever the file's size."""
    blocks = file_blocks(fh, name, block)
    if records_format(name) == "json":
        yield from json_array_records(blocks, max_record_bytes, name)
    else:
        yield from jsonl_records(iter_lines(blocks, 0, None, max_record_bytes), 0, max_record_bytes)
