"""CSV and TSV manifests parsed a block at a time by pyarrow, with the careful row reader for every line pyarrow cannot vouch for."""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

import tasks.formats.manifests.careful as careful
from tasks.formats.manifests.careful import BLANK, ByteSource, CsvRows, Lines, RecordBuffer
from tasks.formats.manifests.files import ManifestError
from tasks.formats.manifests.values import Mapping, RawBatch, extra_column

BLOCK_BYTES = (
    1 << 20
)  # small blocks keep memory flat (allocator retention grows with the block); pyarrow calls cost little per MiB
# Below this many lines a segment pyarrow refuses is read by the careful reader instead of
# being split again.
_SPLIT_LINES = 32
# A csv line whose quotes are all well formed (quoted fields with "" escapes, no quote inside
# an unquoted field, no CR or LF inside a field): its fields are the same for Python's csv
# module and pyarrow, and it is one whole record. Other lines with quotes go the careful way.
_WELL_QUOTED = r'^(?:"(?:[^"\r\n]|"")*"|[^",\r\n]*)(?:,(?:"(?:[^"\r\n]|"")*"|[^",\r\n]*))*\r?\n?$'
# A line with none of these (printable ASCII but the quote) may be blank to Python's csv
# reader (whitespace, unicode spaces, "" alone): in a one-column file, left to the careful
# reader, which skips it.
_SOLID = "[!#-~]"
_BOM = np.frombuffer(b"\xef\xbb\xbf", np.uint8)


