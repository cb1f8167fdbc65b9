"""Manifest files cut into content-addressed download chunks, a file at a time (so files plan in parallel), and the plans of a source's files combined."""

from __future__ import annotations

import hashlib
import io
import json
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.manifests.reading import FileTally, read_file
from tasks.manifests.sources import ManifestError, ManifestFile, display, list_manifest_files
from tasks.recipe import SourceConfig
from tasks.storage import Storage

# Bump when a parsing change alters the rows read from unchanged bytes: it is part of every
# chunk's content hash, so old chunks (and the download shards keyed by them) are not reused.
# 2: detail and origin columns; wrong_type; content hash over the columns' values.
PARSE_VERSION = 2

CHUNK_SCHEMA = pa.schema(
    [
        ("row", pa.int64()),  # row id: see sample_key; single file: 0-based, every non-blank data row in file order
        ("line", pa.int64()),  # 1-based line where the row starts in its file (parquet: 1-based row number)
        ("url", pa.string()),
        ("caption", pa.string()),
        ("license", pa.string()),
        ("extra", pa.string()),  # JSON object of the extra columns; null for unparsable rows
        ("reason", pa.string()),  # null, or a manifest reason from tasks/reasons.py
        ("detail", pa.string()),  # why the row was rejected, for people ("line 17: ..."); null when not
        ("origin", pa.string()),  # the file as displayed (no credentials or query) + ":" + line
    ]
)

# Row ids of multi-file sources: bit 62 set, the file's 32-bit tag, then the row within the
# file. They stay put when files are added or removed, and never meet a single-file row id.
_MULTI_FILE = 1 << 62
_FILE_ROW_BITS = 30
MAX_FILE_ROWS = 1 << _FILE_ROW_BITS
# Columns with few distinct values; dictionary-encoding the near-unique ones (url, caption,
# origin) costs time and makes chunk files larger.
_DICTIONARY_COLUMNS = ["license", "extra", "reason"]
_STORING = 2


@dataclass(frozen=True)
class ChunkRef:
    """One download chunk of a source: a zstd parquet file of CHUNK_SCHEMA rows.

    Args:
        source: source name.
        index: the chunk's number within the source: 0, 1, 2... for a single-file source;
            for a folder or pattern source the row-id layout (bit 62, the file tag, then the
            chunk's number within the file), so a chunk keeps its number (and its download shard its name) when files are
            added or removed.
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

    @property
    def name(self) -> str:
        """The chunk for people and file names: ``000012``, or ``{file tag}-000003`` in a multi-file source."""
        if self.index & _MULTI_FILE:
            return f"{(self.index >> _FILE_ROW_BITS) & 0xFFFFFFFF:08x}-{self.index & (MAX_FILE_ROWS - 1):06d}"
        return f"{self.index:06d}"


@dataclass(frozen=True)
class FilePlan:
    """One manifest file cut into chunks (``plan_file``); small and picklable, for ``combine``.

    Args:
        source: source name.
        file: the file.
        sha256: hex sha256 of its bytes as stored; bytes: their number.
        rows: its data rows, rejected ones included.
        chunks: its chunks in row order.
        columns: (name, type) of the columns its rows come from (see FileTally).
        note: why it has no rows, when it has none.
    """

    source: str
    file: ManifestFile
    sha256: str
    bytes: int
    rows: int
    chunks: tuple[ChunkRef, ...]
    columns: tuple[tuple[str, str], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class SourcePlan:
    """A source's manifest cut into chunks.

    Args:
        source: source name.
        manifest: the manifest as configured.
        manifest_sha256: hex sha256 of the manifest's bytes as stored (compressed when
            gzipped); for a folder or pattern, of the files' paths and hashes in order.
        manifest_bytes: size of the manifest (all its files) as stored.
        rows: data rows in the manifest, rejected ones included; 0 when there are none.
        chunks: the chunks, in file and row order; empty when there are no rows.
        files: how many files the manifest has.
        note: why there are no rows, for people, when there are none ("" otherwise).
    """

    source: str
    manifest: str
    manifest_sha256: str
    manifest_bytes: int
    rows: int
    chunks: tuple[ChunkRef, ...]
    files: int = 1
    note: str = ""


def sample_key(source: str, row: int) -> str:
    """Deterministic WebDataset key of a manifest row; dot free, since dots split tar member names.

    Single-file sources: ``{source}-{row:09d}``. Folder and pattern sources:
    ``{source}-{file tag}-{row in the file:09d}``, the tag being 8 hex digits of the sha256
    of the file's path under the source's root, so keys do not move when files come or go.
    """
    if "." in source or row < 0:
        raise ValueError(f"cannot make a sample key from source {source!r} and row {row}")
    if row & _MULTI_FILE:
        return f"{source}-{(row >> _FILE_ROW_BITS) & 0xFFFFFFFF:08x}-{row & (MAX_FILE_ROWS - 1):09d}"
    return f"{source}-{row:09d}"


def _row_base(file: ManifestFile) -> int:
    return _MULTI_FILE | (int(file.tag, 16) << _FILE_ROW_BITS) if file.multi else 0


# -- one file ---------------------------------------------------------------------------------


def file_chunks(
    source: SourceConfig,
    file: ManifestFile,
    storage_options: dict[str, Any] | None,
    tally: FileTally,
    careful_only: bool = False,
) -> Iterator[pa.Table]:
    """CHUNK_SCHEMA tables of ``source.rows_per_shard`` rows (the last may be shorter) of one file."""
    per = source.rows_per_shard
    base = _row_base(file)
    prefix = pa.scalar(file.display + ":")
    pending: list[pa.Table] = []
    held = 0
    first = 0  # row in the file of the next chunk's first row

    def cut(table: pa.Table) -> pa.Table:
        nonlocal first
        n = table.num_rows
        if file.multi and first + n > MAX_FILE_ROWS:
            raise ManifestError(file.display, f"more than {MAX_FILE_ROWS} rows in one file of a folder or pattern source; split the file")
        rows = pa.array(np.arange(base + first, base + first + n, dtype=np.int64))
        first += n
        line = table.column("line")
        origin = pc.binary_join_element_wise(prefix, pc.cast(line, pa.string()), "")
        columns = [rows, line, *(table.column(c) for c in ("url", "caption", "license", "extra", "reason", "detail")), origin]
        return pa.Table.from_arrays(columns, schema=CHUNK_SCHEMA)

    for batch in read_file(file, source, storage_options, tally, careful_only):
        if batch.num_rows == 0:
            continue
        pending.append(batch)
        held += batch.num_rows
        while held >= per:
            whole = pa.concat_tables(pending)
            yield cut(whole.slice(0, per))
            rest = whole.slice(per)
            pending, held = ([rest] if rest.num_rows else []), rest.num_rows
    if held:
        yield cut(pa.concat_tables(pending))


def _content_hash(source: SourceConfig, table: pa.Table) -> str:
    """sha256 of the settings and of every column's values (not of an encoding of them)."""
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
    digest.update(str(table.num_rows).encode())
    for name in CHUNK_SCHEMA.names:
        column = table.column(name)
        arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        digest.update(b"\0" + name.encode() + b"\0")
        digest.update(arr.is_valid().to_numpy(zero_copy_only=False).tobytes())
        if pa.types.is_integer(arr.type):
            digest.update(pc.fill_null(arr, 0).to_numpy(zero_copy_only=False).astype("<i8").tobytes())
            continue
        arr = pc.fill_null(arr, "")
        offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset : arr.offset + len(arr) + 1]
        digest.update(np.diff(offsets).astype("<i8").tobytes())
        data = arr.buffers()[2]
        if data is not None and len(offsets) and offsets[-1] > offsets[0]:
            digest.update(memoryview(data)[offsets[0] : offsets[-1]])
    return digest.hexdigest()


