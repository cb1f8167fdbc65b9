"""Download and validation of one manifest chunk in one pass: fetches overlap decoding, both shards written once."""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from tasks.formats import clock
from tasks.formats.ledger import DOWNLOAD_LEDGER_SCHEMA, Counts
from tasks.formats.manifests import ChunkRef
from tasks.formats.reasons import OK
from tasks.formats.recipe_download import DownloadConfig, ValidateConfig
from tasks.formats.storage import Storage
from tasks.stages.download import (
    check_every_row_once,
    download_config_hash,
    download_verdict,
    failed_row,
    fetched_rows,
    shard_paths,
)
from tasks.stages.retry import current_versions, list_folders
from tasks.stages.runner import DecidePool, LedgerRun, ShardResult, ShardRun, committed_shard, decided
from tasks.stages.validate import DECODE_THREADS, Judge, candidate_config_hash, candidate_paths, validate_shard
from tasks.stages.validate import failed_row as failed_judge


def download_and_validate(
    ref: ChunkRef,
    storage: Storage,
    dcfg: DownloadConfig,
    vcfg: ValidateConfig,
    download: tuple[str, str],
    candidates: tuple[str, str],
    s3_options: dict[str, Any] | None = None,
    rows_from: Callable[..., Any] | None = None,
    now: datetime | None = None,
) -> tuple[ShardResult, ShardResult]:
    """Fetch a chunk's rows and judge each fetched sample as it arrives, on a few threads.

    Writes what the two phases would write one after the other, from the same bytes: the raw
    download shard and its ledger (``download``: tar, ledger), so a later policy change
    re-validates without fetching again, and the candidate shard and its ledger
    (``candidates``: tar, ledger); with ``dcfg.keep_raw`` false, the download ledger only (its
    ok rows name no shard). Commit order: both tars, the candidate ledger, then the
    download ledger, whose presence therefore means both are done. A chunk whose download is
    committed but not its candidates (``--phase download`` ran before, or the validation
    config changed) is validated from the raw shard; one with both is skipped. ``rows_from``:
    as for ``tasks.stages.download.download_shard`` (an ingest source's rows instead of fetches);
    ``now``: the run's time, which the download ledger records as each row's ``fetched_at``.
    """
    start = time.perf_counter()
    at = now or clock.now()
    (tar_rel, ledger_rel), (cand_tar, cand_ledger) = download, candidates
    # A download whose raw shard is there is validated from it; one whose raw shard is gone (or
    # never kept: download.keep_raw false) cannot make candidates again, so it is fetched again.
    got = committed_shard(storage, tar_rel, ledger_rel, ref.source, ref.index)
    if got is not None:
        cand = validate_shard(
            storage,
            ref.source,
            ref.index,
            tar_rel,
            ledger_rel,
            vcfg,
            cand_tar,
            cand_ledger,
            max_member_bytes=dcfg.max_bytes,
        )
        return got, cand
    rows, results = (rows_from or fetched_rows)(ref, storage, dcfg, s3_options)
    raw = (ShardRun if dcfg.keep_raw else LedgerRun)(storage, tar_rel, ledger_rel, DOWNLOAD_LEDGER_SCHEMA)
    shard, judge = ShardRun(storage, cand_tar, cand_ledger), Judge(vcfg)
    with raw.writing(), shard.writing(), DecidePool(judge, DECODE_THREADS, failed_judge) as pool:
        for row, fetched in results:
            verdict = decided(
                lambda got: download_verdict(*got, ref.source, at), (row, fetched), _failed(ref.source, at)
            )
            raw.add(verdict)
            entry = verdict.row
            if entry["status"] != OK:
                continue
            down = {"source": ref.source, "row": entry["row"], "url": entry["url"], "origin": entry["origin"]}
            for judged in pool.submit((entry["key"], verdict.members, down)):
                shard.add(judged)
        for judged in pool.drain():
            shard.add(judged)
        check_every_row_once(rows, raw.rows, tar_rel)
    judge.write_thumbs(storage, cand_ledger)
    cand_counts = Counts.of(shard.commit())
    counts = Counts.of(raw.commit())
    seconds = time.perf_counter() - start
    return (
        ShardResult(ref.source, ref.index, tar_rel, ledger_rel, counts, seconds, samples=counts.ok),
        ShardResult(ref.source, ref.index, cand_tar, cand_ledger, cand_counts, seconds, samples=cand_counts.ok),
    )


Paths = tuple[tuple[str, str], tuple[str, str]]


def chunk_paths(recipe: Any, storage: Storage, refs: list[ChunkRef]) -> dict[ChunkRef, Paths]:
    """Each chunk's download (tar, ledger) and candidates (tar, ledger), named by content and settings.

    A download is named by the chunk and the download settings, so that new validation
    settings judge its raw shard again. Without raw shards (``download.keep_raw: false``) a
    download is only good for the validation it was judged with, and is named by those
    settings too; except that a chunk whose download an earlier run committed with its raw
    shard keeps that one (validated from it, not fetched again).

    The download is the chunk's current version: the committed retry version of the highest
    generation (``tasks.stages.retry``: the rows that failed for a passing reason, fetched
    again), else the base; its candidates are named by its tar as any download's. One listing
    of each source's download folder finds them all.
    """
    dataset, chash, vhash = recipe.dataset, download_config_hash(recipe), candidate_config_hash(recipe)
    raw = {ref: shard_paths(dataset, ref, chash) for ref in refs}
    listed = list_folders(storage, [ledger for _, ledger in raw.values()])
    lean: set[ChunkRef] = set()
    if recipe.download.keep_raw:
        base = raw
    else:
        lean_hash = f"{chash}:judged:{vhash}"
        kept = {ref for ref in refs if posixpath.basename(raw[ref][1]) in listed[posixpath.dirname(raw[ref][1])]}
        lean = set(refs) - kept
        base = {ref: raw[ref] if ref in kept else shard_paths(dataset, ref, lean_hash) for ref in refs}
    down = current_versions(base, listed, lean)
    return {ref: (down[ref], candidate_paths(dataset, ref.source, ref.index, down[ref][0], vhash)) for ref in refs}


def _failed(source: str, at: datetime) -> Any:
    return lambda got, err: failed_row(got[0], source, err, at)
