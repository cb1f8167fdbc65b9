"""The validation stage: license, caption and content checks per shard, then dedup across the dataset."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tasks.formats.ledger import (
    COUNT_COLUMNS,
    LEDGER_SCHEMA,
    Counts,
    LedgerRow,
    read_ledger,
    read_parquet,
    write_ledger,
    write_parquet,
)
from tasks.formats.manifests import chunk_name
from tasks.formats.names import digest_of
from tasks.formats.reasons import OK, status_of
from tasks.formats.recipe_download import DedupConfig, ValidateConfig
from tasks.formats.shards import ShardWriter, iter_samples
from tasks.formats.storage import Storage
from tasks.formats.tar_reader import ShardError
from tasks.policies.captions import caption_verdict
from tasks.policies.images import process_image
from tasks.policies.licenses import license_verdict
from tasks.policies.sniff import EXTENSIONS
from tasks.stages.download import ShardResult

IMAGE_EXTS = frozenset(EXTENSIONS.values()) | {"jpeg", "tif"}
# Thumbnails of a few rejected samples per reason, for the audit report, beside the ledger.
THUMBS_SCHEMA = pa.schema([("key", pa.string()), ("thumbnail", pa.binary())])
THUMBNAILS_PER_REASON = 3
# Threads that decode and re-encode images in one task: Pillow releases the GIL while it
# decodes, resizes and encodes, so they overlap each other and the fetches of a fused task.
DECODE_THREADS = max(
    1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
)
# Columns the dedup pass needs from every candidate table (a few dozen bytes per sample).
DEDUP_COLUMNS = ["key", "source", "row", "status", "pixel_sha256", "phash"]


@dataclass(frozen=True)
class CandidateResult:
    """Pass 1 of one shard: accepted candidates (before dedup) and every input's verdict.

    ``table`` is a ledger (LEDGER_SCHEMA): a shard whose candidates dedup leaves alone is
    final as it is, with no second copy.
    """

    source: str
    index: int
    tar: str
    table: str
    counts: Counts
    seconds: float
    skipped: bool = False


def stage_hash(*parts: Any) -> str:
    return digest_of(*parts)


def candidate_config_hash(recipe: Any) -> str:
    """Hash of the validation settings that change what a candidate shard holds (dedup decides later)."""
    cfg = recipe.validate_
    return recipe.config_hash(cfg.license, cfg.image, cfg.caption)


def candidate_paths(dataset: str, source: str, index: int, download_tar: str, config_hash: str) -> tuple[str, str]:
    """(tar, ledger) of a download shard's candidates, named by that shard and the config."""
    digest = stage_hash(download_tar, config_hash)
    stem = f"{dataset}/validate/candidates/{source}/{chunk_name(index)}-{digest}"
    return stem + ".tar", stem + ".ledger.parquet"


def thumbs_path(ledger_rel: str) -> str:
    """Where a candidate ledger's thumbnails are (written before it, only when there are any)."""
    return ledger_rel[: -len(".ledger.parquet")] + ".thumbs.parquet"


class Judge:
    """One sample's verdict (license, caption, image), safe to call from several threads.

    Args:
        cfg: the recipe's validation config.
        thumbnails_per_reason: rejected samples per reason that get a thumbnail for the report.
    """

    def __init__(self, cfg: ValidateConfig, thumbnails_per_reason: int = THUMBNAILS_PER_REASON):
        self.cfg = cfg
        self.limit = thumbnails_per_reason
        self._thumbs: Counter[str] = Counter()
        self._lock = threading.Lock()

    def want_thumbnail(self, reason: str) -> bool:
        with self._lock:
            return self._thumbs[reason] < self.limit

    def took_thumbnail(self, reason: str) -> bool:
        """Count one thumbnail for ``reason``; False when the cap was reached meanwhile."""
        with self._lock:
            if self._thumbs[reason] >= self.limit:
                return False
            self._thumbs[reason] += 1
            return True

    def __call__(self, key: str, members: dict[str, bytes], down: dict[str, Any]) -> Judged:
        row, out, thumbnail = _judge(key, members, down, self)
        return Judged(key, row, out, thumbnail)


@dataclass
class Judged:
    """A judged sample: its ledger row, and its re-encoded members when accepted."""

    key: str
    row: dict[str, Any]
    members: dict[str, bytes] | None
    thumbnail: bytes | None


