"""Fine-tuning ingest: a records file planned in byte ranges, read and checked by parallel tasks, joined."""

from __future__ import annotations

import hashlib
import json
import posixpath
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import pyarrow as pa

from tasks.finetune.conversations import check_conversation, private_turns, resolve_image
from tasks.finetune.records import (
    BLOCK,
    RawRecord,
    RecordsError,
    byte_ranges,
    iter_lines,
    iter_records,
    jsonl_records,
    range_lines,
    read_blocks,
    records_format,
    splittable,
)
from tasks.finetune.samples import STAGE_VERSION
from tasks.finetune.tiling import all_tags
from tasks.formats.ledger import RECORD_SCHEMA, write_parquet
from tasks.formats.names import digest_of
from tasks.formats.reasons import status_of
from tasks.formats.recipe_download import SourceConfig
from tasks.formats.recipe_finetune import ConversationRules, FinetuneConfig
from tasks.formats.storage import Storage


@dataclass
class IngestResult:
    """One records file read and checked.

    Args:
        source: the source name.
        sha256: of the records file bytes (as stored, before decompression).
        rows: records read (every one is a ledger row in the end).
        chunks: record chunk tables (at most ``rows_per_shard`` records each), in row order.
        chunk_image_rows: per chunk, the (first, last + 1) image manifest rows it refers to.
        image_manifest: the derived JSONL image manifest (``None`` without images).
        image_rows: rows in it.
        ranges: byte ranges the file was read in (one task each).
    """

    source: str
    sha256: str
    rows: int
    chunks: list[str] = field(default_factory=list)
    chunk_image_rows: list[tuple[int, int]] = field(default_factory=list)
    image_manifest: str | None = None
    image_rows: int = 0
    ranges: int = 1


@dataclass(frozen=True)
class RecordRange:
    """One task's share of a records file.

    Args:
        index: its place among the file's ranges.
        start, end: its bytes ``[start, end)``: it reads the lines that start there, the last
            one through its newline. ``end`` None: the whole file, read by this task alone (a
            JSON array or a gzip file, which cannot be entered in the middle).
        first_row: the row of its first record.
        records: records the plan counted in it (None for a file read whole).
    """

    index: int
    start: int
    end: int | None
    first_row: int
    records: int | None


@dataclass
class IngestPlan:
    """A source's ingest: its file's hash and size, where outputs go, and the ranges to read.

    Args:
        source: the source.
        sha256, bytes: of the records file as stored.
        base: the output folder, named by a hash of the file, the rules and the stage version.
        ranges: one task each.
        done: the result of an earlier run over the same bytes and rules (nothing to read).
    """

    source: SourceConfig
    sha256: str
    bytes: int
    base: str
    ranges: list[RecordRange]
    done: IngestResult | None = None


@dataclass
class RangeResult:
    """What one range task wrote: its chunk tables, their image counts, its image manifest part."""

    index: int
    rows: int
    chunks: list[str]
    chunk_images: list[int]
    images: str
    image_rows: int


def _scheme(manifest: str) -> str:
    return manifest.split("://", 1)[0].lower() if "://" in manifest else ""


def _open(source: SourceConfig, options: dict[str, Any]) -> IO[bytes]:
    import fsspec

    scheme = _scheme(source.manifest)
    # http(s): one streaming GET (block_size=0), since not every server answers range requests.
    kwargs = {"block_size": 0} if scheme in ("http", "https") else options if scheme not in ("", "file") else {}
    return fsspec.open(source.manifest, "rb", **kwargs).open()


def reserved_tags(cfg: FinetuneConfig) -> tuple[str, ...]:
    """The tiler's tags a turn may not hold (``conversation_reserved_tag``): none empty, and
    never the image placeholder itself."""
    return tuple(t for t in dict.fromkeys(all_tags(cfg.tiling)) if t and t != cfg.conversation.placeholder)


