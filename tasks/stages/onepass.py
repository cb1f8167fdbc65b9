"""Download and validation of one manifest chunk in one pass: fetches overlap decoding, both shards written once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tasks.formats.ledger import COUNT_COLUMNS, Counts, LedgerRow, read_ledger, write_ledger
from tasks.formats.manifests import ChunkRef
from tasks.formats.reasons import OK
from tasks.formats.recipe_download import DownloadConfig, ValidateConfig
from tasks.formats.shards import ShardWriter
from tasks.formats.storage import Storage
from tasks.stages.download import ShardResult, check_every_row_once, fetched_rows, record_row
from tasks.stages.validate import CandidateResult, CandidateShard, Judge, JudgePool, validate_shard


def download_and_validate(
    ref: ChunkRef,
    storage: Storage,
    dcfg: DownloadConfig,
    vcfg: ValidateConfig,
    download: tuple[str, str],
    candidates: tuple[str, str],
    s3_options: dict[str, Any] | None = None,
    rows_from: Callable[..., Any] | None = None,
) -> tuple[ShardResult, CandidateResult]:
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
    if storage.exists(ledger_rel):
        counts = Counts.of(read_ledger(storage, ledger_rel, COUNT_COLUMNS))
        got = ShardResult(ref.source, ref.index, tar_rel, ledger_rel, counts, 0.0, skipped=True, samples=counts.ok)
        cand = validate_shard(storage, ref.source, ref.index, tar_rel, ledger_rel, vcfg, cand_tar, cand_ledger)
        return got, cand
    rows, results = (rows_from or fetched_rows)(ref, storage, dcfg, s3_options)
    ledger: list[LedgerRow] = []
    judge = Judge(vcfg)
    with (
        storage.atomic_writer(tar_rel) as raw_out,
        storage.atomic_writer(cand_tar) as cand_out,
        JudgePool(judge) as pool,
    ):
        raw = ShardWriter(raw_out)
        shard = CandidateShard(storage, cand_tar, cand_ledger, cand_out)
        for row, fetched in results:
            entry, members = record_row(row, fetched, ref.source, tar_rel, raw)
            ledger.append(entry)
            if entry.status != OK:
                continue
            down = {"source": ref.source, "row": entry.row, "url": entry.url, "origin": entry.origin}
            for judged in pool.submit(entry.key, members, down):
                shard.add(judged)
        for judged in pool.drain():
            shard.add(judged)
        check_every_row_once(rows, ledger, tar_rel)
        raw.close()
        shard.close_tar()
    cand_counts = shard.commit()
    ledger.sort(key=lambda entry: entry.row)
    counts = Counts.of(write_ledger(storage, ledger_rel, ledger))
    seconds = time.perf_counter() - start
    return (
        ShardResult(ref.source, ref.index, tar_rel, ledger_rel, counts, seconds, samples=counts.ok),
        CandidateResult(ref.source, ref.index, cand_tar, cand_ledger, cand_counts, seconds),
    )