class CandidateShard:
    """Writes one shard's candidates: accepted samples as they come, then thumbnails, then the ledger.

    Args:
        storage: the storage root.
        tar_rel, ledger_rel: the candidate shard and its ledger (the ledger commits it).
        out: the open atomic writer of ``tar_rel``.
    """

    def __init__(self, storage: Storage, tar_rel: str, ledger_rel: str, out: Any):
        self.storage, self.tar_rel, self.ledger_rel = storage, tar_rel, ledger_rel
        self.writer = ShardWriter(out)
        self.rows: list[dict[str, Any]] = []
        self.thumbs: list[tuple[str, bytes]] = []

    def add(self, judged: Judged) -> None:
        if judged.members is not None:
            rec = self.writer.write_sample(judged.key, judged.members)
            judged.row.update(shard=self.tar_rel, offset=rec.offset, length=rec.length, members=rec.members_as_dicts())
        if judged.thumbnail is not None:
            self.thumbs.append((judged.key, judged.thumbnail))
        self.rows.append(judged.row)

    def close_tar(self) -> None:
        self.writer.close()

    def commit(self) -> Counts:
        """Thumbnails, then the ledger in row order (the tar holds samples in the order they
        were judged; rows in row order keep every later phase independent of that order)."""
        if self.thumbs:
            self.thumbs.sort()
            keys, blobs = zip(*self.thumbs)
            write_parquet(
                self.storage, thumbs_path(self.ledger_rel), pa.table([list(keys), list(blobs)], schema=THUMBS_SCHEMA)
            )
        self.rows.sort(key=lambda r: r["row"])
        return Counts.of(
            write_ledger(self.storage, self.ledger_rel, pa.Table.from_pylist(self.rows, schema=LEDGER_SCHEMA))
        )


class JudgePool:
    """Judges samples on ``threads`` threads, at most two per thread in flight (bounded memory).

    ``submit`` returns the samples judged so far, in the order they finished; ``drain`` the rest.
    """

    def __init__(self, judge: Judge, threads: int = DECODE_THREADS):
        self.judge = judge
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="judge")
        self.limit = 2 * threads
        self.pending: set[Future] = set()

    def submit(self, key: str, members: dict[str, bytes], down: dict[str, Any]) -> Iterator[Judged]:
        while len(self.pending) >= self.limit:
            yield from self._finished(FIRST_COMPLETED)
        self.pending.add(self.pool.submit(self.judge, key, members, down))
        yield from self._finished(None, block=False)

    def drain(self) -> Iterator[Judged]:
        while self.pending:
            yield from self._finished(FIRST_COMPLETED)

    def _finished(self, when: str | None, block: bool = True) -> Iterator[Judged]:
        done = {f for f in self.pending if f.done()} if not block else wait(self.pending, return_when=when).done
        for fut in done:
            self.pending.discard(fut)
            yield fut.result()

    def __enter__(self) -> JudgePool:
        return self

    def __exit__(self, *exc: object) -> None:
        for fut in self.pending:
            fut.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)


def validate_shard(
    storage: Storage,
    source: str,
    index: int,
    download_tar: str,
    download_ledger: str,
    cfg: ValidateConfig,
    tar_rel: str,
    table_rel: str,
    thumbnails_per_reason: int = THUMBNAILS_PER_REASON,
) -> CandidateResult:
    """Judge every sample of one download shard; write the accepted ones, re-encoded.

    The candidate ledger has a row for every sample the download accepted (the inputs of this
    phase), with its verdict, the normalised license, image size and the dedup hashes. It is
    written last and commits the shard. Samples are judged on a few threads while the tar is
    read.
    """
    start = time.perf_counter()
    if storage.exists(table_rel):
        return CandidateResult(
            source,
            index,
            tar_rel,
            table_rel,
            Counts.of(read_ledger(storage, table_rel, COUNT_COLUMNS)),
            0.0,
            skipped=True,
        )
    expected = {r["key"]: r for r in read_ledger(storage, download_ledger).to_pylist() if r["status"] == OK}
    with (
        storage.open(download_tar, "rb") as src,
        storage.atomic_writer(tar_rel) as out,
        JudgePool(Judge(cfg, thumbnails_per_reason)) as pool,
    ):
        shard = CandidateShard(storage, tar_rel, table_rel, out)
        for sample in iter_samples(src, path=storage.url(download_tar)):
            down = expected.pop(sample.key, None)
            if down is None:
                raise ShardError(
                    "tar_unexpected_sample",
                    storage.url(download_tar),
                    sample.key,
                    "sample has no ok row in the download ledger",
                )
            for judged in pool.submit(sample.key, sample.members, down):
                shard.add(judged)
        for judged in pool.drain():
            shard.add(judged)
        shard.close_tar()
    if expected:
        missing = ", ".join(sorted(expected)[:5])
        raise ShardError(
            "tar_missing_sample",
            storage.url(download_tar),
            None,
            f"{len(expected)} ok ledger rows have no sample in the tar: {missing}",
        )
    counts = shard.commit()
    return CandidateResult(source, index, tar_rel, table_rel, counts, time.perf_counter() - start)