def plan_ingest(
    storage: Storage, dataset: str, source: SourceConfig, cfg: FinetuneConfig, options: dict[str, Any]
) -> IngestPlan:
    """Hash the records file and, for plain JSONL, count the records in each byte range.

    One sequential pass: every range's first row is then known before any range is read, so
    keys (``{source}-{row:09d}``) are final where they are written. A rerun over the same bytes
    and rules returns the earlier result as ``done``.
    """
    rules = cfg.conversation
    records_format(source.manifest)  # a name that is neither JSON nor JSONL fails here
    split = splittable(source.manifest) and _scheme(source.manifest) not in ("http", "https")
    sha = hashlib.sha256()
    size = 0
    counts: dict[int, int] = {}

    def hashed(fh: IO[bytes]) -> Iterator[bytes]:
        nonlocal size
        for block in read_blocks(fh):
            sha.update(block)
            size += len(block)
            yield block

    with _open(source, options) as fh:
        blocks = hashed(fh)
        if split:
            for line in iter_lines(blocks, 0, None, rules.max_record_bytes):
                k = line.offset // rules.range_bytes
                counts[k] = counts.get(k, 0) + 1
        for _ in blocks:  # JSON and gzip files: the hash only
            pass
    digest = digest_of(
        sha.hexdigest(), rules.model_dump(mode="json"), reserved_tags(cfg), source.rows_per_shard, STAGE_VERSION
    )
    base = f"{dataset}/finetune/records/{source.name}/{digest}"
    ranges = [RecordRange(0, 0, None, 0, None)]
    if split:
        ranges, first = [], 0
        for k, (start, end) in enumerate(byte_ranges(size, rules.range_bytes)):
            ranges.append(RecordRange(k, start, end, first, counts.get(k, 0)))
            first += counts.get(k, 0)
    plan = IngestPlan(source, sha.hexdigest(), size, base, ranges)
    if storage.exists(f"{base}/ingest.json"):
        data = json.loads(storage.read_bytes(f"{base}/ingest.json"))
        data["chunk_image_rows"] = [tuple(x) for x in data["chunk_image_rows"]]
        plan.done = IngestResult(**data)
    return plan


def ingest_range(
    storage: Storage, plan: IngestPlan, part: RecordRange, cfg: FinetuneConfig, options: dict[str, Any]
) -> RangeResult:
    """Read one range's records, check each conversation, write its chunk tables and image rows.

    Memory holds one chunk of rows, whatever the range's size. A range whose record count
    differs from the plan's (the file changed after it was planned) raises before it commits.
    """
    marker = f"{plan.base}/{part.index:05d}.json"
    if storage.exists(marker):
        return RangeResult(**json.loads(storage.read_bytes(marker)))
    rules = cfg.conversation
    cap = rules.max_record_bytes
    manifest = plan.source.manifest
    with _open(plan.source, options) as fh:
        if part.end is None:
            raws = iter_records(fh, manifest, cap)
        else:
            raws = jsonl_records(range_lines(fh, part.start, part.end, cap), part.first_row, cap)
        result = _write_range(storage, plan, part, raws, rules, reserved_tags(cfg))
    if part.records is not None and result.rows != part.records:
        raise RecordsError(
            f"{manifest}: bytes {part.start}..{part.end} hold {result.rows} records, the plan counted {part.records}: the file changed while it was read"
        )
    storage.write_bytes(marker, json.dumps(asdict(result)).encode())
    return result


