"""Parquet files with the images inside (raw bytes, or Hugging Face's ``Image`` struct of bytes and path) as a source: a chunk of rows in, a row with its verdict for each out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fsspec

from tasks.formats.manifests.chunks import MAX_FILE_ROWS, ChunkRef
from tasks.formats.manifests.files import display, open_options
from tasks.formats.recipe_download import DownloadConfig, SourceConfig
from tasks.sources.tarsamples import shown
from tasks.stages.fetched import Fetched, judge

Row = dict[str, Any]


def image_bytes(value: Any, column: str) -> tuple[bytes | None, str | None, str | None, str | None]:
    """(bytes, path, reason, detail) of an image cell: raw bytes, or a ``{bytes, path}`` struct."""
    path = None
    if isinstance(value, dict):
        path = value.get("path") if isinstance(value.get("path"), str) else None
        value = value.get("bytes")
        if value is None:
            where = (
                f"only the path {shown(path)!r}; images outside the file are not fetched"
                if path
                else "neither bytes nor a path"
            )
            return None, path, "incomplete_sample", f"column {column!r}: {where}"
    if value is None:
        return None, path, "incomplete_sample", f"column {column!r} is null"
    if not isinstance(value, (bytes, bytearray)):
        return (
            None,
            path,
            "wrong_type",
            f"column {column!r} holds {type(value).__name__}, not bytes or a {{bytes, path}} struct",
        )
    return bytes(value), path, None, None


def _value(row: Row, column: str | None) -> tuple[str | None, str | None]:
    """(text, problem) of a caption or license cell; a list or struct is never coerced."""
    if column is None or row.get(column) is None:
        return None, None
    value = row[column]
    if isinstance(value, str):
        return value, None
    if isinstance(value, (list, dict, bytes)):
        return None, f"column {column!r} holds {type(value).__name__}, not a string"
    return str(value), None


class ParquetIngest:
    """The rows of one parquet chunk (rows ``first_row - base`` to ``+ rows`` of the file), in
    order, each with the verdict the download stage records.

    Args:
        source: the ``parquet_images`` source.
        ref: the chunk (``path`` is the file's URL).
        cfg: the download settings whose payload rules apply (max_bytes, allowed_formats).
        storage_options: fsspec options for ``s3://`` inputs.

    Only the row groups that hold the chunk's rows are read, and one at a time.
    """

    def __init__(
        self, source: SourceConfig, ref: ChunkRef, cfg: DownloadConfig, storage_options: dict[str, Any] | None
    ):
        self.source, self.ref, self.cfg, self.options = source, ref, cfg, storage_options
        self.file = display(ref.path)
        self.rows: list[Row] = []

    def _columns(self, names: list[str]) -> list[str]:
        s = self.source
        wanted = [s.image_column, s.caption_column, s.license_column, s.url_column, s.id_column]
        wanted += names if "*" in s.extra_columns else list(s.extra_columns)
        return [c for c in dict.fromkeys(wanted) if c is not None and c in names]

    def _records(self) -> Iterator[tuple[int, Row]]:
        import pyarrow.parquet as pq

        start = self._start()
        end = start + self.ref.rows
        with fsspec.open(self.ref.path, "rb", **open_options(self.ref.path, self.options)) as fh:
            pf = pq.ParquetFile(fh)
            columns = self._columns(pf.schema_arrow.names)
            first = 0
            for group in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(group).num_rows
                lo, hi = max(start, first), min(end, first + n)
                if lo < hi:
                    table = pf.read_row_group(group, columns=columns, use_threads=False).slice(lo - first, hi - lo)
                    for i, record in enumerate(table.to_pylist()):
                        yield lo + i, record
                first += n
                if first >= end:
                    break

    def __iter__(self) -> Iterator[tuple[Row, Fetched]]:
        s = self.source
        base = self.ref.first_row - self._start()
        read = self._start()
        for index, record in self._records():
            read = index + 1
            data, path, reason, detail = image_bytes(record.get(s.image_column), s.image_column)
            caption, bad_caption = _value(record, s.caption_column)
            license, bad_license = _value(record, s.license_column)
            url, _ = _value(record, s.url_column)
            problem = bad_caption or bad_license
            if reason is None and problem:
                reason, detail = "wrong_type", problem
            extra: dict[str, Any] = {"origin": {"file": self.file, "row": index}}
            if path:
                extra["image_path"] = path
            if s.id_column and record.get(s.id_column) is not None:
                extra["id"] = record[s.id_column]
            for column, value in record.items():
                if column not in (s.image_column, s.caption_column, s.license_column, s.url_column, s.id_column):
                    extra[column] = value.hex() if isinstance(value, bytes) else value
            row = {
                "row": base + index,
                "url": url,
                "caption": caption,
                "license": license,
                "extra": json.dumps(extra, ensure_ascii=False, default=str),
                "origin": f"{self.file}:{index + 1}",
            }
            self.rows.append(row)
            if reason is not None:
                yield row, Fetched(reason=reason, detail=detail)
            elif len(data) > self.cfg.max_bytes:
                yield (
                    row,
                    Fetched(
                        reason="too_large",
                        detail=f"image of {len(data)} bytes (download.max_bytes {self.cfg.max_bytes})",
                    ),
                )
            else:
                yield row, judge(Fetched(data=data), self.cfg.allowed_formats)
        # A file rewritten shorter since the run planned it: a row each for the rows it no longer has.
        end = self._start() + self.ref.rows
        for index in range(read, end):
            detail = f"{self.file} ends before its row {index + 1}: it changed after the run planned {end} rows"
            row = {
                "row": base + index,
                "url": None,
                "caption": None,
                "license": None,
                "origin": f"{self.file}:{index + 1}",
            }
            row["extra"] = json.dumps({"origin": {"file": self.file, "row": index}})
            self.rows.append(row)
            yield row, Fetched(reason="source_changed", detail=detail)

    def _start(self) -> int:
        """The chunk's first row within its file (the low bits of a row id; see tasks.formats.manifests.chunks)."""
        return self.ref.first_row & (MAX_FILE_ROWS - 1)
