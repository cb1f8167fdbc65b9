"""Ledgers: one parquet per shard with a row for every input row; its presence commits the shard."""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.formats.reasons import ERROR, OK, REJECTED, status_of
from tasks.formats.storage import Storage

MEMBER_TYPE = pa.struct([("name", pa.string()), ("offset", pa.int64()), ("size", pa.int64())])

# Every column any phase's ledger has, with its one type. A phase's ledger is the core
# columns, then the columns it declares (``ledger_schema``); all but the core are nullable.
COLUMNS: dict[str, pa.DataType] = {
    "key": pa.string(),
    "source": pa.string(),
    "row": pa.int64(),  # the input row; null where an output row stands for several inputs (a pack)
    "status": pa.string(),
    "reason": pa.string(),
    "shard": pa.string(),  # output shard, relative to the storage root; null unless ok
    "bytes": pa.int64(),  # payload bytes of the primary member (the image; precache: the first array)
    "sha256": pa.string(),  # of the primary member
    "offset": pa.int64(),  # first header byte of the sample in the shard
    "length": pa.int64(),  # header + data + padding bytes of all the sample's members
    "members": pa.list_(MEMBER_TYPE),  # data offset and size of every member
    "url": pa.string(),
    "format": pa.string(),
    "http_status": pa.int32(),
    "attempts": pa.int32(),
    "detail": pa.string(),  # free text for people; never grouped on
    "origin": pa.string(),  # where the row came from (manifest file and line), for people
    # download (keeping a dataset current): when the row was last fetched, by how many runs in
    # all (a retry of a passing failure adds one), and the validators the server sent with it
    "fetched_at": pa.timestamp("us", tz="UTC"),
    "fetches": pa.int32(),
    "etag": pa.string(),
    "last_modified": pa.string(),
    # validation
    "license": pa.string(),  # normalised SPDX id
    "width": pa.int32(),  # of the stored image
    "height": pa.int32(),
    "caption_chars": pa.int32(),
    "pixel_sha256": pa.string(),  # exact-duplicate key: the normalised pixels
    "phash": pa.uint64(),  # near-duplicate key: 64-bit perceptual hash
    # clips of a video source (tasks/video/): the source video's key and the clip's span in it
    "video": pa.string(),
    "start_s": pa.float32(),
    "end_s": pa.float32(),
    # what the probe read of that video (tasks/video/probe.py), on every row of a video source's
    # validation ledger: its clips' and the row of a video that gave none (VIDEO_FACTS)
    "video_duration_s": pa.float32(),
    "video_width": pa.int32(),
    "video_height": pa.int32(),
    "video_fps": pa.float32(),
    "video_codec": pa.string(),
    "video_container": pa.string(),
    # privacy (validation, recipe ``privacy:``): faces the detector found in the image (null where
    # it did not look), the kinds of personal data found in the text, comma-joined (empty where
    # none was found, null where it did not look), and what was done (``blurred``, ``redacted``,
    # ``metadata``: segments removed from bytes kept as fetched), comma-joined, null for nothing
    "faces": pa.int32(),
    "personal_data": pa.string(),
    "privacy": pa.string(),
    # reshard
    "input_shard": pa.string(),  # the input shard a sample came from
    # precache: ``aligned``, the key DALI read is the key the image shard holds at that
    # position; ``finite``, every stored value of every encoding is finite
    "position": pa.int64(),
    "aligned": pa.bool_(),
    "finite": pa.bool_(),
    # curation: the image-text alignment, every score by name, the kept sample a semantic
    # duplicate is grouped with and their cosine similarity, the run that computed the embeddings
    "alignment": pa.float32(),
    "scores": pa.map_(pa.string(), pa.float32()),
    "duplicate_of": pa.string(),
    "similarity": pa.float32(),
    "embedded_by": pa.string(),
    # fine-tuning records (ingest) and samples
    "id": pa.string(),
    "turns": pa.string(),  # JSON [[role, text], ...] of a record that passed the checks
    # Rows of the derived image manifest, counted from the chunk's first one
    # (IngestResult.chunk_image_rows): ranges are read in parallel, so only the join knows
    # where a chunk's images start.
    "image_rows": pa.list_(pa.int64()),
    "text_only": pa.bool_(),
    "images": pa.int32(),
    "tiles": pa.int32(),
    "tokens_text": pa.int32(),
    "tokens_image": pa.int32(),
    "tokens_total": pa.int32(),
    "turn_tokens": pa.list_(pa.int32()),  # text + image tokens per turn, for truncation
    "turn_images": pa.list_(pa.int32()),
    "turn_tiles": pa.list_(pa.int32()),
    "tags_ok": pa.bool_(),  # tag groups in the text == images
    "tokenizer": pa.string(),
    # fine-tuning packs
    "tokens": pa.int64(),
    "samples": pa.int32(),
    "sample_keys": pa.list_(pa.string()),
}
# Every ledger starts with these (DESIGN.md, Ledger).
CORE_COLUMNS = ("key", "source", "row", "status", "reason")


