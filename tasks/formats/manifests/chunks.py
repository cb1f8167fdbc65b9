"""Download chunks: their schema, row ids and sample keys, a file's rows cut into chunk tables, and their content hash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats.ledger import read_parquet
from tasks.formats.manifests.files import ManifestError, ManifestFile
from tasks.formats.manifests.reading import FileTally, read_file
from tasks.formats.recipe_download import SourceConfig
from tasks.formats.storage import Storage

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
        ("reason", pa.string()),  # null, or a manifest reason from tasks/formats/reasons.py
        ("detail", pa.string()),  # why the row was rejected, for people ("line 17: ..."); null when not
        ("origin", pa.string()),  # the file as displayed (no credentials or query) + ":" + line
    ]
)

# Row ids of multi-file sources: bit 62 set, the file's 32-bit tag, then the row within the
# file. They stay put when files are added or removed, and never meet a single-file row id.
_MULTI_FILE = 1 << 62
_FILE_ROW_BITS = 30
MAX_FILE_ROWS = 1 << _FILE_ROW_BITS


@dataclass(frozen=True)
class ChunkRef:
    """One download chunk of a source: a zstd parquet file of CHUNK_SCHEMA rows.

    Args:
        source: source name.
        index: the chunk's number within the source: 0, 1, 2... for a single-file source;
            for a folder or pattern source the row-id layout (bit 62, the file tag, then the
            chunk's number within the file), so a chunk keeps its number, and its download
            shard its name, when files are added or removed (``name`` spells it for people).
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
        return chunk_name(self.index)


def chunk_name(index: int) -> str:
    """A chunk index for people and file names (see ``ChunkRef.name``); the one place that spells it."""
    if index & _MULTI_FILE:
        return f"{(index >> _FILE_ROW_BITS) & 0xFFFFFFFF:08x}-{index & (MAX_FILE_ROWS - 1):06d}"
    return f"{index:06d}"


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


def row_base(file: ManifestFile) -> int:
    """Row id of a file's first row (its rows follow); 0 for a single-file source."""
    return _MULTI_FILE | (int(file.tag, 16) << _FILE_ROW_BITS) if file.multi else 0


def file_chunks(
    source: SourceConfig,
    file: ManifestFile,
    storage_options: dict[str, Any] | None,
    tally: FileTally,
    careful_only: bool = False,
) -> Iterator[pa.Table]:
    """CHUNK_SCHEMA tables of ``source.rows_per_shard`` rows (the last may be shorter) of one file."""
    per = source.rows_per_shard
    base = row_base(file)
    prefix = pa.scalar(file.display + ":")
    pending: list[pa.Table] = []
    held = 0
    first = 0  # row in the file of the next chunk's first row

    def cut(table: pa.Table) -> pa.Table:
        nonlocal first
        n = table.num_rows
        if file.multi and first + n > MAX_FILE_ROWS:
            raise ManifestError(
                file.display,
                f"more than {MAX_FILE_ROWS} rows in one file of a folder or pattern source; split the file",
            )
        rows = pa.array(np.arange(base + first, base + first + n, dtype=np.int64))
        first += n
        line = table.column("line")
        origin = pc.binary_join_element_wise(prefix, pc.cast(line, pa.string()), "")
        columns = [
            rows,
            line,
            *(table.column(c) for c in ("url", "caption", "license", "extra", "reason", "detail")),
            origin,
        ]
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


def content_hash(source: SourceConfig, table: pa.Table) -> str:
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


def read_chunk(storage: Storage, ref: ChunkRef) -> pa.Table:
    """The rows of a chunk written by ``plan_file``; raises ManifestError if the file disagrees with ``ref``."""
    table = read_parquet(storage, ref.path)
    if not table.schema.equals(CHUNK_SCHEMA, check_metadata=False):
        raise ManifestError(ref.path, f"not a manifest chunk (schema {table.schema.names})")
    if table.num_rows != ref.rows:
        raise ManifestError(ref.path, f"chunk has {table.num_rows} rows, the plan says {ref.rows}")
    return table.replace_schema_metadata(None)
