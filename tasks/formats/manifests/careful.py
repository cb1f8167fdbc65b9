"""Text manifests read one physical line at a time: every hostile shape bounded (a 10 GB line, an unclosed quote), a reason and a detail for every bad row; the csv record reader."""

from __future__ import annotations

import csv
import re
from collections.abc import Callable
from typing import IO, Any

import numpy as np
import pyarrow as pa

from tasks.formats.manifests.files import GZIP_ERRORS, ManifestError
from tasks.formats.manifests.values import Mapping, RawBatch, dumps

# Largest manifest row we hold: one jsonl line, or all the physical lines of one csv/tsv
# record (parquet: the bytes of the values a row carries). A longer row becomes
# ``unparsable_row`` after being skipped in small pieces, so a hostile or broken manifest
# (a 10 GB line, an unclosed quote) cannot blow memory. Read at call time, so tests can lower it.
MAX_ROW_BYTES = 1 << 20

_SKIP_BYTES = 64 << 10
BATCH_ROWS = 8192
BLANK = object()  # a blank record: no row


class TooLong(Exception):
    """A row longer than MAX_ROW_BYTES; its bytes were skipped, not held."""


class ByteSource:
    """A decompressed byte stream read by lines or by blocks; what a block read cut off stays in front.

    ``line`` tells the 1-based line being read, for the message of a gzip error.
    """

    def __init__(self, stream: IO[bytes], where: str, line: Callable[[], int]):
        self._stream = stream
        self._where = where
        self._line = line
        self._carry = b""  # read but not handed out: self._carry[self._pos:]
        self._pos = 0
        self._eof = False

    def _read(self, call: Callable[[], bytes]) -> bytes:
        try:
            return call()
        except GZIP_ERRORS as err:
            raise ManifestError(self._where, f"not valid gzip data: {err}", self._line()) from None

    def readline(self, limit: int) -> bytes:
        carry, pos = self._carry, self._pos
        if pos >= len(carry):
            return self._read(lambda: self._stream.readline(limit))
        end = carry.find(b"\n", pos, pos + limit)
        if end >= 0 or len(carry) - pos >= limit:
            self._pos = end + 1 if end >= 0 else pos + limit
            return carry[pos : self._pos]
        line = carry[pos:]
        self._carry, self._pos = b"", 0
        return line + self._read(lambda: self._stream.readline(limit - len(line)))

    def read_block(self, size: int) -> bytes | None:
        """Up to about ``size`` bytes ending at a newline (or at the end); b"" at the end.

        None when ``size`` bytes hold no newline: a line that long is left for ``readline``
        to skip in pieces.
        """
        left = self._carry[self._pos :] if self._pos < len(self._carry) else b""
        want = max(size - len(left), 0)
        data = self._read(lambda: self._stream.read(want)) if want and not self._eof else b""
        if len(data) < want:
            self._eof = True
        data = left + data if left else data
        self._carry, self._pos = b"", 0
        if self._eof:
            return data
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            self._carry = data
            return None
        self._carry, self._pos = data, cut  # the block is data[:cut]; the rest stays in front
        return data[:cut]


