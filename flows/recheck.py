"""The recheck of released rows (``download.recheck``): one task per download chunk with due rows, then a summary."""

from __future__ import annotations

import time

from prefect import get_run_logger, task

from flows.phase import gather_all, phase_flow, task_options
from tasks.formats.clock import now
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage
from tasks.stages.recheck import (
    ChunkPlan,
    ChunkResult,
    RecheckSummary,
    is_video,
    plan_recheck,
    recheck_chunk,
    summarize,
)


class RecheckFailed(RuntimeError):
    """Some chunks' rechecks failed after their retries; their rows stay due."""


@task(name="recheck-chunk", task_run_name="recheck-{plan.source}-{plan.chunk}")
def recheck_chunk_task(
    storage: Storage, dataset: str, plan: ChunkPlan, cfg, dead_after: int, when, video: bool, s3_options: dict
) -> ChunkResult:
    return recheck_chunk(storage, dataset, plan, cfg, dead_after, when, video, s3_options)


@phase_flow(name="recheck", log_prints=False, validate_parameters=False)
def recheck_flow(recipe: Recipe, ledgers: list[str]) -> RecheckSummary:
    """Recheck the due share of the latest release's rows found in ``ledgers`` (the current
    download ledgers), one task per chunk; each writes the chunk's next recheck version.

    Nothing is done where ``download.recheck`` is off, its fraction is 0 or nothing is released.
    """
    started = time.perf_counter()
    cfg = recipe.download.recheck
    if not cfg.enabled or cfg.fraction <= 0:
        return RecheckSummary()
    logger = get_run_logger()
    storage = Storage(recipe.storage, recipe.storage_options)
    when = now()
    plan = plan_recheck(storage, recipe, ledgers, when)
    chunk_task = recheck_chunk_task.with_options(**task_options(recipe))
    futures = {
        chunk_task.submit(
            storage,
            recipe.dataset,
            chunk,
            recipe.download_for(chunk.source),
            cfg.dead_after,
            when,
            is_video(recipe, chunk.source),
            recipe.storage_options,
        ): f"{chunk.source}/{chunk.chunk}"
        for chunk in plan.chunks
    }
    results, failed = gather_all(futures, None, "recheck", rows=plan.rows, logger=logger)
    summary = summarize(plan, results, time.perf_counter() - started)
    logger.info(
        "recheck: %d of %d released rows due, %d checked: %s; next due %s",
        plan.due,
        plan.released,
        summary.checked,
        ", ".join(f"{n} {outcome}" for outcome, n in summary.counts.items()) or "nothing",
        summary.next_recheck_at,
    )
    if failed:
        raise RecheckFailed(
            f"{len(failed)} of {len(futures)} recheck chunks failed (their rows stay due):\n" + "\n".join(failed[:20])
        )
    return summary
