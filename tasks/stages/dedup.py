"""Dedup across a dataset's candidates: exact and near duplicates found, then each shard rewritten without them."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from tasks.formats.ledger import read_ledger, read_parquet
from tasks.formats.manifests import chunk_name
from tasks.formats.names import digest_of
from tasks.formats.reasons import OK, duplicate_of, status_of
from tasks.formats.recipe_download import DedupConfig
from tasks.formats.storage import Storage
from tasks.stages.runner import ShardResult, Verdict, run_shard

# Columns the dedup pass needs from every candidate table (a few dozen bytes per sample).
DEDUP_COLUMNS = ["key", "source", "row", "status", "pixel_sha256", "phash"]


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


def final_paths(dataset: str, source: str, index: int, cand: ShardResult, dups: dict[str, str]) -> tuple[str, str]:
    """(tar, ledger) of a validated shard, named by its candidates and its dedup decisions.

    A shard that dedup leaves alone is its candidates, as written: no second copy.
    """
    if not dups:
        return cand.tar, cand.table
    digest = digest_of(cand.table, sorted(dups.items()))
    stem = f"{dataset}/validate/{source}/{chunk_name(index)}-{digest}"
    return stem + ".tar", stem + ".ledger.parquet"


def finalize_shard(
    storage: Storage,
    cand: ShardResult,
    dups: dict[str, str],
    tar_rel: str,
    ledger_rel: str,
) -> ShardResult:
    """Copy the accepted, non-duplicate candidates' byte ranges into the validated shard."""
    if not dups:
        return ShardResult(
            cand.source, cand.index, cand.tar, cand.table, cand.counts, 0.0, skipped=True, samples=cand.ok
        )

    def candidates() -> Any:
        rows = read_ledger(storage, cand.table).to_pylist()
        yield from ((row, None) for row in rows if row["status"] != OK)
        with storage.open(cand.tar, "rb") as src:
            # Copied in tar order (sequential reads); the ledger keeps row order.
            yield from ((row, src) for row in sorted((r for r in rows if r["status"] == OK), key=lambda r: r["offset"]))

    return run_shard(
        storage,
        tar_rel,
        ledger_rel,
        candidates,
        lambda item: _kept(item[0], item[1], dups),
        source=cand.source,
        index=cand.index,
    )


def _kept(row: dict[str, Any], src: Any, dups: dict[str, str]) -> Verdict:
    """A candidate's verdict after dedup: a duplicate's row says of which, a kept one is copied as it was."""
    if src is None:
        return Verdict(row)
    original = dups.get(row["key"])
    if original is not None:
        reason = duplicate_of(original)
        row.update(
            status=status_of(reason),
            reason=reason,
            detail=f"duplicate of {original}",
            shard=None,
            offset=None,
            length=None,
            members=None,
        )
        return Verdict(row)
    src.seek(row["offset"])
    raw = src.read(row["length"])
    return Verdict(row, copy=(raw, [(m["name"], m["offset"] - row["offset"], m["size"]) for m in row["members"]]))