def ledger_schema(*columns: str) -> pa.Schema:
    """A phase's ledger schema: the core columns, then the phase's declared ``columns``."""
    return pa.schema([(name, COLUMNS[name]) for name in (*CORE_COLUMNS, *columns)])


# Download and validation (and the base of every pretraining ledger).
LEDGER_SCHEMA = ledger_schema(
    *("shard", "bytes", "sha256", "offset", "length", "members"),
    *("url", "format", "http_status", "attempts", "detail", "origin"),
    *("license", "width", "height", "caption_chars", "pixel_sha256", "phash"),
    *("video", "start_s", "end_s"),
)
# Download ledgers: the base ledger, then when each row was fetched, how often, and the server's
# validators (ETag, Last-Modified) a recheck sends back. Ledgers of older runs lack them: readers
# take them as optional (``read_ledger_with``); such a row counts as fetched once, at no known time.
FETCH_FACTS = ("fetched_at", "fetches", "etag", "last_modified")
DOWNLOAD_LEDGER_SCHEMA = ledger_schema(*LEDGER_SCHEMA.names[len(CORE_COLUMNS) :], *FETCH_FACTS)
# A video source's validation ledgers: the base ledger, then the facts of each row's video.
# Only they have these columns, so an image ledger is what it was before videos came; readers
# take them as optional (``read_ledger_with``), as a ledger of an older run lacks them too.
VIDEO_FACTS = ("video_duration_s", "video_width", "video_height", "video_fps", "video_codec", "video_container")
VIDEO_LEDGER_SCHEMA = ledger_schema(*LEDGER_SCHEMA.names[len(CORE_COLUMNS) :], *VIDEO_FACTS)
# Validation ledgers judged with the privacy checks (recipe ``privacy:``) end with what they
# found and did; a ledger of an older run lacks them (read as optional, as the video facts).
PRIVACY_FACTS = ("faces", "personal_data", "privacy")
# Reshard outputs (and census tables): ledgers plus the input shard each sample came from.
RESHARD_SCHEMA = ledger_schema(*LEDGER_SCHEMA.names[len(CORE_COLUMNS) :], "input_shard")
# Precache: one row per latent sample.
PRECACHE_SCHEMA = ledger_schema("shard", "bytes", "sha256", "position", "aligned", "finite")
# Fine-tuning: records as ingest leaves them, samples after building, packs as released.
# Records and samples carry what the text privacy check found in every turn and did
# (``personal_data``, ``privacy``: as validation's PRIVACY_FACTS); older runs' lack them.
RECORD_SCHEMA = ledger_schema("detail", "id", "turns", "image_rows", "turn_images", "personal_data", "privacy")
SAMPLE_SCHEMA = ledger_schema(
    *("detail", "id", "shard", "offset", "length", "members", "text_only", "images", "tiles"),
    *("tokens_text", "tokens_image", "tokens_total", "turn_tokens", "turn_images", "turn_tiles"),
    *("tags_ok", "tokenizer", "personal_data", "privacy"),
)
PACK_SCHEMA = ledger_schema(
    "shard", "offset", "length", "members", "tokens", "images", "tiles", "samples", "sample_keys"
)