def plan_file(
    source: SourceConfig,
    file: ManifestFile,
    storage: Storage,
    dataset: str,
    storage_options: dict[str, Any] | None = None,
    *,
    sync: bool = True,
) -> FilePlan:
    """Cut one file of a source into content-addressed chunk files under ``{dataset}/manifests/``.

    Pure and Prefect-free, with a small picklable result: the flow maps it over
    ``list_manifest_files`` on the cluster and hands the results to ``combine``. A chunk file
    that already exists is not written again, so a rerun over an unchanged file writes
    nothing, and appending rows rewrites only the last, partial chunk; chunks never span
    files. Chunks of an older version are left in place (a later rerun may still name them).
    Raises ManifestError when the file cannot be read at all. The chunk files are durable when
    it returns (one ``storage.sync()``), unless ``sync`` is False: then the caller syncs once
    after a batch of files, before anything names their chunks.
    """
    tally = FileTally()

    def store(n: int, table: pa.Table) -> tuple[ChunkRef, bool]:
        content_hash = _content_hash(source, table)
        if file.multi:
            index = _row_base(file) | n
            path = f"{dataset}/manifests/{source.name}/{file.tag}/{n:06d}-{content_hash[:16]}.parquet"
        else:
            index = n
            path = f"{dataset}/manifests/{source.name}/{n:06d}-{content_hash[:16]}.parquet"
        wrote = False
        if not storage.exists(path):
            buf = io.BytesIO()
            pq.write_table(table, buf, compression="zstd", use_dictionary=_DICTIONARY_COLUMNS, write_statistics=False)
            storage.write_bytes(path, buf.getvalue(), fsync=False)
            wrote = True
        return ChunkRef(source.name, index, -1, table.num_rows, content_hash, path), wrote

    # Hashing and writing a chunk (GIL-free, mostly) overlap the reading of the next; at most
    # _STORING chunks wait, so memory stays a few chunks whatever the file's size.
    stored: list[tuple[ChunkRef, bool]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="manifest-chunks") as pool:
        waiting: deque[Future] = deque()
        for n, table in enumerate(file_chunks(source, file, storage_options, tally)):
            waiting.append(pool.submit(store, n, table))
            while len(waiting) > _STORING:
                stored.append(waiting.popleft().result())
        stored.extend(f.result() for f in waiting)
    if sync and any(wrote for _, wrote in stored):
        storage.sync()  # one sync for the file's chunks, before the plan that names them exists
    chunks: list[ChunkRef] = []
    first_row = _row_base(file)
    for ref, _ in stored:
        chunks.append(replace(ref, first_row=first_row))
        first_row += ref.rows
    rows = sum(c.rows for c in chunks)
    return FilePlan(source.name, file, tally.sha256, tally.bytes, rows, tuple(chunks), tally.columns, tally.note)


