"""Download and validation of one manifest chunk in one pass: fetches overlap decoding, both shards written once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tasks.formats.ledger import Counts
from tasks.formats.manifests import ChunkRef
from tasks.formats.reasons import OK
from tasks.formats.recipe_download import DownloadConfig, ValidateConfig
from tasks.formats.storage import Storage
from tasks.stages.download import check_every_row_once, download_verdict, failed_row, fetched_rows
from tasks.stages.runner import DecidePool, ShardResult, ShardRun, committed_shard, decided
from tasks.stages.validate import DECODE_THREADS, Judge, validate_shard
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
) -> tuple[ShardResult, ShardResult]:
    """Fetch a chunk's rows and judge each fetched sample as it arrives, on a few threads.

    Writes what the two phases would write one after the other, from the same bytes: the raw
    download shard and its ledger (``download``: tar, ledger), so a later policy change
    re-validates without fetching again, and the candidate shard and its ledger
    (``candidates``: tar, ledger). Commit order: both tars, the candidate ledger, then the
    download ledger, whose presence therefore means both are done. A chunk whose download is
    committed but not its candidates (``--phase download`` ran before, or the validation
    config changed) is validated from the raw shard; one with both is skipped. ``rows_from``:
    as for ``tasks.stages.download.download_shard`` (an ingest source's rows instead of fetches).
    """
    start = time.perf_counter()
    (tar_rel, ledger_rel), (cand_tar, cand_ledger) = download, candidates
    got = committed_shard(storage, tar_rel, ledger_rel, ref.source, ref.index)
    if got is not None:
        cand = validate_shard(storage, ref.source, ref.index, tar_rel, ledger_rel, vcfg, cand_tar, cand_ledger)
        return got, cand
    rows, results = (rows_from or fetched_rows)(ref, storage, dcfg, s3_options)
    raw, shard, judge = ShardRun(storage, tar_rel, ledger_rel), ShardRun(storage, cand_tar, cand_ledger), Judge(vcfg)
    with raw.writing(), shard.writing(), DecidePool(judge, DECODE_THREADS, failed_judge) as pool:
        for row, fetched in results:
            verdict = decided(lambda got: download_verdict(*got, ref.source), (row, fetched), _failed(ref.source))
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


def _failed(source: str) -> Any:
    return lambda got, err: failed_row(got[0], source, err)
