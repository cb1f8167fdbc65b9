"""The validation stage: license, caption and content checks per shard, then dedup across the dataset."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tasks.captions import caption_verdict
from tasks.download import ShardResult
from tasks.images import process_image
from tasks.ledger import LEDGER_SCHEMA, Counts, LedgerRow, read_ledger, read_parquet, write_ledger, write_parquet
from tasks.licenses import license_verdict
from tasks.reasons import OK, status_of
from tasks.recipe import DedupConfig, ValidateConfig
from tasks.shards import ShardError, ShardWriter, iter_samples
from tasks.sniff import EXTENSIONS
from tasks.storage import Storage

IMAGE_EXTS = frozenset(EXTENSIONS.values()) | {"jpeg", "tif"}
CANDIDATE_SCHEMA = LEDGER_SCHEMA.append(pa.field("thumbnail", pa.binary()))
# Columns the dedup pass needs from every candidate table (a few dozen bytes per sample).
DEDUP_COLUMNS = ["key", "source", "row", "status", "pixel_sha256", "phash"]


@dataclass(frozen=True)
class CandidateResult:
    """Pass 1 of one shard: accepted candidates (before dedup) and every input's verdict."""

    source: str
    index: int
    tar: str
    table: str
    counts: Counts
    seconds: float
    skipped: bool = False


