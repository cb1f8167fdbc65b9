"""The validation phase: per-shard checks on Dask, dedup across the dataset, then the gate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from flows.audit import check_gate, judge_phase, phase_record
from flows.runtime import gather
from tasks.formats.ledger import COUNT_COLUMNS, Counts, committed, read_ledgers
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
    thumbs_path,
    validate_shard,
)

REPORT_COLUMNS = ["key", "source", "status", "reason", "license", "width", "height", "caption_chars", "bytes"]


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
) -> CandidateResult:
    return validate_shard(storage, source, index, download_tar, download_ledger, cfg, tar_rel, table_rel)


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


@flow(name="validate")
def validate_flow(recipe: Recipe, download: Any, run: dict) -> tuple[ValidateSummary, dict]:
    """Validate every downloaded shard (unless the download phase already did, in one pass),
    dedup across the dataset, gate, and report."""
    from tasks.audit.gates import validate_gate
    from tasks.policies.licenses import review_problem

    logger = get_run_logger()
    started = time.perf_counter()
    storage = Storage(recipe.storage, recipe.storage_options)
    cfg = recipe.validate_
    retries = dict(retries=recipe.execution.task_retries, retry_delay_seconds=recipe.execution.task_retry_delay_s)
    chash = candidate_config_hash(recipe)
    progress = create_progress_artifact(
        0.0, key=f"{recipe.dataset}-validate-progress", description=f"{recipe.dataset}: validation shards done"
    )

    fused = {c.table: c for c in getattr(download, "candidates", [])}
    wanted = []
    for tar, ledger, (source, index) in zip(download.tars, download.ledgers, download.chunks):
        wanted.append((source, index, tar, ledger, *candidate_paths(recipe.dataset, source, index, tar, chash)))
    done = committed(storage, [w[5] for w in wanted if w[5] not in fused])
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
            futures[
                validate_shard_task.with_options(**retries).submit(
                    storage, source, index, tar, ledger, cfg, tar_rel, table_rel
                )
            ] = tar
    cands += gather(futures, progress, 0.0, 80.0, logger, "validate")
    cands.sort(key=lambda c: (c.source, c.index))

    order = {s.name: i for i, s in enumerate(recipe.sources)}
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
        futures[finalize_shard_task.with_options(**retries).submit(storage, c, mine, tar_rel, ledger_rel)] = c.tar
    results += gather(futures, progress, 80.0, 20.0, logger, "finalize")
    results.sort(key=lambda r: (r.source, r.index))

    tables = read_ledgers(storage, [r.ledger for r in results])
    ledger = pa.concat_tables([tables[r.ledger] for r in results]) if results else None
    counts = Counts.of(ledger) if ledger is not None else Counts.zero()
    seconds = time.perf_counter() - started
    samples = _report_samples(storage, ledger, cands)
    accepted = ledger.filter(pa.compute.equal(ledger.column("status"), "ok")) if ledger is not None else None
    reviewed = review_problem(cfg.license) is None
    gate, links = judge_phase(
        storage, recipe, run, "validate", [r.ledger for r in results], (recipe.gates.validate_, cfg.license.allow, cfg.image, reviewed),
        lambda: validate_gate(
            ledger if ledger is not None else pa.table({}), _gate_samples(accepted), recipe.gates.validate_, list(cfg.license.allow), cfg.image, reviewed
        ),
    )  # fmt: skip
    fresh = sum(r.counts.ok for r in results if not r.skipped) + sum(c.counts.ok for c in cands if not c.skipped)
    summary = ValidateSummary(
        dataset=recipe.dataset,
        run=run["run"],
        counts=counts,
        shards=len(results),
        shards_skipped=sum(c.skipped for c in cands),
        duplicates=n_dups,
        seconds=round(seconds, 3),
        samples_per_s=round(fresh / seconds, 1) if seconds else 0.0,
        ledgers=[r.ledger for r in results],
        tars=[r.tar for r in results],
    )
    run["phases"].append(
        phase_record(
            "validate",
            counts,
            ledger if ledger is not None else pa.table({"source": [], "status": []}),
            seconds,
            summary.samples_per_s,
            gate,
            links,
        )
    )
    update_progress_artifact(progress, 100.0)
    summary.report = check_gate(storage, recipe, run, gate, samples)
    logger.info(
        "validate: %d in, %d ok, %d rejected (%d duplicates); gate passed",
        counts.rows,
        counts.ok,
        counts.rejected,
        n_dups,
    )
    return summary, run


def _gate_samples(accepted: pa.Table | None) -> pa.Table:
    if accepted is None or accepted.num_rows == 0:
        return pa.table({"key": pa.array([], pa.string())})
    return _with_aspect(
        accepted.select(["key", "license", "width", "height", "caption_chars", "pixel_sha256", "phash", "bytes"])
    )


def _with_aspect(table: pa.Table) -> pa.Table:
    """Append ``aspect`` = long side / short side (null where a side is unknown)."""
    w = table.column("width").to_pylist()
    h = table.column("height").to_pylist()
    aspect = [max(a, b) / min(a, b) if a and b else None for a, b in zip(w, h)]
    return table.append_column("aspect", pa.array(aspect, pa.float64()))


def _report_samples(storage: Storage, ledger: pa.Table | None, cands: list[CandidateResult]) -> pa.Table | None:
    """Per-sample rows for the report: final verdicts, plus the few thumbnails pass 1 kept."""
    if ledger is None:
        return None
    thumbs: dict[str, bytes] = {}
    files = [thumbs_path(c.table) for c in cands]
    for table in read_ledgers(storage, sorted(committed(storage, files))).values():
        thumbs.update(zip(table.column("key").to_pylist(), table.column("thumbnail").to_pylist()))
    base = _with_aspect(ledger.select(REPORT_COLUMNS))
    return base.append_column(
        "thumbnail", pa.array([thumbs.get(k) for k in base.column("key").to_pylist()], pa.binary())
    )