class CsvFile:
    """One csv / tsv file read into RawBatches: the header by the careful reader, rows a block at a time.

    Args:
        stream: the decompressed bytes.
        fmt: ``csv`` or ``tsv``.
        where: the file, for messages.
        mapping: the source's column mapping.
        careful_only: read every row with the careful reader (the reference the fast path is
            tested against).
    """

    def __init__(self, stream: IO[bytes], fmt: str, where: str, mapping: Mapping, careful_only: bool = False):
        self.fmt = fmt
        self.where = where
        self.careful_only = careful_only
        self.source = ByteSource(stream, where, lambda: self.lines.count + 1)
        self.lines = Lines(self.source, where)
        self.rows = CsvRows(self.lines, fmt, where, mapping)
        self.buffer = RecordBuffer(self.rows)

    @property
    def header(self) -> list[str]:
        return self.rows.header

    def batches(self, header_required: bool) -> Iterator[RawBatch]:
        if not self.rows.read_header(header_required):
            return
        self._options()
        while True:
            if self.careful_only:
                if not self._one_careful():
                    break
                if len(self.buffer) >= careful.BATCH_ROWS:
                    yield self.buffer.take()  # type: ignore[misc]
                continue
            block = self.source.read_block(BLOCK_BYTES)
            if block is None:  # no newline in a whole block: a line for the careful reader to skip
                self._one_careful()
                continue
            if not block:
                break
            yield from self._block(block)
        left = self.buffer.take()
        if left is not None:
            yield left

    def _options(self) -> None:
        rows = self.rows
        width = len(rows.header)
        names = [f"f{i}" for i in range(width)]
        mapping = rows.mapping
        used = [n for n in (mapping.url, mapping.caption, mapping.license, *rows.extra_names) if n in rows.index]
        needed = [f"f{i}" for i in sorted({rows.index[n] for n in used})]
        self.read_options = pacsv.ReadOptions(column_names=names, use_threads=True, block_size=1 << 20)
        self.parse_options = pacsv.ParseOptions(
            delimiter="\t" if self.fmt == "tsv" else ",",
            quote_char=False if self.fmt == "tsv" else '"',
            double_quote=True,
            escape_char=False,
            newlines_in_values=False,
            ignore_empty_lines=True,
        )
        self.convert_options = pacsv.ConvertOptions(
            include_columns=needed,
            column_types={n: pa.string() for n in needed},
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
            check_utf8=False,  # checked once per block for every column (per segment, with its line, on failure)
        )

    def _one_careful(self) -> bool:
        """One careful record into the buffer; False at the end of the file."""
        record = self.rows.next_record()
        if record is None:
            return False
        if record is not BLANK:
            self.buffer.add(record)
        return True

    def _block(self, block: bytes) -> Iterator[RawBatch]:
        base = self.lines.count
        a = np.frombuffer(block, np.uint8)
        ends = np.flatnonzero(a == 10) + 1
        if ends.size == 0 or ends[-1] != len(block):
            ends = np.append(ends, len(block))
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1]
        n = len(ends)
        offsets = pa.py_buffer(np.concatenate(([0], ends)).astype(np.int32))
        lines = pa.BinaryArray.from_buffers(pa.binary(), n, [None, offsets, pa.py_buffer(block)])
        lens = ends - starts
        has_lf = a[ends - 1] == 10
        core = lens - has_lf
        has_cr = (core > 0) & (a[np.maximum(ends - 1 - has_lf, 0)] == 13)
        empty = (core - has_cr) == 0
        slow = lens > careful.MAX_ROW_BYTES
        # pyarrow drops a byte order mark at the start of its input, which a segment may be.
        first3 = np.minimum(starts[:, None] + np.arange(3), len(block) - 1)
        slow |= (lens >= 3) & (a[first3] == _BOM).all(axis=1)
        if len(self.rows.header) == 1:
            # One column: a whitespace-only line is one blank field to Python's csv reader,
            # a value to pyarrow. With more columns pyarrow refuses such a line (one field).
            slow |= ~pc.match_substring_regex(lines, _SOLID).to_numpy(zero_copy_only=False) & ~empty
        crs = block.count(b"\r")
        if crs and crs != int(has_cr.sum()):
            slow |= pc.match_substring_regex(lines, "\r[^\n]").to_numpy(zero_copy_only=False)
        if self.fmt == "csv" and b'"' in block:
            slow |= self._badly_quoted(a, starts, ends, lines)
        try:
            lines.cast(pa.string())  # UTF-8 checked once for the block; on failure per segment, with its line
            self._utf8_checked = True
        except pa.ArrowInvalid:
            self._utf8_checked = False

        i = 0
        while i < n:
            if not slow[i]:
                j = i + 1 + int(np.argmax(slow[i + 1 :])) if slow[i + 1 :].any() else n
                self.lines.count = base + i
                yield from self._segment(block, starts, ends, empty, base, i, j, check_utf8=not self._utf8_checked)
                if len(self.buffer) >= careful.BATCH_ROWS:
                    yield self.buffer.take()  # type: ignore[misc]
                i = j
                continue
            # The careful reader from line i: one record, which may run on past the block.
            self.lines.count = base + i
            self.lines.preload(block, starts, ends, i, n)
            more = self._one_careful()
            left = self.lines.preloaded_left()
            self.lines.drop_preloaded()
            if len(self.buffer) >= careful.BATCH_ROWS:
                yield self.buffer.take()  # type: ignore[misc]
            if not more or left == 0:
                return  # the record took the rest of the block (and maybe more from the source)
            i = n - left
        self.lines.count = base + n

    @staticmethod
    def _badly_quoted(a: np.ndarray, starts: np.ndarray, ends: np.ndarray, lines: pa.Array) -> np.ndarray:
        """Lines whose quotes _WELL_QUOTED would refuse. The common case, one quoted field (two
        quotes) that starts and ends a field, is checked on the quotes' positions; lines with
        other numbers of quotes go through the pattern."""
        n = len(ends)
        bad = np.zeros(n, bool)
        quotes = np.flatnonzero(a == 34)
        line_of = np.searchsorted(ends, quotes, side="right")
        counts = np.bincount(line_of, minlength=n)
        two = np.flatnonzero(counts == 2)
        if two.size:
            first = np.searchsorted(line_of, two)
            opening, closing = quotes[first], quotes[first + 1]
            last = len(a) - 1
            ok = (opening == starts[two]) | (a[np.maximum(opening - 1, 0)] == 44)  # at a field's start
            after = closing + 1
            tail = ends[two] - after
            nxt, nxt2 = a[np.minimum(after, last)], a[np.minimum(after + 1, last)]
            # ...and at its end: a comma, or the line's end (LF, CR LF, CR at the file's end, nothing).
            ok &= (
                (tail == 0)
                | (nxt == 44)
                | ((nxt == 10) & (tail == 1))
                | ((nxt == 13) & ((tail == 1) | ((tail == 2) & (nxt2 == 10))))
            )
            bad[two[~ok]] = True
        other = np.flatnonzero((counts != 0) & (counts != 2))
        if other.size:
            ok = pc.match_substring_regex(lines.take(pa.array(other)), _WELL_QUOTED).to_numpy(zero_copy_only=False)
            bad[other[~ok]] = True
        return bad

    def _segment(
        self,
        block: bytes,
        starts: np.ndarray,
        ends: np.ndarray,
        empty: np.ndarray,
        base: int,
        lo: int,
        hi: int,
        check_utf8: bool,
    ) -> Iterator[RawBatch]:
        """Lines lo..hi (whole records, each one line) through pyarrow; refused ones split, then careful."""
        view = memoryview(block)[starts[lo] : ends[hi - 1]]
        if check_utf8:
            try:
                str(view, "utf-8")
            except UnicodeDecodeError as err:
                line = lo + int(np.searchsorted(ends[lo:hi] - starts[lo], err.start, side="right"))
                raise ManifestError(self.where, "not UTF-8 text", base + line + 1) from None
        rows = lo + np.flatnonzero(~empty[lo:hi])
        if rows.size == 0:
            return
        try:
            table = pacsv.read_csv(
                pa.py_buffer(view),
                read_options=self.read_options,
                parse_options=self.parse_options,
                convert_options=self.convert_options,
            )
        except pa.ArrowInvalid:
            table = None
        if table is not None and table.num_rows == rows.size:
            left = self.buffer.take()
            if left is not None:
                yield left
            yield self._batch(table, base + rows + 1)
            return
        if hi - lo > _SPLIT_LINES:
            mid = (lo + hi) // 2
            yield from self._segment(block, starts, ends, empty, base, lo, mid, False)
            yield from self._segment(block, starts, ends, empty, base, mid, hi, False)
            return
        self.lines.count = base + lo
        self.lines.preload(block, starts, ends, lo, hi)
        while self.lines.preloaded_left():
            self._one_careful()
        self.lines.drop_preloaded()

    def _batch(self, table: pa.Table, lines: np.ndarray) -> RawBatch:
        rows = self.rows
        mapping = rows.mapping
        n = table.num_rows

        def column(name: str | None) -> pa.ChunkedArray | None:
            i = rows.index.get(name) if name is not None else None
            return table.column(f"f{i}") if i is not None else None

        extra = extra_column(rows.extra_names, {name: column(name) for name in rows.extra_names}, n)
        return RawBatch(
            lines=lines.astype(np.int64),
            url=column(mapping.url),
            caption=column(mapping.caption),
            license=column(mapping.license),
            extra=extra,
        )
