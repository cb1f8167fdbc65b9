"""URL manifests read as a stream and cut into download chunks, memory bounded whatever the manifest's size."""

from __future__ import annotations

import contextlib
import csv
import errno
import gzip
import hashlib
import io
import json
import math
import os
import tempfile
import zlib
from dataclasses import dataclass
from typing import IO, Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.recipe import SourceConfig
from tasks.storage import Storage

# Largest manifest row we hold: one jsonl line, or all the physical lines of one csv/tsv
# record. A longer row becomes ``unparsable_row`` after being skipped in small pieces, so a
# hostile or broken manifest (a 10 GB line, an unclosed quote) cannot blow memory.
MAX_ROW_BYTES = 1 << 20

# Bump when a parsing change alters the rows read from unchanged bytes: it is part of every
# chunk's content hash, so old chunks (and the download shards keyed by them) are not reused.
PARSE_VERSION = 1

URL_SCHEMES = ("http", "https", "file", "s3")

CHUNK_SCHEMA = pa.schema(
    [
        ("row", pa.int64()),  # 0-based, every non-blank data row in file order
        ("line", pa.int64()),  # 1-based line where the row starts (parquet: 1-based row number)
        ("url", pa.string()),
        ("caption", pa.string()),
        ("license", pa.string()),
        ("extra", pa.string()),  # JSON object of the extra columns; null for unparsable rows
        ("reason", pa.string()),  # null, or a manifest reason from tasks/reasons.py
    ]
)

_FORMATS_BY_SUFFIX = ((".csv", "csv"), (".tsv", "tsv"), (".jsonl", "jsonl"), (".ndjson", "jsonl"), (".parquet", "parquet"))
_OTHER_COMPRESSION = (".bz2", ".xz", ".lzma", ".zst", ".zstd", ".lz4", ".zip", ".snappy")
# Errors that mean the bytes are not a readable gzip stream (BadGzipFile is an OSError, so
# it is named before the OSErrors that mean a transient read failure and are left to retries).
_GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)
_PERMANENT_OPEN_ERRORS = {
    FileNotFoundError: errno.ENOENT,
    IsADirectoryError: errno.EISDIR,
    NotADirectoryError: errno.ENOTDIR,
    PermissionError: errno.EACCES,
}
_PARQUET_BATCH_ROWS = 4096
_COPY_BYTES = 1 << 20
_SKIP_BYTES = 64 << 10