@dataclass
class LedgerRow:
    key: str
    source: str
    row: int
    reason: str | None = None
    shard: str | None = None
    bytes: int | None = None
    sha256: str | None = None
    offset: int | None = None
    length: int | None = None
    members: list[dict[str, Any]] | None = None
    url: str | None = None
    format: str | None = None
    http_status: int | None = None
    attempts: int | None = None
    detail: str | None = None
    origin: str | None = None
    license: str | None = None
    width: int | None = None
    height: int | None = None
    caption_chars: int | None = None
    pixel_sha256: str | None = None
    phash: int | None = None
    video: str | None = None
    start_s: float | None = None
    end_s: float | None = None
    status: str = field(init=False)

    def __post_init__(self) -> None:
        self.status = status_of(self.reason)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in LEDGER_SCHEMA.names}


def widened(schema: pa.Schema, rows: list[dict[str, Any]], columns: Iterable[str] = ()) -> pa.Schema:
    """``schema``, where it is the base ledger's, with the fact groups its rows carry appended:
    a video's (``VIDEO_FACTS``, rows of a video source, tasks/video/samples.py) and the privacy
    checks' (``PRIVACY_FACTS``, rows validation judged with them). The rows decide, or the
    ``columns`` of a table written with them, so that every stage writing them (validation, its
    fused download, dedup's copy, a retry's merge) keeps the facts."""
    if not schema.equals(LEDGER_SCHEMA):
        return schema
    have = set(columns)
    extra = [
        f
        for group in (VIDEO_FACTS, PRIVACY_FACTS)
        if group[0] in have or any(group[0] in r for r in rows)
        for f in group
    ]
    return ledger_schema(*LEDGER_SCHEMA.names[len(CORE_COLUMNS) :], *extra) if extra else schema


def ledger_table(rows: Iterable[LedgerRow]) -> pa.Table:
    rows = list(rows)
    return pa.Table.from_pylist([r.as_dict() for r in rows], schema=LEDGER_SCHEMA)


