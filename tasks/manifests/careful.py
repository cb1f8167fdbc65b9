"""Text manifests read one physical line at a time: every hostile shape bounded (a 10 GB line, an unclosed quote), a reason and a detail for every bad row."""

from __future__ import annotations

import csv
import json
from typing import IO, Any, Callable, Iterator

import numpy as np

from tasks.manifests.sources import GZIP_ERRORS, ManifestError
from tasks.manifests.values import Mapping, RawBatch, dumps, json_value

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
        self._carry = b""
        self._eof = False

    def _read(self, call: Callable[[], bytes]) -> bytes:
        try:
            return call()
        except GZIP_ERRORS as err:
            raise ManifestError(self._where, f"not valid gzip data: {err}", self._line()) from None

    def readline(self, limit: int) -> bytes:
        if not self._carry:
            return self._read(lambda: self._stream.readline(limit))
        end = self._carry.find(b"\n", 0, limit)
        if end >= 0 or len(self._carry) >= limit:
            cut = end + 1 if end >= 0 else limit
            line, self._carry = self._carry[:cut], self._carry[cut:]
            return line
        line, self._carry = self._carry, b""
        return line + self._read(lambda: self._stream.readline(limit - len(line)))

    def read_block(self, size: int) -> bytes | None:
        """Up to about ``size`` bytes ending at a newline (or at the end); b"" at the end.

        None when ``size`` bytes hold no newline: a line that long is left for ``readline``
        to skip in pieces.
        """
        want = max(size - len(self._carry), 0)
        data = self._read(lambda: self._stream.read(want)) if want and not self._eof else b""
        if len(data) < want:
            self._eof = True
        data = self._carry + data if self._carry else data
        if self._eof:
            self._carry = b""
            return data
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            self._carry = data
            return None
        self._carry = data[cut:]
        return data[:cut]


class Lines:
    """Physical lines of a text manifest, decoded one at a time; an iterator for csv.reader.

    A line or record over MAX_ROW_BYTES raises TooLong after its line is skipped in pieces;
    csv.reader resets its state on the next call, so reading goes on after it.
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

    def __iter__(self) -> "Lines":
        return self

    def preload(self, block: bytes, starts: Any, ends: Any, first: int, stop: int) -> None:
        """Read lines ``first``..``stop`` of ``block`` (at ``starts[i]:ends[i]``) before the source's next line."""
        self._block, self._starts, self._ends, self._cursor, self._stop = block, starts, ends, first, stop

    def preloaded_left(self) -> int:
        """Queued lines not read yet; 0 once the reader has gone on into the source."""
        return self._stop - self._cursor if self._block is not None else 0

    def drop_preloaded(self) -> None:
        self._block = None

    def __next__(self) -> str:
        cap = MAX_ROW_BYTES
        if self._block is not None and self._cursor < self._stop:
            raw = self._block[self._starts[self._cursor] : self._ends[self._cursor]]
            self._cursor += 1
        else:
            self._block = None
            raw = self._source.readline(cap + 1)
            if not raw:
                raise StopIteration
        self.count += 1
        self.record_bytes += len(raw)
        if len(raw) > cap:
            ended = raw.endswith(b"\n")
            del raw
            while not ended:  # small pieces: skipping must not hold what we refused to hold
                piece = self._source.readline(_SKIP_BYTES)
                ended = not piece or piece.endswith(b"\n")
            raise TooLong
        if self.record_bytes > cap:
            raise TooLong
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ManifestError(self._where, "not UTF-8 text", self.count) from None
        if self.count == 1 and text.startswith("\ufeff"):
            text = text[1:]  # a byte order mark, as spreadsheets write
        return text


def _too_long(line: int) -> str:
    return f"line {line}: longer than {MAX_ROW_BYTES} bytes"


# -- jsonl ------------------------------------------------------------------------------------

