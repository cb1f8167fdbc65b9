"""The validation phase: per-shard checks on Dask, dedup across the dataset, then the gate."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
from prefect import task

from flows.phase import Phase, all_skipped, phase_flow
from tasks.audit.download_summary import DownloadSummary
from tasks.audit.privacy_views import privacy_counts
from tasks.audit.runrecord import RunRecord
from tasks.audit.validate_samples import gate_samples, report_samples
from tasks.formats.ledger import COUNT_COLUMNS, Counts, committed_pairs, read_ledgers
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage
from tasks.stages.download import ShardResult
from tasks.stages.validate import (
    CandidateResult,
    candidate_config_hash,
    candidate_paths,
    duplicates_by_table,
    final_paths,
    finalize_shard,
    validate_shard,
)


@dataclass
class ValidateSummary:
    """What the validation phase did, and where its shards and ledgers are."""

    dataset: str
    run: str
    counts: Counts
    shards: int
    shards_skipped: int
    duplicates: int
    seconds: float
    samples_per_s: float
    report: str = ""
    ledgers: list[str] = field(default_factory=list)
    tars: list[str] = field(default_factory=list)
    chunks: list[tuple[str, int]] = field(default_factory=list)  # (source, chunk index) of each shard
    privacy: dict[str, int] = field(default_factory=dict)  # tasks.audit.privacy_views.privacy_counts


@task(name="validate-shard", task_run_name="validate-{source}-{index}")
def validate_shard_task(
    storage: Storage,
    source: str,
    index: int,
    download_tar: str,
    download_ledger: str,
    cfg,
    tar_rel: str,
    table_rel: str,
    max_member_bytes: int,
) -> CandidateResult:
    return validate_shard(
        storage,
        source,
        index,
        download_tar,
        download_ledger,
        cfg,
        tar_rel,
        table_rel,
        max_member_bytes=max_member_bytes,
    )


@task(name="dedup")
def dedup_task(storage: Storage, tables: list[str], cfg, source_order: dict[str, int]) -> dict[str, dict[str, str]]:
    """Duplicates across the dataset, grouped by the candidate table each one is in."""
    return duplicates_by_table(storage, tables, cfg, source_order)


def dedup(storage: Storage, recipe: Recipe, tables: list[str], order: dict[str, int]) -> dict[str, dict[str, str]]:
    """Dedup decisions over the candidate tables: on the cluster, unless the same tables (names,
    sizes, stamps) and settings were decided before (a rerun with nothing new)."""
    from tasks.audit.gate_cache import gate_key, recall_value, remember_value, stamps

    if not tables:
        return {}
    key = gate_key("dedup", stamps(storage, tables), recipe.validate_.dedup, order)
    known = recall_value(storage, recipe.dataset, "dedup", key)
    if known is not None:
        return known
    decided = dedup_task.submit(storage, tables, recipe.validate_.dedup, order).result()
    remember_value(storage, recipe.dataset, "dedup", key, decided)
    return decided


@task(name="finalize-shard", task_run_name="finalize-{cand.source}-{cand.index}")
def finalize_shard_task(
    storage: Storage, cand: CandidateResult, dups: dict[str, str], tar_rel: str, ledger_rel: str
) -> ShardResult:
    return finalize_shard(storage, cand, dups, tar_rel, ledger_rel)


@phase_flow(name="validate", validate_parameters=False)  # inputs: earlier phases' typed results (flows/phase.py)
def validate_flow(recipe: Recipe, download: DownloadSummary, run: RunRecord) -> tuple[ValidateSummary, RunRecord]:
    """Validate every downloaded shard (unless the download phase already did, in one pass),
    dedup across the dataset, gate, and report."""
    from tasks.audit.gates import validate_gate
    from tasks.policies.licenses import review_problem

    ph = Phase(recipe, run, "validate", "validation shards done")
    storage, cfg = ph.storage, recipe.validate_
    chash = candidate_config_hash(recipe)

    fused = {c.table: c for c in download.candidates}
    wanted = []
    for tar, ledger, (source, index) in zip(download.tars, download.ledgers, download.chunks):
        wanted.append((source, index, tar, ledger, *candidate_paths(recipe.dataset, source, index, tar, chash)))
    done = committed_pairs(storage, [(w[4], w[5]) for w in wanted if w[5] not in fused])
    counted = read_ledgers(storage, sorted(done), COUNT_COLUMNS)
    cands: list[CandidateResult] = []
    futures = {}
    for source, index, tar, ledger, tar_rel, table_rel in wanted:
        if table_rel in fused:
            cands.append(fused[table_rel])
        elif table_rel in done:
            cands.append(
                CandidateResult(source, index, tar_rel, table_rel, Counts.of(counted[table_rel]), 0.0, skipped=True)
            )
        else:
            # The download shard's bodies were capped at its source's download.max_bytes (a video
            # source's video_max_bytes): read with that cap, not the reader's default.
            cap = recipe.download_for(source).max_bytes
            futures[
                ph.submit(validate_shard_task, storage, source, index, tar, ledger, cfg, tar_rel, table_rel, cap)
            ] = tar
    cands += ph.gather(futures, 0.0, 80.0, "validate")
    cands.sort(key=lambda c: (c.source, c.index))

    order = recipe.source_order()
    by_table = dedup(storage, recipe, [c.table for c in cands], order)
    n_dups = sum(len(d) for d in by_table.values())

    # A shard that dedup leaves alone is final as it is; only the others are copied again.
    results: list[ShardResult] = []
    futures = {}
    for c in cands:
        mine = by_table.get(c.table, {})
        if not mine:
            results.append(finalize_shard(storage, c, mine, c.tar, c.table))
            continue
        tar_rel, ledger_rel = final_paths(recipe.dataset, c.source, c.index, c, mine)
        futures[ph.submit(finalize_shard_task, storage, c, mine, tar_rel, ledger_rel)] = c.tar
    results += ph.gather(futures, 80.0, 20.0, "finalize")
    results.sort(key=lambda r: (r.source, r.index))

    tables = read_ledgers(storage, [r.ledger for r in results])
    # promote: ledgers written before a column came (the clip columns) have nulls there
    ledger = pa.concat_tables([tables[r.ledger] for r in results], promote_options="default") if results else None
    counts = Counts.of(ledger) if ledger is not None else Counts.zero()
    seconds = ph.seconds
    samples = report_samples(storage, ledger, cands, {s.name for s in recipe.sources if s.media == "video"})
    accepted = ledger.filter(pa.compute.equal(ledger.column("status"), "ok")) if ledger is not None else None
    reviewed = review_problem(cfg.license) is None
    shared = recipe.kind == "finetuning"  # records share a picture validation refuses as a duplicate
    gate, links = ph.judge(
        [r.ledger for r in results], (recipe.gates.validate_, cfg.license.allow, cfg.image, reviewed, shared),
        lambda: validate_gate(
            ledger if ledger is not None else pa.table({}), gate_samples(accepted), recipe.gates.validate_, list(cfg.license.allow), cfg.image, reviewed, shared,
            unique_pixels=cfg.dedup.exact,
        ),
    )  # fmt: skip
    fresh = sum(r.counts.ok for r in results if not r.skipped) + sum(c.counts.ok for c in cands if not c.skipped)
    summary = ValidateSummary(
        dataset=recipe.dataset,
        run=run.run,
        counts=counts,
        shards=len(results),
        shards_skipped=sum(c.skipped for c in cands),
        duplicates=n_dups,
        seconds=round(seconds, 3),
        samples_per_s=ph.rate(fresh, seconds),
        ledgers=[r.ledger for r in results],
        tars=[r.tar for r in results],
        chunks=[(r.source, r.index) for r in results],
        privacy=privacy_counts(ledger),
    )
    ph.record(
        counts,
        ledger if ledger is not None else pa.table({"source": [], "status": []}),
        summary.samples_per_s,
        gate,
        links,
        seconds=seconds,
        shards=summary.shards,
        skipped=all_skipped(cands, results),
    )
    summary.report = ph.close(gate, samples)
    ph.logger.info(
        "validate: %d in, %d ok, %d rejected (%d duplicates); gate passed",
        counts.rows,
        counts.ok,
        counts.rejected,
        n_dups,
    )
    return summary, ph.run