class Lines:
    """Physical lines of a text manifest, decoded one at a time; an iterator for csv.reader.

    A line or record over MAX_ROW_BYTES raises TooLong after its line is skipped in pieces;
    csv.reader resets its state on the next call, so reading goes on after it. With
    ``quoting`` (csv), a record cut inside a quoted field is skipped to its end first, its
    quotes read as the csv module reads them (``csv_state``), so the rest of a long quoted
    caption is not read as rows of its own.
    """

    def __init__(self, source: ByteSource, where: str):
        self._source = source
        self._where = where
        self._block: bytes | None = None  # lines a block read already holds, read first
        self._starts: Any = None
        self._ends: Any = None
        self._cursor = 0
        self._stop = 0
        self.count = 0  # physical lines read so far
        self.record_bytes = 0  # bytes of the record being read; the caller resets it per record
        self.record_lines = 0  # physical lines of the record being read
        self.quoting = False  # csv: a record may span lines inside quotes
        self.unclosed = False  # the last record skipped ran to the end of the file inside quotes

    def __iter__(self) -> Lines:
        return self

    def start_record(self) -> int:
        """Begin a record: its byte count starts again; returns its first line's number (1-based)."""
        self.record_bytes = 0
        self.record_lines = 0
        return self.count + 1

    def preload(self, block: bytes, starts: Any, ends: Any, first: int, stop: int) -> None:
        """Read lines ``first``..``stop`` of ``block`` (at ``starts[i]:ends[i]``) before the source's next line."""
        self._block, self._starts, self._ends, self._cursor, self._stop = block, starts, ends, first, stop

    def preloaded_left(self) -> int:
        """Queued lines not read yet; 0 once the reader has gone on into the source."""
        return self._stop - self._cursor if self._block is not None else 0

    def drop_preloaded(self) -> None:
        self._block = None

    def _raw(self, limit: int) -> bytes:
        """The next physical line, or its first ``limit`` bytes (b"" at the end)."""
        if self._block is not None and self._cursor < self._stop:
            raw = self._block[self._starts[self._cursor] : self._ends[self._cursor]]
            self._cursor += 1
            return raw
        self._block = None
        return self._source.readline(limit)

    def __next__(self) -> str:
        cap = MAX_ROW_BYTES
        raw = self._raw(cap + 1)
        if not raw:
            raise StopIteration
        self.count += 1
        self.record_bytes += len(raw)
        self.record_lines += 1
        # csv asks for a record's next line only inside a quoted field
        state = _QUOTED if self.record_lines > 1 else _START
        if len(raw) > cap:
            ended = raw.endswith(b"\n")
            state = csv_state(state, raw) if self.quoting else _START
            del raw
            while not ended:  # small pieces: skipping must not hold what we refused to hold
                piece = self._source.readline(_SKIP_BYTES)
                ended = not piece or piece.endswith(b"\n")
                state = csv_state(state, piece) if self.quoting else _START
            self._skip_quoted(state == _QUOTED)
            raise TooLong
        if self.record_bytes > cap:
            self._skip_quoted(self.quoting and csv_state(state, raw) == _QUOTED)
            raise TooLong
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ManifestError(self._where, "not UTF-8 text", self.count) from None
        if self.count == 1 and text.startswith("\ufeff"):
            text = text[1:]  # a byte order mark, as spreadsheets write
        return text

    def _skip_quoted(self, quoted: bool) -> None:
        """Skip, in pieces, to the end of a record cut inside a quoted field (``quoted``): the
        first newline outside quotes, or the end of the file."""
        self.unclosed = quoted
        if not quoted:
            return
        state, partial = _QUOTED, False
        while piece := self._raw(_SKIP_BYTES):
            state = csv_state(state, piece)
            partial = not piece.endswith(b"\n")
            if not partial:
                self.count += 1
                if state != _QUOTED:
                    self.unclosed = False
                    return
        if partial:  # the file's last line, without a newline
            self.count += 1
            self.unclosed = state == _QUOTED


# csv's states over a record being skipped, as the csv module reads it (its default dialect,
# strict off): a quote opens a quoted field only at the field's start, "" is a quote inside one,
# and text after a closing quote or a quote inside an unquoted field is plain text.
_START, _PLAIN, _QUOTED, _CLOSED = range(4)
_CSV_MARKS = re.compile(rb'[,"\n]')


def csv_state(state: int, data: bytes) -> int:
    """The state after ``data``: a newline outside quotes ends the record (``_START``). Inside
    quotes only the next quote is looked for (a search in C, whatever the field holds)."""
    pos, n = 0, len(data)
    while pos < n:
        if state == _QUOTED:
            at = data.find(b'"', pos)
            if at < 0:
                return _QUOTED
            state, pos = _CLOSED, at + 1
            continue
        m = _CSV_MARKS.search(data, pos)
        at = n if m is None else m.start()
        if at > pos and state in (_START, _CLOSED):  # text first: the field is plain from here
            state = _PLAIN
        if m is None:
            break
        if data[at] == 0x22:
            state = _QUOTED if state in (_START, _CLOSED) else _PLAIN
        else:  # a comma or a newline outside quotes
            state = _START
        pos = at + 1
    return state


def too_long(line: int, end: int | None = None, unclosed: bool = False) -> str:
    """The detail of a row over the cap that starts at ``line`` (and ends at ``end``)."""
    if end is None or end <= line:
        return f"line {line}: longer than {MAX_ROW_BYTES} bytes"
    rest = "; the quote opened there never closes" if unclosed else ""
    return f"lines {line}-{end}: longer than {MAX_ROW_BYTES} bytes{rest}"


# -- csv / tsv --------------------------------------------------------------------------------


