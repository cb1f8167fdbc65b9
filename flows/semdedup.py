"""Semantic dedup on the cluster: centroids fitted once, side shards assigned in parallel, buckets compared in parallel."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prefect import task

from flows.phase import Phase
from tasks.curate.decide import ShardInput
from tasks.curate.semdedup import (
    assign_file,
    dedup_bucket,
    fit_centroids,
    semantic_duplicates,
    space_root,
)
from tasks.formats.recipe_curate import CurateConfig

fit_task = task(name="semdedup-fit")(fit_centroids)
assign_task = task(name="semdedup-assign")(assign_file)
bucket_task = task(name="semdedup-bucket")(dedup_bucket)
_TASKS = {
    fit_centroids: (fit_task, "fit"),
    assign_file: (assign_task, "assign"),
    dedup_bucket: (bucket_task, "semdedup"),
}


def run_semdedup(
    ph: Phase, cfg: CurateConfig, shards: list[ShardInput], model: str
) -> tuple[list[str], dict[str, int]]:
    """The buckets' decision files (one row per semantic duplicate), and what was computed now;
    none when ``curate.semdedup`` is off."""
    rule = cfg.semdedup
    if rule is None:
        return [], {}
    recipe = ph.recipe

    def on_cluster(fn: Callable[..., Any], args: Iterable[tuple[Any, ...]]) -> list[Any]:
        the_task, what = _TASKS[fn]
        futures = {ph.submit(the_task, *a): f"{what} {i}" for i, a in enumerate(args)}
        return ph.gather(futures, 60.0, 0.0, what) if futures else []

    order = recipe.source_order()
    root = space_root(recipe.dataset, model, rule.clusters, rule.seed)
    files = [s.embeddings for s in shards]
    decisions, done = semantic_duplicates(
        ph.storage, root, files, rule.threshold, order, rule.clusters, rule.seed, on_cluster
    )
    return decisions, done