_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def jsonl_batches(lines: Lines, mapping: Mapping) -> Iterator[RawBatch]:
    """Every non-blank line as a row; a line that is no JSON object is ``unparsable_row``."""
    url_col, caption_col, license_col = mapping.url, mapping.caption, mapping.license
    extras = mapping.all_extras or bool(mapping.named_extras)
    at: list[int] = []
    urls: list[Any] = []
    captions: list[Any] = []
    licenses: list[Any] = []
    extra: list[str | None] = []
    bad: dict[int, tuple[str, str]] = {}
    loads = json.loads
    while True:
        lines.record_bytes = 0
        start = lines.count + 1
        try:
            text = next(lines)
        except StopIteration:
            break
        except TooLong:
            bad[len(at)] = ("unparsable_row", _too_long(start))
            obj = None
        else:
            if not text.strip():
                continue
            try:
                obj = loads(text)
            except ValueError as err:
                bad[len(at)] = ("unparsable_row", f"line {start}: {err}")
                obj = None
            except RecursionError:  # "[[[[..." nested past the stack
                bad[len(at)] = ("unparsable_row", f"line {start}: nested too deeply to parse")
                obj = None
            else:
                if type(obj) is not dict:
                    kind = _JSON_KINDS.get(type(obj), type(obj).__name__)
                    bad[len(at)] = ("unparsable_row", f"line {start}: a JSON {kind}, not an object")
                    obj = None
        at.append(start)
        if obj is None:
            urls.append(None)
            captions.append(None)
            licenses.append(None)
            extra.append(None)
        else:
            urls.append(obj.get(url_col))
            captions.append(obj.get(caption_col) if caption_col is not None else None)
            licenses.append(obj.get(license_col) if license_col is not None else None)
            if extras:
                extra.append(dumps({name: json_value(obj.get(name)) for name in mapping.extra_names(list(obj))}))
        if len(at) >= BATCH_ROWS:
            yield _jsonl_batch(at, urls, captions, licenses, extra if extras else None, bad, mapping)
            at, urls, captions, licenses, extra, bad = [], [], [], [], [], {}
    if at:
        yield _jsonl_batch(at, urls, captions, licenses, extra if extras else None, bad, mapping)


def _jsonl_batch(
    at: list[int], urls: list, captions: list, licenses: list, extra: list | None, bad: dict, mapping: Mapping
) -> RawBatch:
    import pyarrow as pa

    from tasks.manifests.values import extra_column

    # JSON escapes can spell lone surrogates ("\ud800"), which no UTF-8 column can hold.
    named = ((mapping.url, urls), (mapping.caption, captions), (mapping.license, licenses), ("the extra columns", extra or []))
    for column, values in named:
        try:
            pa.array(values, pa.string())
            continue
        except (UnicodeEncodeError, pa.ArrowTypeError, pa.ArrowInvalid):
            pass  # a surrogate, or numbers, lists, objects (values.finish judges those)
        for i, value in enumerate(values):
            if isinstance(value, str) and i not in bad:
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    shown = column if column == "the extra columns" else f"column {column!r}"
                    bad[i] = ("unparsable_row", f"line {at[i]}: a lone surrogate in {shown} (a JSON \\ud800-\\udfff escape), which UTF-8 cannot hold")
    for i in bad:
        urls[i] = captions[i] = licenses[i] = None
        if extra:
            extra[i] = None
    return RawBatch(
        lines=np.array(at, np.int64),
        url=urls,
        caption=captions if mapping.caption is not None else None,
        license=licenses if mapping.license is not None else None,
        extra=pa.array(extra, pa.string()) if extra is not None else extra_column((), {}, len(at)),
        reasons=bad,
    )


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
        self.header: list[str] = []
        self.index: dict[str, int] = {}
        self.extra_names: list[str] = []

    def read_header(self, required: bool) -> bool:
        """Read up to the first non-blank record as the header; False for a file without one.

        A file without a header is a ManifestError when ``required`` (a single-file source);
        a folder's empty part files (Spark writes them) have no rows instead.
        """
        while True:
            self.lines.record_bytes = 0
            line = self.lines.count + 1
            try:
                fields = next(self.reader)
            except StopIteration:
                if required:
                    raise ManifestError(self.where, "no header row (the file is empty)", line) from None
                return False
            except TooLong:
                raise ManifestError(self.where, f"header row longer than {MAX_ROW_BYTES} bytes", line) from None
            except csv.Error as err:
                raise ManifestError(self.where, f"cannot parse the header row: {err}", line) from None
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
        self.lines.record_bytes = 0
        start = self.lines.count + 1
        try:
            fields = next(self.reader)
        except StopIteration:
            return None
        except TooLong:
            return (start, _too_long(start))
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
        self.extra.append(
            dumps({n: (fields[rows.index[n]] if n in rows.index else None) for n in rows.extra_names})
        )

    def take(self) -> RawBatch | None:
        import pyarrow as pa

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