class CsvRows:
    """The csv / tsv reader of one file, a record at a time: the header, then rows.

    Args:
        lines: the file's lines.
        fmt: ``csv`` or ``tsv`` (IANA text/tab-separated-values: no quoting, so a caption
            that starts with a quote is read as written instead of swallowing the lines after it).
        where: the file, for messages.
        mapping: the source's column mapping.
    """

    def __init__(self, lines: Lines, fmt: str, where: str, mapping: Mapping):
        # field_size_limit is process-global. We set it to our row cap on every read
        # (idempotent): the default 128 KiB would reject legitimate long captions, and no
        # field can exceed the row cap that Lines enforces anyway.
        csv.field_size_limit(MAX_ROW_BYTES)
        self.lines = lines
        self.where = where
        self.mapping = mapping
        if fmt == "tsv":
            self.reader = csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
        else:
            self.reader = csv.reader(lines)
            lines.quoting = True
        self.header: list[str] = []
        self.index: dict[str, int] = {}
        self.extra_names: list[str] = []

    def read_header(self, required: bool) -> bool:
        """Read up to the first non-blank record as the header; False for a file without one.

        A file without a header is a ManifestError when ``required`` (a single-file source);
        a folder's empty part files (Spark writes them) have no rows instead.
        """
        while True:
            line = self.lines.start_record()
            try:
                fields = next(self.reader)
            except StopIteration:
                if required:
                    raise ManifestError(self.where, "no header row (the file is empty)", line) from None
                return False
            except TooLong:
                raise ManifestError(self.where, f"header row longer than {MAX_ROW_BYTES} bytes", line) from None
            except csv.Error as err:
                hint = ""
                if "new-line character" in str(err):  # the header's line holds a CR the csv module will not take
                    hint = "; its lines may end in CR alone (classic Mac OS): convert them to LF or CRLF"
                raise ManifestError(self.where, f"cannot parse the header row: {err}{hint}", line) from None
            if not _blank(fields):
                break
        self.header = [f.strip() for f in fields]
        self.mapping.check_columns(self.header, self.where, line, "header")
        for i, name in enumerate(self.header):
            self.index.setdefault(name, i)
        self.extra_names = self.mapping.extra_names(self.header)
        return True

    def next_record(self) -> Any:
        """The next record as (line, fields) or (line, reason detail); BLANK; None at the end."""
        start = self.lines.start_record()
        try:
            fields = next(self.reader)
        except StopIteration:
            return None
        except TooLong:
            return (start, too_long(start, self.lines.count, self.lines.unclosed))
        except csv.Error as err:
            return (start, f"line {start}: {err}")
        if _blank(fields):
            return BLANK
        if len(fields) != len(self.header):
            return (start, f"line {start}: {len(fields)} fields, header has {len(self.header)}")
        return (start, fields)


class RecordBuffer:
    """Careful csv records gathered into RawBatches (python lists; values.finish judges them)."""

    def __init__(self, rows: CsvRows):
        self.rows = rows
        self.clear()

    def clear(self) -> None:
        self.at: list[int] = []
        self.values: list[list[str | None]] = [[], [], []]
        self.extra: list[str | None] = []
        self.bad: dict[int, tuple[str, str]] = {}

    def __len__(self) -> int:
        return len(self.at)

    def add(self, record: tuple) -> None:
        line, fields = record
        rows = self.rows
        if isinstance(fields, str):  # a detail: the row could not be parsed
            self.bad[len(self.at)] = ("unparsable_row", fields)
            self.at.append(line)
            for column in self.values:
                column.append(None)
            self.extra.append(None)
            return
        self.at.append(line)
        mapping = rows.mapping
        for column, name in zip(self.values, (mapping.url, mapping.caption, mapping.license)):
            i = rows.index.get(name) if name is not None else None
            column.append(fields[i] if i is not None else None)
        self.extra.append(dumps({n: (fields[rows.index[n]] if n in rows.index else None) for n in rows.extra_names}))

    def take(self) -> RawBatch | None:
        if not self.at:
            return None
        mapping = self.rows.mapping
        batch = RawBatch(
            lines=np.array(self.at, np.int64),
            url=self.values[0],
            caption=self.values[1] if mapping.caption is not None else None,
            license=self.values[2] if mapping.license is not None else None,
            extra=pa.array(self.extra, pa.string()),
            reasons=self.bad,
        )
        self.clear()
        return batch


def _blank(fields: list[str]) -> bool:
    return not fields or (len(fields) == 1 and not fields[0].strip())