class ManifestError(ValueError):
    """A manifest that cannot be read at all (a bad row is counted, never raised).

    Args:
        manifest: the manifest as configured, without query string or credentials.
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
class ChunkRef:
    """One download chunk of a source: a zstd parquet file of CHUNK_SCHEMA rows.

    Args:
        source: source name.
        index: 0-based chunk number within the source.
        first_row: row id of the chunk's first row.
        rows: number of rows in the chunk.
        content_hash: hex sha256 of the chunk's rows and of the source settings that shape
            them; equal hashes mean equal chunk contents.
        path: the chunk file, relative to the storage root.
    """

    source: str
    index: int
    first_row: int
    rows: int
    content_hash: str
    path: str


@dataclass(frozen=True)
class SourcePlan:
    """A source's manifest cut into chunks.

    Args:
        source: source name.
        manifest: the manifest as configured.
        manifest_sha256: hex sha256 of the manifest's bytes as stored (compressed when gzipped).
        manifest_bytes: size of the manifest as stored.
        rows: data rows in the manifest, rejected ones included.
        chunks: the chunks, in row order.
    """

    source: str
    manifest: str
    manifest_sha256: str
    manifest_bytes: int
    rows: int
    chunks: tuple[ChunkRef, ...]


def sample_key(source: str, row: int) -> str:
    """Deterministic WebDataset key of a manifest row; dot free, since dots split tar member names."""
    if "." in source or row < 0:
        raise ValueError(f"cannot make a sample key from source {source!r} and row {row}")
    return f"{source}-{row:09d}"


def url_reason(url: str | None) -> str | None:
    """Pre-rejection reason for a manifest URL (already stripped), or None when it may be fetched.

    A bare string without a scheme (``images/a.jpg``, ``not a url``) is ``invalid_url``:
    manifest rows carry absolute URLs, and guessing that a string is a local path would
    turn a typo into a file read.
    """
    if not url:
        return "missing_url"
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        return "invalid_url"  # control characters: header injection, never a real URL
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
        host = parts.hostname
    except ValueError:
        return "invalid_url"
    if not parts.scheme:
        return "invalid_url"
    if parts.scheme not in URL_SCHEMES:
        return "unsupported_scheme"
    if parts.scheme in ("http", "https"):
        if not host or any(c.isspace() for c in host):
            return "invalid_url"
    elif parts.scheme == "s3":
        if not parts.netloc or parts.path in ("", "/"):
            return "invalid_url"
    elif parts.path in ("", "/"):
        return "invalid_url"
    return None


def iter_chunks(source: SourceConfig, storage_options: dict[str, Any] | None = None) -> Iterator[pa.Table]:
    """Stream the manifest once and yield CHUNK_SCHEMA tables of ``source.rows_per_shard`` rows.

    The last chunk may be shorter; a manifest without data rows yields nothing. Memory holds
    one chunk and one row, never the whole manifest. ``storage_options`` are fsspec options
    for object-store manifests (``s3://``), typically the recipe's; local paths and http(s)
    URLs ignore them, since they are usually the storage root's S3 options and would break
    the HTTP client. Raises ManifestError when the manifest cannot be read at all.
    """
    yield from _read(source, storage_options, _Tally())


def plan_source(
    source: SourceConfig,
    storage: Storage,
    dataset: str,
    storage_options: dict[str, Any] | None = None,
) -> SourcePlan:
    """Cut a source's manifest into content-addressed chunk files under ``{dataset}/manifests/``.

    A chunk file that already exists is not written again, so a rerun over an unchanged
    manifest writes nothing, and appending rows rewrites only the last, partial chunk.
    Chunks of an older manifest version are left in place (a later rerun may still name them).
    """
    tally = _Tally()
    chunks: list[ChunkRef] = []
    first_row = 0
    for index, table in enumerate(_read(source, storage_options, tally)):
        content_hash = _content_hash(source, table)
        path = f"{dataset}/manifests/{source.name}/{index:06d}-{content_hash[:16]}.parquet"
        if not storage.exists(path):
            buf = io.BytesIO()
            pq.write_table(table, buf, compression="zstd")
            storage.write_bytes(path, buf.getvalue())
        chunks.append(ChunkRef(source.name, index, first_row, table.num_rows, content_hash, path))
        first_row += table.num_rows
    return SourcePlan(
        source=source.name,
        manifest=source.manifest,
        manifest_sha256=tally.sha256,
        manifest_bytes=tally.bytes,
        rows=first_row,
        chunks=tuple(chunks),
    )


def read_chunk(storage: Storage, ref: ChunkRef) -> pa.Table:
    """The rows of a chunk written by ``plan_source``; raises ManifestError if the file disagrees with ``ref``."""
    with storage.open(ref.path, "rb") as fh:
        table = pq.read_table(fh, use_threads=False)  # see tasks.ledger.read_parquet
    if not table.schema.equals(CHUNK_SCHEMA, check_metadata=False):
        raise ManifestError(ref.path, f"not a manifest chunk (schema {table.schema.names})")
    if table.num_rows != ref.rows:
        raise ManifestError(ref.path, f"chunk has {table.num_rows} rows, the plan says {ref.rows}")
    return table.replace_schema_metadata(None)


# -- reading ------------------------------------------------------------------------------


class _TooLong(Exception):
    """A row longer than MAX_ROW_BYTES; its bytes were skipped, not held."""


@dataclass
class _Tally:
    sha256: str = ""
    bytes: int = 0


class _HashingReader(io.RawIOBase):
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


def _display(manifest: str) -> str:
    """The manifest for messages: no query string or credentials (presigned URLs carry secrets)."""
    if "://" not in manifest:
        return manifest
    try:
        parts = urlsplit(manifest)
        netloc = parts.netloc.rpartition("@")[2]
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:
        return manifest.split("?", 1)[0]


def _name_of(manifest: str) -> str:
    if "://" in manifest:
        with contextlib.suppress(ValueError):
            return urlsplit(manifest).path
    return manifest


def _resolve_format(source: SourceConfig, where: str) -> tuple[str, bool]:
    """(format, gzipped) of a manifest, from its name unless the format is set."""
    name = _name_of(source.manifest).lower()
    gzipped = name.endswith(".gz")
    stem = name[:-3] if gzipped else name
    for suffix in _OTHER_COMPRESSION:
        if stem.endswith(suffix):
            raise ManifestError(where, f"{suffix[1:]} compression is not supported (only gzip, .gz)")
    if source.format != "auto":
        return source.format, gzipped
    for suffix, fmt in _FORMATS_BY_SUFFIX:
        if stem.endswith(suffix):
            return fmt, gzipped
    raise ManifestError(
        where,
        "cannot tell the format from the name (expected .csv, .tsv, .jsonl, .ndjson or .parquet, "
        "optionally + .gz); set the source's format",
    )


@contextlib.contextmanager
def _open_raw(manifest: str, storage_options: dict[str, Any] | None, where: str) -> Iterator[_HashingReader]:
    scheme = manifest.split("://", 1)[0].lower() if "://" in manifest else ""
    if scheme in ("", "file", "local"):
        options: dict[str, Any] = {}
    elif scheme in ("http", "https"):
        # block_size=0: one streaming GET instead of range requests, which not every server
        # supports and which a single sequential pass does not need.
        options = {"block_size": 0}
    else:
        options = dict(storage_options or {})
    try:
        # Compression is layered here over the hashing wrapper rather than by fsspec, so the
        # hash is of the bytes as stored.
        raw = fsspec.open(manifest, "rb", **options).open()
    except tuple(_PERMANENT_OPEN_ERRORS) as err:
        # The class, not the message: fsspec puts the full URL (query string and all) in the
        # strerror of remote errors.
        code = next(code for cls, code in _PERMANENT_OPEN_ERRORS.items() if isinstance(err, cls))
        raise ManifestError(where, f"cannot open: {os.strerror(code)}") from None
    except (ValueError, ImportError) as err:  # unknown protocol, or its package is missing
        raise ManifestError(where, f"cannot open: {err}") from None
    except Exception as err:
        status = getattr(err, "status", None)
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
            raise ManifestError(where, f"cannot open: HTTP {status}") from None
        raise  # connection trouble and 5xx: transient, left to the flow's retries
    try:
        yield _HashingReader(raw)
    finally:
        raw.close()


def _read(source: SourceConfig, storage_options: dict[str, Any] | None, tally: _Tally) -> Iterator[pa.Table]:
    where = _display(source.manifest)
    fmt, gzipped = _resolve_format(source, where)
    with _open_raw(source.manifest, storage_options, where) as hashed:
        if fmt == "parquet":
            records: Iterator[tuple] = _parquet_records(hashed, gzipped, source, where, tally)
        else:
            stream: IO[bytes] = gzip.GzipFile(fileobj=hashed, mode="rb") if gzipped else io.BufferedReader(hashed, 1 << 16)
            records = _text_records(stream, hashed, fmt, source, where, tally)
        rows: list[tuple] = []
        row_id = 0
        for line, url, caption, license_, extra, reason in records:
            if reason is None:
                reason = url_reason(url)
            rows.append((row_id, line, url, caption, license_, extra, reason))
            row_id += 1
            if len(rows) == source.rows_per_shard:
                yield _table(rows)
                rows = []
        if rows:
            yield _table(rows)


def _table(rows: list[tuple]) -> pa.Table:
    columns = list(zip(*rows))
    return pa.Table.from_arrays(
        [pa.array(col, type=field.type) for col, field in zip(columns, CHUNK_SCHEMA)], schema=CHUNK_SCHEMA
    )


def _content_hash(source: SourceConfig, table: pa.Table) -> str:
    digest = hashlib.sha256()
    settings = {
        "parse_version": PARSE_VERSION,
        "source": source.name,
        "url_column": source.url_column,
        "caption_column": source.caption_column,
        "license_column": source.license_column,
        "extra_columns": list(source.extra_columns),
    }
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for values in zip(*(table.column(name).to_pylist() for name in CHUNK_SCHEMA.names)):
        digest.update(b"\n")
        digest.update(json.dumps(values, ensure_ascii=False, separators=(",", ":")).encode())
    return digest.hexdigest()


# -- values -------------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    """A value JSON can carry: NaN and infinities become null (pandas writes NaN for missing)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _text(value: Any) -> str | None:
    """A url / caption / license value as text; numbers happen in jsonl and parquet."""
    if value is None or isinstance(value, str):
        return value
    value = _json_value(value)
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _url(value: Any) -> str | None:
    url = _text(value)
    if url is not None:
        url = url.strip()
    return url or None


def _dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _Mapping:
    """Which manifest columns feed url, caption, license and extra."""

    def __init__(self, source: SourceConfig):
        self.url = source.url_column
        self.caption = source.caption_column
        self.license = source.license_column
        self.all_extras = "*" in source.extra_columns
        self.named_extras = tuple(c for c in source.extra_columns if c != "*")
        self.mapped = {c for c in (self.url, self.caption, self.license) if c is not None}

    def check_columns(self, names: list[str], where: str, line: int | None, kind: str) -> None:
        if self.url not in names:
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise ManifestError(where, f"no column {self.url!r} in the {kind} (columns: {shown})", line)
        for name in sorted(self.mapped | set(self.named_extras)):
            if names.count(name) > 1:
                raise ManifestError(where, f"column {name!r} appears {names.count(name)} times in the {kind}", line)

    def extra_names(self, names: list[str]) -> list[str]:
        """Extra columns in output order: the named ones, or with "*" every unmapped one."""
        if not self.all_extras:
            return list(self.named_extras)
        seen: dict[str, None] = {}
        for name in names:
            if name not in self.mapped:
                seen.setdefault(name, None)
        return list(seen)

    def record(self, line: int, get: Any, extra_names: list[str]) -> tuple:
        """A record from ``get(column) -> value or None``."""
        # An empty caption or license is no caption or license: csv cannot write null.
        caption = (_text(get(self.caption)) or None) if self.caption is not None else None
        license_ = (_text(get(self.license)) or None) if self.license is not None else None
        extra = _dumps({name: _json_value(get(name)) for name in extra_names})
        return (line, _url(get(self.url)), caption, license_, extra, None)


def _unparsable(line: int) -> tuple:
    return (line, None, None, None, None, "unparsable_row")


class _Lines:
    """Physical lines of a text manifest, decoded one at a time; an iterator for csv.reader.

    A line or record over MAX_ROW_BYTES raises _TooLong after its line is skipped in pieces;
    csv.reader resets its state on the next call, so reading goes on after it.
    """

    def __init__(self, stream: IO[bytes], where: str):
        self._stream = stream
        self._where = where
        self.count = 0  # physical lines read so far
        self.record_bytes = 0  # bytes of the record being read; the caller resets it per record

    def __iter__(self) -> "_Lines":
        return self

    def _readline(self, limit: int) -> bytes:
        try:
            return self._stream.readline(limit)
        except _GZIP_ERRORS as err:
            raise ManifestError(self._where, f"not valid gzip data: {err}", self.count + 1) from None

    def __next__(self) -> str:
        raw = self._readline(MAX_ROW_BYTES + 1)
        if not raw:
            raise StopIteration
        self.count += 1
        self.record_bytes += len(raw)
        if len(raw) > MAX_ROW_BYTES:
            ended = raw.endswith(b"\n")
            del raw
            while not ended:  # small pieces: skipping must not hold what we refused to hold
                piece = self._readline(_SKIP_BYTES)
                ended = not piece or piece.endswith(b"\n")
            raise _TooLong
        if self.record_bytes > MAX_ROW_BYTES:
            raise _TooLong
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ManifestError(self._where, "not UTF-8 text", self.count) from None
        if self.count == 1 and text.startswith("\ufeff"):
            text = text[1:]  # a byte order mark, as spreadsheets write
        return text


def _text_records(
    stream: IO[bytes], hashed: _HashingReader, fmt: str, source: SourceConfig, where: str, tally: _Tally
) -> Iterator[tuple]:
    lines = _Lines(stream, where)
    mapping = _Mapping(source)
    if fmt == "jsonl":
        yield from _jsonl_records(lines, mapping)
    else:
        yield from _csv_records(lines, mapping, fmt, where)
    hashed.drain()
    tally.sha256, tally.bytes = hashed.digest.hexdigest(), hashed.bytes


def _jsonl_records(lines: _Lines, mapping: _Mapping) -> Iterator[tuple]:
    while True:
        lines.record_bytes = 0
        start = lines.count + 1
        try:
            text = next(lines)
        except StopIteration:
            return
        except _TooLong:
            yield _unparsable(start)
            continue
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the stack
            obj = None
        if not isinstance(obj, dict):
            yield _unparsable(start)
            continue
        record = mapping.record(start, obj.get, mapping.extra_names(list(obj)))
        # JSON escapes can spell lone surrogates ("\ud800"), which no UTF-8 column can hold.
        try:
            for value in record[1:5]:
                if value is not None:
                    value.encode("utf-8")
        except UnicodeEncodeError:
            yield _unparsable(start)
            continue
        yield record


def _csv_records(lines: _Lines, mapping: _Mapping, fmt: str, where: str) -> Iterator[tuple]:
    # field_size_limit is process-global. We set it to our row cap on every read (idempotent):
    # the default 128 KiB would reject legitimate long captions, and no field can exceed the
    # row cap that _Lines enforces anyway. Other readers in this process get the same limit.
    csv.field_size_limit(MAX_ROW_BYTES)
    if fmt == "tsv":
        # IANA text/tab-separated-values: no quoting, so a caption that starts with a quote
        # is read as written instead of swallowing the lines after it.
        reader = csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(lines)

    header: list[str] | None = None
    header_line = 1
    while header is None:
        lines.record_bytes = 0
        header_line = lines.count + 1
        try:
            fields = next(reader)
        except StopIteration:
            raise ManifestError(where, "no header row (the file is empty)", header_line) from None
        except _TooLong:
            raise ManifestError(where, f"header row longer than {MAX_ROW_BYTES} bytes", header_line) from None
        except csv.Error as err:
            raise ManifestError(where, f"cannot parse the header row: {err}", header_line) from None
        if not _blank(fields):
            header = [f.strip() for f in fields]
    mapping.check_columns(header, where, header_line, "header")
    index = {}
    for i, name in enumerate(header):
        index.setdefault(name, i)
    extra_names = mapping.extra_names(header)

    while True:
        lines.record_bytes = 0
        start = lines.count + 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except (_TooLong, csv.Error):
            yield _unparsable(start)
            continue
        if _blank(fields):
            continue
        if len(fields) != len(header):
            yield _unparsable(start)
            continue

        def get(name: str | None, fields: list[str] = fields) -> str | None:
            i = index.get(name)  # type: ignore[arg-type]
            return fields[i] if i is not None else None

        yield mapping.record(start, get, extra_names)


def _blank(fields: list[str]) -> bool:
    return not fields or (len(fields) == 1 and not fields[0].strip())


def _parquet_records(
    hashed: _HashingReader, gzipped: bool, source: SourceConfig, where: str, tally: _Tally
) -> Iterator[tuple]:
    # Parquet needs random access (the footer comes first), which a stream of hashed bytes
    # does not give. The file is spooled to local disk once, hashed on the way, so the hash
    # and the rows come from the same bytes and a remote manifest is fetched only once.
    with tempfile.TemporaryDirectory(prefix="shardsmith-manifest-") as tmp:
        spool = os.path.join(tmp, "manifest.parquet")
        with open(spool, "wb") as out:
            stream: IO[bytes] = gzip.GzipFile(fileobj=hashed, mode="rb") if gzipped else hashed
            try:
                while block := stream.read(_COPY_BYTES):
                    out.write(block)
            except _GZIP_ERRORS as err:
                raise ManifestError(where, f"not valid gzip data: {err}") from None
        hashed.drain()
        tally.sha256, tally.bytes = hashed.digest.hexdigest(), hashed.bytes
        try:
            parquet = pq.ParquetFile(spool)
        except (pa.ArrowException, OSError) as err:
            raise ManifestError(where, f"not a parquet file ({err})") from None
        with parquet:
            yield from _parquet_rows(parquet, _Mapping(source), where)


def _parquet_rows(parquet: pq.ParquetFile, mapping: _Mapping, where: str) -> Iterator[tuple]:
    names = parquet.schema_arrow.names
    mapping.check_columns(names, where, None, "schema")
    extra_names = mapping.extra_names(names)
    wanted = None if mapping.all_extras else sorted({n for n in (*mapping.mapped, *extra_names) if n in names})
    number = 0  # 1-based row number of the last row read
    batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=wanted)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as err:
            raise ManifestError(where, f"cannot read parquet: {err}", number + 1) from None
        # Column lists of one batch; with duplicate names the first column wins.
        columns: dict[str, list[Any]] = {}
        for i, name in enumerate(batch.schema.names):
            if name not in columns and (name in mapping.mapped or name in extra_names):
                columns[name] = batch.column(i).to_pylist()
        for i in range(batch.num_rows):
            number += 1

            def get(name: str | None, i: int = i) -> Any:
                col = columns.get(name)  # type: ignore[arg-type]
                return col[i] if col is not None else None

            record = mapping.record(number, get, extra_names)
            # Parquet has no line to cap while reading; cap the row we would carry instead.
            if sum(len(v) for v in record[1:5] if v is not None) > MAX_ROW_BYTES:
                yield _unparsable(number)
            else:
                yield record
