"""One manifest file read into judged batches, whatever its format; its bytes hashed as stored on the way."""

from __future__ import annotations

import gzip
import io
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import tasks.formats.manifests.careful as careful
from tasks.formats.manifests.files import (
    GZIP_ERRORS,
    HashingReader,
    ManifestError,
    ManifestFile,
    local_path,
    open_hashed,
)
from tasks.formats.manifests.jsonl import JsonlFile
from tasks.formats.manifests.text import CsvFile
from tasks.formats.manifests.values import Mapping, RawBatch, extra_column, finish
from tasks.formats.recipe_download import SourceConfig

_PARQUET_BATCH_ROWS = 16384
_COPY_BYTES = 1 << 20


@dataclass
class FileTally:
    """What reading a file found out besides its rows.

    Args:
        sha256: hex sha256 of the bytes as stored (compressed when gzipped).
        bytes: their number.
        columns: (name, type) of the columns its rows are read from: a csv / tsv file's whole
            header, a parquet file's mapped and extra columns; empty for jsonl and for a csv
            file without a header. Multi-file sources compare them across files.
        note: why the file has no rows, when it has none.
    """

    sha256: str = ""
    bytes: int = 0
    columns: tuple[tuple[str, str], ...] = ()
    note: str = ""


def read_file(
    file: ManifestFile,
    source: SourceConfig,
    storage_options: dict[str, Any] | None,
    tally: FileTally,
    careful_only: bool = False,
) -> Iterator[pa.Table]:
    """BATCH_SCHEMA tables of the file's rows in order; fills ``tally`` once the file is read.

    Raises ManifestError when the file cannot be read at all. ``careful_only`` reads text
    files a line at a time through ``careful.Lines`` (csv / tsv records with Python's csv
    module): the reference the block readers are tested against.
    """
    mapping = Mapping(source)
    with open_hashed(file, storage_options) as hashed:
        if file.fmt == "parquet":
            yield from _parquet(hashed, file, mapping, tally)
            return
        stream: IO[bytes] = (
            gzip.GzipFile(fileobj=hashed, mode="rb") if file.gzipped else io.BufferedReader(hashed, 1 << 16)
        )
        rows = 0
        if file.fmt == "jsonl":
            for raw in JsonlFile(stream, file.display, mapping, careful_only).batches():
                rows += len(raw.lines)
                yield finish(raw, mapping, "line", None)
            tally.note = "" if rows else "no data rows"
        else:
            reader = CsvFile(stream, file.fmt, file.display, mapping, careful_only)
            for raw in reader.batches(header_required=not file.multi):
                rows += len(raw.lines)
                yield finish(raw, mapping, "line", None)
            tally.columns = tuple((name, "string") for name in reader.header)
            tally.note = "" if rows else ("a header and no data rows" if reader.header else "empty file (no header)")
        hashed.drain()
        tally.sha256, tally.bytes = hashed.digest.hexdigest(), hashed.bytes


def type_name(t: pa.DataType) -> str:
    """A column type for comparing files: string and binary flavours are one type each."""
    if pa.types.is_dictionary(t):
        return type_name(t.value_type)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "binary"
    return str(t)


def _parquet(hashed: HashingReader, file: ManifestFile, mapping: Mapping, tally: FileTally) -> Iterator[pa.Table]:
    where = file.display
    local = None if file.gzipped else local_path(file)
    with tempfile.TemporaryDirectory(prefix="shardsmith-manifest-") as tmp:
        if local is not None:
            hashed.drain()  # the hash of the bytes; the reader then takes the file in place
            path = local
        else:
            # Parquet needs random access (the footer comes first), which a stream of hashed
            # bytes does not give. A remote or gzipped file is spooled to local disk once,
            # hashed on the way, so the hash and the rows come from the same bytes and a
            # remote manifest is fetched only once.
            path = os.path.join(tmp, "manifest.parquet")
            with open(path, "wb") as out:
                stream: IO[bytes] = gzip.GzipFile(fileobj=hashed, mode="rb") if file.gzipped else hashed
                try:
                    while block := stream.read(_COPY_BYTES):
                        out.write(block)
                except GZIP_ERRORS as err:
                    raise ManifestError(where, f"not valid gzip data: {err}") from None
            hashed.drain()
        tally.sha256, tally.bytes = hashed.digest.hexdigest(), hashed.bytes
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            raise ManifestError(where, f"not a parquet file ({err})") from None
        with parquet:
            schema = parquet.schema_arrow
            names = schema.names
            mapping.check_columns(names, where, None, "schema")
            tally.columns = tuple((n, type_name(schema.field(n).type)) for n in mapping.used(names))
            extra_names = mapping.extra_names(names)
            wanted = None if mapping.all_extras else sorted({n for n in (*mapping.mapped, *extra_names) if n in names})
            number = 0  # 1-based row number of the last row read
            batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=wanted)
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except (pa.ArrowException, OSError) as err:
                    raise ManifestError(where, f"cannot read parquet: {err}", number + 1) from None
                # The batch's columns by name; with duplicate names the first column wins.
                columns: dict[str, pa.Array] = {}
                for i, name in enumerate(batch.schema.names):
                    columns.setdefault(name, batch.column(i))
                n = batch.num_rows
                raw_lines = np.arange(number + 1, number + n + 1, dtype=np.int64)
                number += n
                raw = RawBatch(
                    lines=raw_lines,
                    url=columns.get(mapping.url),
                    caption=columns.get(mapping.caption) if mapping.caption is not None else None,
                    license=columns.get(mapping.license) if mapping.license is not None else None,
                    extra=extra_column(extra_names, columns, n),
                )
                # Parquet has no line to cap while reading; the values a row carries are capped instead.
                yield finish(raw, mapping, "row", careful.MAX_ROW_BYTES)
            tally.note = "" if number else "no rows"
