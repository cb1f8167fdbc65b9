"""The download phase: URL manifests fetched, and existing data ingested (tasks/sources/), into raw WebDataset shards and ledgers, one task per chunk."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import partial

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from flows.phase import Phase, gather_all, phase_flow
from flows.preflight import combine_groups, list_groups, plan_here, small, take_primed
from flows.runtime import leave_dask_slot
from tasks.audit.download_summary import DownloadSummary, summary_markdown, write_summary
from tasks.audit.runrecord import RunRecord
from tasks.formats import clock
from tasks.formats.ledger import Counts, committed_pairs, concat_ledgers
from tasks.formats.manifests import SourcePlan, plan_files
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage
from tasks.stages.download import ShardResult, download_shard, fetched_rows
from tasks.stages.onepass import chunk_paths, download_and_validate
from tasks.stages.retry import (
    RetryJob,
    RetryResult,
    due_rows,
    next_retry_at,
    read_current,
    retry_chunks,
    task_groups,
    version_paths,
)
from tasks.stages.runner import counted_shard
from tasks.stages.validate import CandidateResult, candidate_config_hash, candidate_paths


class PhaseFailed(RuntimeError):
    """Some shards failed after their retries; the summary and report were still written."""


@task(name="plan-manifest-files", retries=2, retry_delay_seconds=2)
def plan_files_task(source, files: list, storage: Storage, dataset: str, options: dict) -> list:
    return plan_files(source, files, storage, dataset, options)


@task(name="download-shard", task_run_name="download-{ref.source}-{ref.name}")
def download_shard_task(
    ref, storage: Storage, cfg, tar_rel: str, ledger_rel: str, s3_options: dict, rows_from=None, now=None
) -> ShardResult:
    return download_shard(ref, storage, cfg, tar_rel, ledger_rel, s3_options, rows_from or _fetched, now)


@task(name="download-validate-shard", task_run_name="download-validate-{ref.source}-{ref.name}")
def download_validate_task(
    ref,
    storage: Storage,
    dcfg,
    vcfg,
    download: tuple[str, str],
    candidates: tuple[str, str],
    s3_options: dict,
    rows_from=None,
    now=None,
) -> tuple[ShardResult, CandidateResult]:
    return download_and_validate(ref, storage, dcfg, vcfg, download, candidates, s3_options, rows_from or _fetched, now)


@task(name="retry-shards", task_run_name="retry-{label}")
def retry_task(
    label: str, jobs: list[RetryJob], storage: Storage, dcfg, vcfg, s3_options: dict, now
) -> list[RetryResult] | tuple[list[RetryResult], list[CandidateResult]]:
    """New versions of a few chunks: their rows that failed for a passing reason fetched again
    (tasks/stages/retry.py); with ``vcfg``, their candidates too (as ``download_validate_task``).
    The thread stays in its Dask slot: most of the work is copying the previous versions."""
    done = retry_chunks(jobs, storage, dcfg, vcfg, s3_options, now)
    got = [g for g, _ in done]
    return (got, [c for _, c in done if c is not None]) if vcfg is not None else got


# A URL manifest's rows, fetched; once only the slowest rows are left in flight, or none (what is
# left is the commit: closing the shards, fsyncs, ledgers), the task gives its Dask thread back
# so the worker goes on with the next shard (flows.runtime.leave_dask_slot).
_fetched = partial(fetched_rows, on_idle=leave_dask_slot)


def rows_from(recipe: Recipe, source: str):
    """Where a chunk's rows come from: fetched (None, a URL manifest) or an ingested source's reader."""
    from tasks.sources import ingest_rows

    cfg = next(s for s in recipe.sources if s.name == source)
    return None if cfg.kind == "manifest" else partial(ingest_rows, cfg)


def run_name() -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_id = flow_run.get_id()
    return f"{stamp}-{run_id[:8]}" if run_id else stamp


@phase_flow(name="download", log_prints=False)
def download_flow(recipe: Recipe, run: RunRecord, fuse_validation: bool = False) -> tuple[DownloadSummary, RunRecord]:
    """Download every manifest row of the recipe into shards (skipping committed ones), then gate.

    With ``fuse_validation`` each chunk is fetched and validated in one task (tasks/stages/onepass.py): the
    raw shards of this phase and the candidate shards of the validation phase come out of one
    pass over the bytes, and the validation flow then only deduplicates and gates.

    A committed chunk whose rows failed for a passing reason and are due again
    (``download.retry_failed``, decided from the ledgers this phase reads anyway) gets a new
    version built from its current one and those rows fetched again (tasks/stages/retry.py), a
    few chunks per task; the summary counts them and says when the next retry falls due.
    Every list of the summary names each chunk's current version, so later phases, the gate and
    the release see one ledger per chunk.
    """
    from tasks.audit.gates import download_gate

    ph = Phase(recipe, run, "download", "download shards done")
    storage = ph.storage
    now = clock.now()  # the run's time: what fetches record and what retries are due by
    plans = plan_sources(recipe, storage)
    refs = [c for p in plans for c in p.chunks]
    both = chunk_paths(recipe, storage, refs)  # each chunk's current version
    paths = {ref: down for ref, (down, _) in both.items()}
    cand_paths = {ref: cand for ref, (_, cand) in both.items()} if fuse_validation else {}
    # What is stored decides: a ledger whose shard is gone commits nothing (a lean download,
    # download.keep_raw false, has no raw shard to ask for).
    raw_tar = recipe.download.keep_raw or not fuse_validation
    done = committed_pairs(
        storage,
        [(p[0] if raw_tar else None, p[1]) for p in paths.values()] + [(p[0], p[1]) for p in cand_paths.values()],
    )
    finished = {r for r in refs if paths[r][1] in done and (not fuse_validation or cand_paths[r][1] in done)}
    # The ledgers of finished chunks, read once: their counts, the gate's rows, and which rows
    # are due a retry (a run that retries nothing reads what it read before retries came).
    tables = read_current(storage, [paths[r][1] for r in refs if r in finished])
    retry_cfg, retrying = recipe.download.retry_failed, set(recipe.fetched_sources)
    vhash = candidate_config_hash(recipe)
    futures, todo_rows, todo_shards = {}, 0, 0
    retries: dict[str, list[RetryJob]] = {}  # by source
    for ref in refs:
        tar_rel, ledger_rel = paths[ref]
        if ref in finished:
            table = tables.get(ledger_rel)
            due = due_rows(table, retry_cfg, now) if table is not None and ref.source in retrying else []
            if due:
                version = version_paths(paths[ref], due)
                cands = candidate_paths(recipe.dataset, ref.source, ref.index, version[0], vhash)
                job = RetryJob(
                    ref, (paths[ref], cand_paths.get(ref)), (version, cands if fuse_validation else None), due
                )
                retries.setdefault(ref.source, []).append(job)
            continue  # committed by an earlier run: nothing to submit but its retries
        if fuse_validation:
            fut = ph.submit(
                download_validate_task,
                ref,
                storage,
                recipe.download_for(ref.source),
                recipe.validate_,
                paths[ref],
                cand_paths[ref],
                recipe.storage_options,
                rows_from(recipe, ref.source),
                now,
            )
        else:
            fut = ph.submit(
                download_shard_task,
                ref,
                storage,
                recipe.download_for(ref.source),
                tar_rel,
                ledger_rel,
                recipe.storage_options,
                rows_from(recipe, ref.source),
                now,
            )
        futures[fut], todo_rows, todo_shards = tar_rel, todo_rows + ref.rows, todo_shards + 1
    for source, jobs in retries.items():
        # A few rows of many chunks: a task retries chunks until it has a download task's rows.
        per_task = next(s.rows_per_shard for s in recipe.sources if s.name == source)
        for group in task_groups(jobs, per_task):
            vcfg = recipe.validate_ if fuse_validation else None
            label = f"{source}-{group[0].ref.name}" + (f"-{group[-1].ref.name}" if len(group) > 1 else "")
            fut = ph.submit(
                retry_task, label, group, storage, recipe.download_for(source), vcfg, recipe.storage_options, now
            )
            futures[fut] = f"retry of {', '.join(job.previous[0][1] for job in group)}"
            todo_rows += sum(len(job.rows) for job in group)
            todo_shards += len(group)
    fresh, failed = gather_all(futures, ph.progress, "download", rows=todo_rows, shards=todo_shards)
    fresh_results: list[ShardResult] = []
    candidates: list[CandidateResult] = []
    for out in fresh:  # a task's (result, candidates), or a retry task's lists of them
        got, cand = out if fuse_validation else (out, None)
        fresh_results += got if isinstance(got, list) else [got]
        candidates += cand if isinstance(cand, list) else [cand] if cand is not None else []
    by_chunk = {(r.source, r.index): r for r in fresh_results}
    # The new ledgers (fresh chunks, new versions) are read once too.
    tables.update(read_current(storage, [r.ledger for r in fresh_results]))
    results: list[ShardResult] = []
    for ref in refs:
        tar_rel, ledger_rel = paths[ref]
        if (ref.source, ref.index) in by_chunk:
            results.append(by_chunk[(ref.source, ref.index)])
        elif ref in finished and tables.get(ledger_rel) is not None:
            results.append(counted_shard(ref.source, ref.index, tar_rel, ledger_rel, tables[ledger_rel]))
    retried = [r for r in fresh_results if isinstance(r, RetryResult)]
    due_next = [
        t
        for r in results
        if r.source in retrying and (tab := tables.get(r.ledger)) is not None
        if (t := next_retry_at(tab, retry_cfg)) is not None
    ]
    seconds = ph.seconds
    counts = sum((r.counts or Counts.zero() for r in results), Counts.zero())
    # A retried chunk's version holds copies of its samples: only what it fetched counts as fresh.
    fresh_ok = sum(r.recovered if isinstance(r, RetryResult) else r.ok for r in fresh_results)
    fresh_bytes = sum(
        r.fetched_bytes if isinstance(r, RetryResult) else r.counts.bytes for r in fresh_results if r.counts is not None
    )
    summary = DownloadSummary(
        dataset=recipe.dataset,
        run=run.run,
        storage=storage.url(),
        shards=len(refs),
        shards_skipped=sum(r.skipped for r in results),
        shards_failed=failed,
        counts=counts,
        seconds=round(seconds, 3),
        samples_per_s=ph.rate(fresh_ok, seconds),
        mb_per_s=round(fresh_bytes / 1e6 / seconds, 2) if seconds else 0.0,
        manifests={p.source: p.manifest_sha256 for p in plans},
        ledgers=[r.ledger for r in results],
        tars=[r.tar for r in results],
        chunks=[(r.source, r.index) for r in results],
        candidates=candidates,
        rows_retried=sum(r.retried for r in retried),
        rows_recovered=sum(r.recovered for r in retried),
        next_retry_at=min(due_next) if due_next else None,
    )
    summary.report = write_summary(storage, summary)
    ph.logger.info(
        "download: %d rows, %d ok, %d rejected, %d error; %d/%d shards skipped; %.1f samples/s; "
        "%d rows retried, %d recovered",
        counts.rows,
        counts.ok,
        counts.rejected,
        counts.error,
        summary.shards_skipped,
        summary.shards,
        summary.samples_per_s,
        summary.rows_retried,
        summary.rows_recovered,
    )
    if failed:
        # The gate and its report (which post this artifact on success) will not run.
        create_markdown_artifact(
            summary_markdown(summary),
            key=f"{recipe.dataset}-download-summary",
            description=f"{recipe.dataset}: download summary",
        )
        raise PhaseFailed(
            f"{len(failed)} of {len(refs)} download shards failed; see {summary.report}:\n" + "\n".join(failed[:20])
        )
    ledger = concat_ledgers([tables.get(r.ledger) for r in results], ["key", "source", "status", "reason"])
    # Rows in: the manifests' rows; a source counted only when read (WebDataset shards) by its ledgers.
    counted = {p.source for p in plans if not p.rows_known}
    manifest_rows = sum(p.rows for p in plans) + sum(r.rows for r in results if r.source in counted)
    gate, links = ph.judge(
        [r.ledger for r in results], (manifest_rows, recipe.gates.download),
        lambda: download_gate(ledger, manifest_rows, recipe.gates.download),
    )  # fmt: skip
    ph.record(
        counts,
        ledger,
        summary.samples_per_s,
        gate,
        links,
        seconds=seconds,
        shards=summary.shards,
        skipped=summary.skipped,
    )
    # gather_all has set the progress to 100 %.
    ph.close(gate, why="; ".join(p.note for p in plans if p.note), done=False)
    return summary, ph.run


def plan_sources(recipe: Recipe, storage: Storage) -> list[SourcePlan]:
    """Every source's plan. A few small manifest files are planned here, in threads; many or
    large ones on the cluster, one task per group of files (tasks.formats.manifests.group_files)."""
    primed = take_primed(recipe)
    if primed is not None:
        return primed
    options = recipe.storage_options
    groups = list_groups(recipe)
    if small(groups):
        planned = plan_here(recipe, storage, groups)
    else:
        task = plan_files_task.with_options(retries=recipe.execution.task_retries)
        futures = [task.submit(source, group, storage, recipe.dataset, options) for source, group in groups]
        planned = [f.result() for f in futures]
    return combine_groups(recipe, groups, planned)