def write_parquet(storage: Storage, rel: str, table: pa.Table) -> None:
    """Write a table atomically as zstd parquet."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    storage.write_bytes(rel, buf.getvalue())


def read_parquet(storage: Storage, rel: str, columns: list[str] | None = None) -> pa.Table:
    with storage.open(rel, "rb") as fh:
        return read_parquet_file(fh, columns)


def read_ledger_with(storage: Storage, rel: str, columns: list[str], optional: list[str]) -> pa.Table:
    """``columns`` of a ledger, then each of ``optional`` (columns a ledger written before they
    came may lack: a reshard's carried ones, a clip's): read where the file has it, else nulls of
    its ledger type. Read as ``read_parquet_file`` reads (this thread, no pre-buffering)."""
    with storage.open(rel, "rb") as fh:
        pf = pq.ParquetFile(fh, pre_buffer=False)
        names = set(pf.schema_arrow.names)
        table = pf.read(columns=columns + [c for c in optional if c in names], use_threads=False)
    for name in optional:
        if name not in names:
            table = table.append_column(pa.field(name, COLUMNS[name]), pa.nulls(table.num_rows, COLUMNS[name]))
    return table.select(columns + optional)


def read_parquet_file(fh: Any, columns: list[str] | None = None) -> pa.Table:
    """The parquet file open as the Python file object ``fh``, read in this thread.

    Threads and pre-buffering off: pyarrow reading a Python file object from its thread pools
    (pre_buffer reads ahead on the I/O pool) can abort the interpreter at exit ("terminate
    called without an active exception"). ParquetFile, not read_table: one file needs no
    pyarrow.dataset, whose import (pandas with it) took 0.7-1.2 s of a worker's first task.
    """
    return pq.ParquetFile(fh, pre_buffer=False).read(columns=columns, use_threads=False)


def write_ledger(storage: Storage, rel: str, rows: Iterable[LedgerRow] | pa.Table) -> pa.Table:
    """Write the ledger atomically; call it after the shard it describes is in place."""
    table = rows if isinstance(rows, pa.Table) else ledger_table(rows)
    write_parquet(storage, rel, table)
    return table


def read_ledger(storage: Storage, rel: str, columns: list[str] | None = None) -> pa.Table:
    return read_parquet(storage, rel, columns)


def read_ledgers(
    storage: Storage,
    rels: list[str],
    columns: list[str] | None = None,
    missing_ok: bool = False,
    threads: int = 16,
    optional: list[str] | None = None,
) -> dict[str, pa.Table | None]:
    """Many ledgers at once (threads: on object stores each is a request); ``None`` for a
    missing one when ``missing_ok``. ``optional``: columns after ``columns`` that a ledger
    written before them may lack (nulls then, as ``read_ledger_with``)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(rel: str) -> pa.Table | None:
        try:
            if optional:
                return read_ledger_with(storage, rel, columns or [], optional)
            return read_parquet(storage, rel, columns)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise

    unique = list(dict.fromkeys(rels))
    if len(unique) <= 1:
        return {rel: one(rel) for rel in unique}
    with ThreadPoolExecutor(max_workers=min(threads, len(unique))) as pool:
        return dict(zip(unique, pool.map(one, unique)))


def read_tables(storage: Storage, rels: list[str], columns: list[str] | None = None) -> dict[str, pa.Table]:
    """``read_ledgers`` of files that must all be there (a missing one raises)."""
    return {rel: t for rel, t in read_ledgers(storage, rels, columns).items() if t is not None}


def concat_ledgers(tables: list[pa.Table | None], columns: list[str]) -> pa.Table:
    """The given columns of the tables, one after the other; an empty ledger when there are none."""
    present = [t.select(columns) for t in tables if t is not None]
    if not present:
        return pa.table({c: pa.array([], LEDGER_SCHEMA.field(c).type) for c in columns})
    return pa.concat_tables(present)


def committed(storage: Storage, rels: list[str]) -> set[str]:
    """Which of ``rels`` exist, from one listing per folder instead of one request per file."""
    import posixpath

    by_folder: dict[str, set[str]] = {}
    for rel in rels:
        by_folder.setdefault(posixpath.dirname(rel), set()).add(rel)
    out: set[str] = set()
    for folder, wanted in by_folder.items():
        names = set(storage.listdir(folder))
        out.update(rel for rel in wanted if posixpath.basename(rel) in names)
    return out


def committed_pairs(storage: Storage, pairs: list[tuple[str | None, str]]) -> set[str]:
    """The ledgers of ``pairs`` (shard, ledger) that commit a shard still stored: the ledger is
    there and so is its shard (``None``: a ledger that commits no shard). A ledger whose shard is
    gone (deleted by hand, a lifecycle rule, a lost disk) is not committed: its shard is made
    again. One listing per folder, as ``committed``."""
    present = committed(storage, [ledger for _, ledger in pairs] + [tar for tar, _ in pairs if tar])
    return {ledger for tar, ledger in pairs if ledger in present and (tar is None or tar in present)}


# The columns Counts.of reads: enough to count a ledger without loading it whole.
COUNT_COLUMNS = ["status", "reason", "bytes"]


@dataclass(frozen=True)
class Counts:
    """Per-status counts and per-reason counts of one or more ledgers."""

    rows: int
    ok: int
    rejected: int
    error: int
    by_reason: dict[str, int]
    bytes: int

    @classmethod
    def of(cls, table: pa.Table) -> Counts:
        status = table.column("status").to_pylist()
        reasons: dict[str, int] = {}
        for r in table.column("reason").to_pylist():
            if r is not None:
                reasons[r] = reasons.get(r, 0) + 1
        nbytes = (pa.compute.sum(table.column("bytes")).as_py() or 0) if "bytes" in table.column_names else 0
        return cls(
            rows=table.num_rows,
            ok=status.count(OK),
            rejected=status.count(REJECTED),
            error=status.count(ERROR),
            by_reason=dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
            bytes=int(nbytes),
        )

    def __add__(self, other: Counts) -> Counts:
        merged = dict(self.by_reason)
        for k, v in other.by_reason.items():
            merged[k] = merged.get(k, 0) + v
        return Counts(
            rows=self.rows + other.rows,
            ok=self.ok + other.ok,
            rejected=self.rejected + other.rejected,
            error=self.error + other.error,
            by_reason=dict(sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))),
            bytes=self.bytes + other.bytes,
        )

    @classmethod
    def zero(cls) -> Counts:
        return cls(0, 0, 0, 0, {}, 0)