def stage_hash(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def candidate_paths(dataset: str, source: str, index: int, download_tar: str, config_hash: str) -> tuple[str, str]:
    """(tar, table) of a download shard's candidates, named by that shard and the config."""
    digest = stage_hash(download_tar, config_hash)
    stem = f"{dataset}/validate/candidates/{source}/{index:06d}-{digest}"
    return stem + ".tar", stem + ".parquet"


def validate_shard(
    storage: Storage,
    source: str,
    index: int,
    download_tar: str,
    download_ledger: str,
    cfg: ValidateConfig,
    tar_rel: str,
    table_rel: str,
    thumbnails_per_reason: int = 3,
) -> CandidateResult:
    """Judge every sample of one download shard; write the accepted ones, re-encoded.

    The candidate table has a row for every sample the download accepted (the inputs of this
    phase), with its verdict, the normalised license, image size and the dedup hashes. It is
    written last and commits the shard.
    """
    start = time.perf_counter()
    if storage.exists(table_rel):
        table = read_parquet(storage, table_rel)
        return CandidateResult(source, index, tar_rel, table_rel, Counts.of(table), 0.0, skipped=True)
    expected = {r["key"]: r for r in read_ledger(storage, download_ledger).to_pylist() if r["status"] == OK}
    rows: list[dict[str, Any]] = []
    thumbs: Counter[str] = Counter()
    with storage.open(download_tar, "rb") as src, storage.atomic_writer(tar_rel) as out:
        writer = ShardWriter(out)
        for sample in iter_samples(src, path=storage.url(download_tar)):
            down = expected.pop(sample.key, None)
            if down is None:
                raise ShardError("tar_unexpected_sample", storage.url(download_tar), sample.key, "sample has no ok row in the download ledger")
            row, members = _judge(sample.key, sample.members, down, cfg, thumbs, thumbnails_per_reason)
            if members is not None:
                rec = writer.write_sample(sample.key, members)
                row.update(shard=tar_rel, offset=rec.offset, length=rec.length, members=rec.members_as_dicts())
            rows.append(row)
        writer.close()
    if expected:
        missing = ", ".join(sorted(expected)[:5])
        raise ShardError("tar_missing_sample", storage.url(download_tar), None, f"{len(expected)} ok ledger rows have no sample in the tar: {missing}")
    # Download tars hold samples in the order their fetches completed; rows in row order keep
    # the validated shard, and so every later phase, independent of that order.
    rows.sort(key=lambda r: r["row"])
    table = pa.Table.from_pylist(rows, schema=CANDIDATE_SCHEMA)
    write_parquet(storage, table_rel, table)
    return CandidateResult(source, index, tar_rel, table_rel, Counts.of(table), time.perf_counter() - start)


def _judge(
    key: str,
    members: dict[str, bytes],
    down: dict[str, Any],
    cfg: ValidateConfig,
    thumbs: Counter[str],
    thumbnails_per_reason: int,
) -> tuple[dict[str, Any], dict[str, bytes] | None]:
    """One sample's verdict: cheap checks (license, caption) before decoding the image."""
    meta = json.loads(members.get("json", b"{}"))
    image_ext = next((ext for ext in members if ext in IMAGE_EXTS), None)
    spdx, reason, detail = license_verdict(meta.get("license"), down["source"], cfg.license)
    caption, caption_reason = caption_verdict(meta.get("caption", members.get("txt", b"").decode("utf-8", "replace") or None), cfg.caption)
    if reason is None:
        reason = caption_reason
    if reason is None and image_ext is None:
        reason, detail = "not_an_image", "no image member in the sample"
    want_thumb = reason is not None and thumbs[reason] < thumbnails_per_reason
    outcome = None
    if image_ext is not None and (reason is None or want_thumb):
        # Thumbnails only for the few rejected samples the report shows; an image the rules
        # reject is decoded once more for its thumbnail (rare, and capped per reason).
        outcome = process_image(members[image_ext], cfg.image, thumbnail=want_thumb)
        if reason is None and outcome.reason is not None:
            reason, detail = outcome.reason, outcome.detail
            want_thumb = thumbs[reason] < thumbnails_per_reason
            if want_thumb:
                outcome = process_image(members[image_ext], cfg.image, thumbnail=True)
    row = LedgerRow(
        key=key,
        source=down["source"],
        row=down["row"],
        reason=reason,
        url=down["url"],
        detail=detail,
        license=spdx,
        caption_chars=len(caption) if caption else None,
    ).as_dict()
    thumbnail = None
    if outcome is not None:
        row.update(format=outcome.src_format, pixel_sha256=outcome.pixel_sha256, phash=outcome.phash, width=outcome.width, height=outcome.height)
        if reason is not None and want_thumb and outcome.thumbnail:
            thumbnail = outcome.thumbnail
            thumbs[reason] += 1
    row["thumbnail"] = thumbnail
    if reason is not None:
        return row, None
    meta.update(
        caption=caption,
        license=spdx,
        license_raw=meta.get("license"),
        width=outcome.width,
        height=outcome.height,
        orig_width=outcome.orig_width,
        orig_height=outcome.orig_height,
        src_format=outcome.src_format,
        src_sha256=meta.get("sha256"),
        pixel_sha256=outcome.pixel_sha256,
        phash=f"{outcome.phash:016x}",
        format=outcome.ext,
        bytes=len(outcome.data),
        sha256=hashlib.sha256(outcome.data).hexdigest(),
    )
    row.update(bytes=len(outcome.data), sha256=meta["sha256"])
    out = {outcome.ext: outcome.data, "json": json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")}
    if caption is not None:
        out["txt"] = caption.encode("utf-8")
    # Thumbnails of accepted samples are not kept: the report shows rejected ones.
    return row, out


def find_duplicates(tables: list[pa.Table], cfg: DedupConfig, source_order: dict[str, int]) -> dict[str, str]:
    """Map each duplicate's key to the key of the sample it duplicates, across the dataset.

    The first sample in (source order of the recipe, row) wins. Exact duplicates share the
    sha256 of their normalised pixels; near duplicates have perceptual hashes within
    ``hamming_threshold`` bits, found through band indexes: with t allowed differing bits,
    two hashes that close agree exactly on at least one of t+1 disjoint bands (pigeonhole), so
    only samples sharing a band are compared.
    """
    if not tables:
        return {}
    table = pa.concat_tables([t.select(DEDUP_COLUMNS) for t in tables])
    items = [r for r in table.to_pylist() if r["status"] == OK]
    items.sort(key=lambda r: (source_order.get(r["source"], len(source_order)), r["source"], r["row"]))
    dups: dict[str, str] = {}
    exact: dict[str, str] = {}
    t = cfg.hamming_threshold
    bands = _bands(t + 1)
    index: list[dict[int, list[tuple[int, int, str]]]] = [{} for _ in bands]
    for pos, r in enumerate(items):
        key = r["key"]
        if cfg.exact and r["pixel_sha256"] is not None:
            first = exact.get(r["pixel_sha256"])
            if first is not None:
                dups[key] = first
                continue
            exact[r["pixel_sha256"]] = key
        if cfg.near and r["phash"] is not None:
            h = r["phash"]
            # The earliest kept sample within the threshold, whichever band finds it.
            best: tuple[int, str] | None = None
            for b, (shift, mask) in enumerate(bands):
                for other_pos, other_hash, other_key in index[b].get((h >> shift) & mask, ()):
                    if (best is None or other_pos < best[0]) and (h ^ other_hash).bit_count() <= t:
                        best = (other_pos, other_key)
            if best is not None:
                dups[key] = best[1]
                continue
            for b, (shift, mask) in enumerate(bands):
                index[b].setdefault((h >> shift) & mask, []).append((pos, h, key))
    return dups


def _bands(n: int) -> list[tuple[int, int]]:
    """Split 64 bits into n disjoint bands, as (shift, mask)."""
    out = []
    start = 0
    for i in range(n):
        width = 64 // n + (1 if i < 64 % n else 0)
        out.append((start, (1 << width) - 1))
        start += width
    return out


def final_paths(dataset: str, source: str, index: int, table_rel: str, dups: dict[str, str]) -> tuple[str, str]:
    """(tar, ledger) of a validated shard, named by its candidates and its dedup decisions."""
    digest = stage_hash(table_rel, sorted(dups.items()))
    stem = f"{dataset}/validate/{source}/{index:06d}-{digest}"
    return stem + ".tar", stem + ".ledger.parquet"


def finalize_shard(
    storage: Storage,
    cand: CandidateResult,
    dups: dict[str, str],
    tar_rel: str,
    ledger_rel: str,
) -> ShardResult:
    """Copy the accepted, non-duplicate candidates' byte ranges into the validated shard."""
    start = time.perf_counter()
    if storage.exists(ledger_rel):
        counts = Counts.of(read_ledger(storage, ledger_rel))
        return ShardResult(cand.source, cand.index, tar_rel, ledger_rel, counts, 0.0, skipped=True, samples=counts.ok)
    table = read_parquet(storage, cand.table).drop_columns(["thumbnail"])
    rows = table.to_pylist()
    with storage.open(cand.tar, "rb") as src, storage.atomic_writer(tar_rel) as out:
        writer = ShardWriter(out)
        for row in rows:
            if row["status"] != OK:
                continue
            original = dups.get(row["key"])
            if original is not None:
                reason = f"duplicate_of:{original}"
                row.update(status=status_of(reason), reason=reason, shard=None, offset=None, length=None, members=None)
                continue
            src.seek(row["offset"])
            raw = src.read(row["length"])
            members = [(m["name"], m["offset"] - row["offset"], m["size"]) for m in row["members"]]
            rec = writer.copy_sample(row["key"], raw, members)
            row.update(shard=tar_rel, offset=rec.offset, members=rec.members_as_dicts())
        writer.close()
    counts = Counts.of(write_ledger(storage, ledger_rel, pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA)))
    return ShardResult(cand.source, cand.index, tar_rel, ledger_rel, counts, time.perf_counter() - start, samples=counts.ok)