def _judge(
    key: str, members: dict[str, bytes], down: dict[str, Any], judge: Judge
) -> tuple[dict[str, Any], dict[str, bytes] | None, bytes | None]:
    """One sample's (ledger row, re-encoded members or None, thumbnail or None).

    Cheap checks (license, caption) come before decoding the image.
    """
    cfg = judge.cfg
    meta = json.loads(members.get("json", b"{}"))
    image_ext = next((ext for ext in members if ext in IMAGE_EXTS), None)
    spdx, reason, detail = license_verdict(meta.get("license"), down["source"], cfg.license)
    caption, caption_reason = caption_verdict(
        meta.get("caption", members.get("txt", b"").decode("utf-8", "replace") or None), cfg.caption
    )
    if reason is None:
        reason, detail = (
            caption_reason,
            (detail if caption_reason is None else _caption_detail(caption_reason, caption, cfg)),
        )
    if reason is None and image_ext is None:
        reason, detail = "not_an_image", f"no image member in the sample (members: {', '.join(sorted(members))})"
    want_thumb = reason is not None and judge.want_thumbnail(reason)
    outcome = None
    if image_ext is not None and (reason is None or want_thumb):
        # Thumbnails only for the few rejected samples the report shows; an image the rules
        # reject is decoded once more for its thumbnail (rare, and capped per reason).
        outcome = process_image(members[image_ext], cfg.image, thumbnail=want_thumb)
        if reason is None and outcome.reason is not None:
            reason, detail = outcome.reason, outcome.detail
            want_thumb = judge.want_thumbnail(reason)
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
        origin=down.get("origin"),
    ).as_dict()
    thumbnail = None
    if outcome is not None:
        row.update(
            format=outcome.src_format,
            pixel_sha256=outcome.pixel_sha256,
            phash=outcome.phash,
            width=outcome.width,
            height=outcome.height,
        )
        if reason is not None and want_thumb and outcome.thumbnail and judge.took_thumbnail(reason):
            thumbnail = outcome.thumbnail
    if reason is not None:
        return row, None, thumbnail
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
    return row, out, None


def _caption_detail(reason: str, caption: str | None, cfg: ValidateConfig) -> str:
    """What a person needs to see about a rejected caption: its length against the bound."""
    rules = cfg.caption
    n = len(caption) if caption else 0
    if reason == "caption_too_long":
        return f"{n} characters > max_chars {rules.max_chars}"
    if reason == "caption_too_short":
        return f"{n} characters, {len(caption.split()) if caption else 0} words (min_chars {rules.min_chars}, min_words {rules.min_words})"
    if reason == "caption_missing":
        return "no caption after cleanup"
    return f"{n} characters"


def duplicates_by_table(
    storage: Storage, tables: list[str], cfg: DedupConfig, source_order: dict[str, int]
) -> dict[str, dict[str, str]]:
    """``find_duplicates`` over candidate ledgers, grouped by the ledger each duplicate is in."""
    loaded = [read_parquet(storage, t, DEDUP_COLUMNS) for t in tables]
    dups = find_duplicates(loaded, cfg, source_order)
    grouped: dict[str, dict[str, str]] = {}
    for name, table in zip(tables, loaded):
        mine = {k: dups[k] for k in table.column("key").to_pylist() if k in dups}
        if mine:
            grouped[name] = mine
    return grouped


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


def final_paths(dataset: str, source: str, index: int, cand: CandidateResult, dups: dict[str, str]) -> tuple[str, str]:
    """(tar, ledger) of a validated shard, named by its candidates and its dedup decisions.

    A shard that dedup leaves alone is its candidates, as written: no second copy.
    """
    if not dups:
        return cand.tar, cand.table
    digest = stage_hash(cand.table, sorted(dups.items()))
    stem = f"{dataset}/validate/{source}/{chunk_name(index)}-{digest}"
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
    if not dups:
        return ShardResult(
            cand.source, cand.index, cand.tar, cand.table, cand.counts, 0.0, skipped=True, samples=cand.counts.ok
        )
    if storage.exists(ledger_rel):
        counts = Counts.of(read_ledger(storage, ledger_rel, COUNT_COLUMNS))
        return ShardResult(cand.source, cand.index, tar_rel, ledger_rel, counts, 0.0, skipped=True, samples=counts.ok)
    rows = read_ledger(storage, cand.table).to_pylist()
    with storage.open(cand.tar, "rb") as src, storage.atomic_writer(tar_rel) as out:
        writer = ShardWriter(out)
        # Copied in tar order (sequential reads); the ledger keeps row order.
        for row in sorted((r for r in rows if r["status"] == OK), key=lambda r: r["offset"]):
            original = dups.get(row["key"])
            if original is not None:
                reason = f"duplicate_of:{original}"
                row.update(
                    status=status_of(reason),
                    reason=reason,
                    detail=f"duplicate of {original}",
                    shard=None,
                    offset=None,
                    length=None,
                    members=None,
                )
                continue
            src.seek(row["offset"])
            raw = src.read(row["length"])
            members = [(m["name"], m["offset"] - row["offset"], m["size"]) for m in row["members"]]
            rec = writer.copy_sample(row["key"], raw, members)
            row.update(shard=tar_rel, offset=rec.offset, members=rec.members_as_dicts())
        writer.close()
    counts = Counts.of(write_ledger(storage, ledger_rel, pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA)))
    return ShardResult(
        cand.source, cand.index, tar_rel, ledger_rel, counts, time.perf_counter() - start, samples=counts.ok
    )