def _write_range(
    storage: Storage,
    plan: IngestPlan,
    part: RecordRange,
    raws: Iterable[RawRecord],
    rules: ConversationRules,
    reserved: tuple[str, ...],
) -> RangeResult:
    source = plan.source
    root = rules.image_root or (posixpath.dirname(source.manifest) if "/" in source.manifest else ".")
    result = RangeResult(part.index, 0, [], [], f"{plan.base}/{part.index:05d}-images.jsonl", 0)
    rows: list[dict[str, Any]] = []
    images = 0  # image rows of the current chunk

    def flush() -> None:
        nonlocal rows, images
        rel = f"{plan.base}/{part.index:05d}-{len(result.chunks):06d}.parquet"
        write_parquet(storage, rel, pa.Table.from_pylist(rows, schema=RECORD_SCHEMA))
        result.chunks.append(rel)
        result.chunk_images.append(images)
        result.image_rows += images
        rows, images = [], 0

    with storage.atomic_writer(result.images) as image_out:
        for raw in raws:
            key = f"{source.name}-{raw.row:09d}"
            # Only what is known so far: RECORD_SCHEMA fills the columns a row leaves out with nulls.
            out: dict[str, Any] = {
                "key": key,
                "source": source.name,
                "row": raw.row,
                "reason": raw.reason,
                "detail": raw.detail,
            }
            if raw.reason is None:
                conv = private_turns(check_conversation(raw.record, rules, reserved), rules.privacy)
                out.update(
                    reason=conv.reason,
                    detail=conv.detail,
                    id=conv.id,
                    personal_data=conv.personal_data,
                    privacy="redacted" if conv.redacted else None,
                )
                if conv.ok:
                    lines = [
                        {
                            "url": resolve_image(ref, root),
                            "caption": text,
                            "license": conv.license or rules.license,
                            "record": key,
                        }
                        for ref, text in zip(conv.images, conv.image_texts(rules.placeholder))
                    ]
                    image_out.write(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in lines))
                    out.update(
                        turns=json.dumps(conv.turns, ensure_ascii=False),
                        image_rows=list(range(images, images + len(lines))),
                        turn_images=conv.turn_images,
                    )
                    images += len(lines)
            out["status"] = status_of(out["reason"])
            rows.append(out)
            result.rows += 1
            if len(rows) == source.rows_per_shard:
                flush()
        if rows:
            flush()
    return result


def finish_ingest(storage: Storage, plan: IngestPlan, parts: list[RangeResult]) -> IngestResult:
    """Join the ranges in order: chunks with their global image rows, one image manifest."""
    parts = sorted(parts, key=lambda p: p.index)
    if [p.index for p in parts] != [r.index for r in plan.ranges]:
        raise ValueError(f"{plan.source.name}: ranges {[p.index for p in parts]} read, the plan has {len(plan.ranges)}")
    result = IngestResult(plan.source.name, plan.sha256, sum(p.rows for p in parts), ranges=len(parts))
    first = 0
    for p in parts:
        for chunk, n in zip(p.chunks, p.chunk_images):
            result.chunks.append(chunk)
            result.chunk_image_rows.append((first, first + n))
            first += n
    if not result.chunks:  # no records: one empty chunk, so every later phase sees the source
        rel = f"{plan.base}/empty.parquet"
        write_parquet(storage, rel, RECORD_SCHEMA.empty_table())
        result.chunks, result.chunk_image_rows = [rel], [(0, 0)]
    if first:
        rel = f"{plan.base}/images.jsonl"
        with storage.atomic_writer(rel) as out:
            for p in parts:
                if p.image_rows:
                    with storage.open(p.images, "rb") as fh:
                        shutil.copyfileobj(fh, out, BLOCK)
        result.image_manifest, result.image_rows = rel, first
    storage.write_bytes(f"{plan.base}/ingest.json", json.dumps(asdict(result)).encode())
    return result


def ingest_source(
    storage: Storage, dataset: str, source: SourceConfig, cfg: FinetuneConfig, options: dict[str, Any]
) -> IngestResult:
    """Plan, read every range and join, in this process (the flow runs the ranges in parallel)."""
    plan = plan_ingest(storage, dataset, source, cfg, options)
    if plan.done is not None:
        return plan.done
    return finish_ingest(storage, plan, [ingest_range(storage, plan, r, cfg, options) for r in plan.ranges])
