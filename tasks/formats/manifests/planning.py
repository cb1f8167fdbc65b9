"""Manifest files cut into content-addressed download chunks, a file at a time (so files plan in parallel), and the plans of a source's files combined."""

from __future__ import annotations

import hashlib
import io
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.formats.manifests.chunks import ChunkRef, content_hash, file_chunks, row_base
from tasks.formats.manifests.files import ManifestError, ManifestFile, display
from tasks.formats.manifests.reading import FileTally
from tasks.formats.manifests.sources import list_manifest_files
from tasks.formats.recipe_download import SourceConfig
from tasks.formats.storage import Storage

# Columns with few distinct values; dictionary-encoding the near-unique ones (url, caption,
# origin) costs time and makes chunk files larger.
_DICTIONARY_COLUMNS = ["license", "extra", "reason"]
_STORING = 2


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
        rows_known: False for a source whose rows are counted only when read (WebDataset
            shards, tasks/sources/): ``rows`` is then 0 and the download ledgers count them.
    """

    source: str
    manifest: str
    manifest_sha256: str
    manifest_bytes: int
    rows: int
    chunks: tuple[ChunkRef, ...]
    files: int = 1
    note: str = ""
    rows_known: bool = True


# -- one file ---------------------------------------------------------------------------------


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
        digest = content_hash(source, table)
        if file.multi:
            index = row_base(file) | n
            path = f"{dataset}/manifests/{source.name}/{file.tag}/{n:06d}-{digest[:16]}.parquet"
        else:
            index = n
            path = f"{dataset}/manifests/{source.name}/{n:06d}-{digest[:16]}.parquet"
        wrote = False
        if not storage.exists(path):
            buf = io.BytesIO()
            pq.write_table(table, buf, compression="zstd", use_dictionary=_DICTIONARY_COLUMNS, write_statistics=False)
            storage.write_bytes(path, buf.getvalue(), fsync=False)
            wrote = True
        return ChunkRef(source.name, index, -1, table.num_rows, digest, path), wrote

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
    first_row = row_base(file)
    for ref, _ in stored:
        chunks.append(replace(ref, first_row=first_row))
        first_row += ref.rows
    rows = sum(c.rows for c in chunks)
    return FilePlan(source.name, file, tally.sha256, tally.bytes, rows, tuple(chunks), tally.columns, tally.note)


def group_files(files: list[ManifestFile], target_bytes: int = 256 << 20) -> list[list[ManifestFile]]:
    """Consecutive files in groups of about ``target_bytes`` (as listed), for one task per group.

    A task costs the orchestration a fraction of a second, so thousands of small part files
    plan better a group per task; a file larger than the target is a group of its own. Files
    of unknown size (-1) count as the target.
    """
    groups: list[list[ManifestFile]] = []
    size = 0
    for f in files:
        weight = f.size if f.size >= 0 else target_bytes
        if groups and size + weight <= target_bytes:
            groups[-1].append(f)
            size += weight
        else:
            groups.append([f])
            size = weight
    return groups


def plan_files(
    source: SourceConfig,
    files: list[ManifestFile],
    storage: Storage,
    dataset: str,
    storage_options: dict[str, Any] | None = None,
) -> list[FilePlan]:
    """``plan_file`` for a group of files (see ``group_files``), with one sync for all of them."""
    plans = [plan_file(source, f, storage, dataset, storage_options, sync=False) for f in files]
    if any(p.chunks for p in plans):
        storage.sync()
    return plans


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
        note = (
            f"{plans[0].file.display}: {plans[0].note}"
            if not multi
            else f"no data rows in any of its {len(plans)} files"
        )
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
    """``list_manifest_files``, ``plan_file`` for each file in turn (one sync), then ``combine``: a source planned in one process."""
    return combine(
        source, plan_files(source, list_manifest_files(source, storage_options), storage, dataset, storage_options)
    )


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
