"""Existing data as sources: WebDataset shards (img2dataset's layout included) and parquet files with embedded images, ingested into the same download shards and ledgers as fetched rows.

The parts: ``planning`` (listing the input files, one chunk per tar or per rows of a parquet
file), ``tarsamples`` (an untrusted tar read sample by sample with a verdict each),
``webdataset`` and ``parquet_images`` (a chunk's rows with the verdict the download stage
records). ``ingest_rows`` is what the download and one-pass stages call in place of fetching.
"""

from __future__ import annotations

from typing import Any

from tasks.formats.manifests.chunks import ChunkRef
from tasks.formats.recipe_download import DownloadConfig, SourceConfig
from tasks.formats.storage import Storage
from tasks.sources.planning import plan_ingest

INGEST_KINDS = ("webdataset", "parquet_images", "files")


def ingest_rows(
    source: SourceConfig, ref: ChunkRef, storage: Storage, cfg: DownloadConfig, s3_options: dict[str, Any] | None = None
):
    """(rows, iterator of (row, Fetched)) of an ingest chunk, as ``tasks.stages.download.fetched_rows``
    gives for a manifest chunk; ``rows`` fills as the iterator runs."""
    from tasks.sources.files import FileIngest
    from tasks.sources.parquet_images import ParquetIngest
    from tasks.sources.webdataset import ShardIngest

    reader: ShardIngest | ParquetIngest | FileIngest
    if source.kind == "webdataset":
        reader = ShardIngest(source, ref, cfg, s3_options)
    elif source.kind == "files":
        reader = FileIngest(source, ref, cfg, s3_options)
    else:
        reader = ParquetIngest(source, ref, cfg, s3_options)
    return reader.rows, iter(reader)


__all__ = ["INGEST_KINDS", "ingest_rows", "plan_ingest"]
