"""Sources of existing data (WebDataset shards, parquet with embedded images) listed and planned into ingest chunks: one per tar, or per rows_per_shard rows of a parquet file."""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any

import fsspec

from tasks.formats.manifests.chunks import MAX_FILE_ROWS, ChunkRef, row_base
from tasks.formats.manifests.files import ManifestError, ManifestFile, display, file_tag, open_options
from tasks.formats.manifests.planning import SourcePlan
from tasks.formats.manifests.sources import check_tags, find_files, source_kind
from tasks.formats.recipe_download import SourceConfig
from tasks.sources.files import MEDIA_SUFFIXES, sidecars_of

# Bump when ingesting the same input bytes would give other samples or ledgers: part of every
# ingest chunk's content hash, so shards ingested by older code are not reused.
INGEST_VERSION = 1

# File names each kind takes from a folder or pattern. Compressed tars are taken so that they
# are recorded (one ``tar_compressed`` error row each), not skipped without a word.
SUFFIXES = {"webdataset": (".tar", ".tar.gz", ".tgz"), "parquet_images": (".parquet",), "files": MEDIA_SUFFIXES}


def stamp(info: dict[str, Any]) -> str:
    """What tells a version of a file from another without reading it: its ETag on object
    stores, else its modification time (local files)."""
    for name in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created"):
        if info.get(name) is not None:
            return f"{name}={info[name]}"
    return ""


def list_inputs(source: SourceConfig, storage_options: dict[str, Any] | None = None) -> list[tuple[ManifestFile, str]]:
    """(file, stamp) of every input file of a ``webdataset`` or ``parquet_images`` source, in
    sorted order of their path under the source's root; ManifestError when there is none."""
    manifest = source.manifest
    where = display(manifest)
    suffixes = SUFFIXES[source.kind]
    kind = source_kind(manifest, storage_options)
    if kind == "file":
        try:
            fs, path = fsspec.core.url_to_fs(manifest, **open_options(manifest, storage_options))
            info = fs.info(path)
        except FileNotFoundError:
            raise ManifestError(where, "cannot open: No such file or directory") from None
        rel = posixpath.basename(manifest.rstrip("/"))
        return [(ManifestFile(manifest, where, rel, "", source.kind, False, int(info.get("size") or 0)), stamp(info))]
    root, listed = find_files(manifest, storage_options, kind)
    infos = dict(listed)
    out: list[tuple[ManifestFile, str]] = []
    for rel, info in listed:
        if not rel.lower().endswith(suffixes):
            continue
        url = f"{root.rstrip('/')}/{rel}" if root else rel
        version = stamp(info)
        if source.kind == "files":  # an edited sidecar (caption, license) is a new version too
            version += "".join(f";{s}:{infos[s].get('size')}:{stamp(infos[s])}" for s in sidecars_of(rel, set(infos)))
        out.append(
            (
                ManifestFile(url, display(url), rel, file_tag(rel), source.kind, False, int(info.get("size") or 0)),
                version,
            )
        )
    if not out:
        raise ManifestError(where, f"no input files; a {source.kind} source takes {', '.join(suffixes)} files")
    check_tags([f for f, _ in out], where)
    return out


def settings_hash(source: SourceConfig) -> str:
    """The source settings that shape what an ingest chunk holds."""
    keep = (
        "name",
        "kind",
        "image_column",
        "caption_column",
        "license_column",
        "url_column",
        "id_column",
        "extra_columns",
    )
    settings = {k: getattr(source, k) for k in keep} | {"ingest_version": INGEST_VERSION}
    if source.kind == "parquet_images":
        settings["rows_per_shard"] = source.rows_per_shard
    return json.dumps(settings, sort_keys=True, default=list)


def chunk_hash(settings: str, file: ManifestFile, version: str, part: int) -> str:
    """Content hash of an ingest chunk: settings, the file's path, size and version, the part."""
    return hashlib.sha256(f"{settings}\n{file.rel}\n{file.size}\n{version}\n{part}".encode()).hexdigest()


def parquet_rows(file: ManifestFile, source: SourceConfig, storage_options: dict[str, Any] | None) -> int:
    """Rows of a parquet file, from its footer; ManifestError when it is not parquet or lacks the image column."""
    import pyarrow.parquet as pq

    try:
        with fsspec.open(file.url, "rb", **open_options(file.url, storage_options)) as fh:
            meta = pq.ParquetFile(fh).metadata
            names = set(meta.schema.to_arrow_schema().names)
    except (OSError, ValueError) as err:
        if isinstance(err, FileNotFoundError):
            raise ManifestError(file.display, "cannot open: No such file or directory") from None
        if not isinstance(err, ValueError) and "parquet" not in str(err).lower():
            raise  # a transient read error: left to retries
        raise ManifestError(file.display, f"not a readable parquet file: {err}") from None
    if source.image_column not in names:
        raise ManifestError(
            file.display, f"no image column {source.image_column!r} (columns: {', '.join(sorted(names)[:20])})"
        )
    if meta.num_rows > MAX_FILE_ROWS:
        raise ManifestError(file.display, f"more than {MAX_FILE_ROWS} rows in one file; split the file")
    return meta.num_rows


def plan_ingest(source: SourceConfig, storage_options: dict[str, Any] | None = None) -> SourcePlan:
    """A source of existing data cut into ingest chunks; nothing is written.

    ``webdataset``: one chunk per tar, its number the tar's file tag (``{tag}-000000``), so a
    tar keeps its chunk, its output shard and its keys when others come or go; its samples
    are counted when it is read (``rows`` 0, ``rows_known`` False). ``parquet_images``: the
    rows of each file (counted from its footer) in chunks of ``rows_per_shard``. A chunk's
    content hash covers the settings, the file's path, size and version (ETag or mtime), so
    an unchanged input is not ingested again and a rewritten one is.
    """
    from concurrent.futures import ThreadPoolExecutor

    settings = settings_hash(source)
    files = list_inputs(source, storage_options)
    counts = [0] * len(files)
    if source.kind == "parquet_images":
        # One footer read per file: a request each on object stores, so side by side.
        with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
            counts = list(pool.map(lambda f: parquet_rows(f[0], source, storage_options), files))
    chunks: list[ChunkRef] = []
    rows = 0
    digest = hashlib.sha256(settings.encode())
    for (file, version), n in zip(files, counts):
        digest.update(f"{file.rel}\t{file.size}\t{version}\n".encode())
        base = row_base(file)
        if source.kind in ("webdataset", "files"):
            one = int(source.kind == "files")  # a media file is one row; a tar's are counted when read
            chunks.append(ChunkRef(source.name, base, base, one, chunk_hash(settings, file, version, 0), file.url))
            rows += one
            continue
        per = source.rows_per_shard
        for part, start in enumerate(range(0, n, per)):
            count = min(per, n - start)
            chunks.append(
                ChunkRef(
                    source.name, base | part, base + start, count, chunk_hash(settings, file, version, part), file.url
                )
            )
        rows += n
    known = source.kind in ("parquet_images", "files")
    note = "" if chunks else f"{display(source.manifest)}: no rows in any of its {len(files)} files"
    total = sum(f.size for f, _ in files)
    return SourcePlan(
        source.name, source.manifest, digest.hexdigest(), total, rows, tuple(chunks), len(files), note, rows_known=known
    )