# -- a source ---------------------------------------------------------------------------------


def combine(source: SourceConfig, file_plans: list[FilePlan]) -> SourcePlan:
    """The source's plan from its files' plans (any order; taken in file order).

    Raises ManifestError, naming files and columns, when the files of a folder or pattern
    source disagree: a column the rows are read from missing in some, of another type, or
    csv headers with different columns.
    """
    where = display(source.manifest)
    plans = sorted(file_plans, key=lambda p: p.file.rel)
    if not plans:
        raise ManifestError(where, "no manifest files")
    multi = plans[0].file.multi
    if multi:
        _check_agreement(plans, where)
    chunks = tuple(c for p in plans for c in p.chunks)
    rows = sum(p.rows for p in plans)
    if multi:
        digest = hashlib.sha256()
        for p in plans:
            digest.update(f"{p.file.rel}\t{p.bytes}\t{p.sha256}\n".encode())
        sha = digest.hexdigest()
    else:
        sha = plans[0].sha256
    note = ""
    if rows == 0:
        note = f"{plans[0].file.display}: {plans[0].note}" if not multi else f"no data rows in any of its {len(plans)} files"
    return SourcePlan(source.name, source.manifest, sha, sum(p.bytes for p in plans), rows, chunks, len(plans), note)


def _check_agreement(plans: list[FilePlan], where: str) -> None:
    with_columns = [p for p in plans if p.columns]
    if len(with_columns) < 2:
        return
    first = with_columns[0]
    want = dict(first.columns)
    problems: list[str] = []
    for p in with_columns[1:]:
        have = dict(p.columns)
        for name in sorted(set(want) | set(have)):
            if name not in have:
                problems.append(f"{p.file.rel} has no column {name!r} ({first.file.rel} has)")
            elif name not in want:
                problems.append(f"{p.file.rel} has a column {name!r} that {first.file.rel} has not")
            elif want[name] != have[name]:
                problems.append(f"{p.file.rel}: column {name!r} is {have[name]}, in {first.file.rel} {want[name]}")
    if problems:
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ManifestError(where, "the files disagree: " + "; ".join(problems[:10]) + more)


def plan_source(
    source: SourceConfig,
    storage: Storage,
    dataset: str,
    storage_options: dict[str, Any] | None = None,
) -> SourcePlan:
    """``list_manifest_files``, ``plan_file`` for each file in turn, then ``combine``: a source planned in one process."""
    files = list_manifest_files(source, storage_options)
    plans = [plan_file(source, f, storage, dataset, storage_options, sync=False) for f in files]
    if any(p.chunks for p in plans):
        storage.sync()  # one sync for every file's chunks (a sync with nothing new to write is cheap)
    return combine(source, plans)


def iter_chunks(source: SourceConfig, storage_options: dict[str, Any] | None = None) -> Iterator[pa.Table]:
    """Stream the manifest once and yield CHUNK_SCHEMA tables of ``source.rows_per_shard`` rows.

    The last chunk of each file may be shorter; a manifest without data rows yields nothing.
    Memory holds one chunk and one block of rows, never the whole manifest.
    ``storage_options`` are fsspec options for object-store manifests (``s3://``), typically
    the recipe's; local paths and http(s) URLs ignore them. Raises ManifestError when the
    manifest cannot be read at all (files that disagree are ``combine``'s to find).
    """
    for file in list_manifest_files(source, storage_options):
        yield from file_chunks(source, file, storage_options, FileTally())


def read_chunk(storage: Storage, ref: ChunkRef) -> pa.Table:
    """The rows of a chunk written by ``plan_file``; raises ManifestError if the file disagrees with ``ref``."""
    with storage.open(ref.path, "rb") as fh:
        table = pq.read_table(fh, use_threads=False)  # see tasks.ledger.read_parquet
    if not table.schema.equals(CHUNK_SCHEMA, check_metadata=False):
        raise ManifestError(ref.path, f"not a manifest chunk (schema {table.schema.names})")
    if table.num_rows != ref.rows:
        raise ManifestError(ref.path, f"chunk has {table.num_rows} rows, the plan says {ref.rows}")
    return table.replace_schema_metadata(None)
