"""The fine-tuning records read and checked, and the recipe of the image phases they lead to."""

from __future__ import annotations

from typing import Any

from prefect import task

from flows.phase import phase_flow, task_options
from tasks.finetune.ingest import (
    IngestPlan,
    IngestResult,
    RangeResult,
    RecordRange,
    finish_ingest,
    ingest_range,
    plan_ingest,
)
from tasks.finetune.samples import image_source_name
from tasks.formats.recipe import Recipe
from tasks.formats.recipe_download import CaptionRules, SourceConfig
from tasks.formats.storage import Storage


@task(name="plan-records", task_run_name="records-plan-{source.name}")
def plan_records_task(storage: Storage, dataset: str, source: SourceConfig, cfg, options: dict) -> IngestPlan:
    return plan_ingest(storage, dataset, source, cfg, options)


@task(name="ingest-records", task_run_name="records-{plan.source.name}-{part.index:05d}")
def ingest_range_task(storage: Storage, plan: IngestPlan, part: RecordRange, cfg, options: dict) -> RangeResult:
    return ingest_range(storage, plan, part, cfg, options)


@task(name="join-records", task_run_name="records-join-{plan.source.name}")
def join_records_task(storage: Storage, plan: IngestPlan, parts: list[RangeResult]) -> IngestResult:
    return finish_ingest(storage, plan, parts)


@phase_flow(name="finetune-ingest")
def ingest_flow(recipe: Recipe) -> list[IngestResult]:
    """Read and check every records file; derive the manifests of images to fetch.

    Per source: a plan task hashes the file and counts records per byte range, one task per
    range reads and checks its records (in parallel), and a join task orders their outputs.
    """
    storage = Storage(recipe.storage, recipe.storage_options)
    retries = task_options(recipe)
    opts = recipe.storage_options
    plans = [
        plan_records_task.with_options(**retries).submit(storage, recipe.dataset, s, recipe.finetune, opts)
        for s in recipe.sources
    ]
    reading: list[IngestResult | tuple[IngestPlan, list[Any]]] = []
    for future in plans:
        plan = future.result()
        if plan.done is not None:
            reading.append(plan.done)
            continue
        parts = [
            ingest_range_task.with_options(**retries).submit(storage, plan, r, recipe.finetune, opts)
            for r in plan.ranges
        ]
        reading.append((plan, parts))
    joins: list[Any] = []
    for item in reading:
        if isinstance(item, IngestResult):
            joins.append(item)
            continue
        plan, parts = item
        # Each range's result first: a file that cannot be read raises its own error (a
        # RecordsError naming the file) here, where a join fed failed ranges would only say
        # that it never ran (Prefect's UnfinishedRun).
        done = [part.result() for part in parts]
        joins.append(join_records_task.with_options(**retries).submit(storage, plan, done))
    return [j if isinstance(j, IngestResult) else j.result() for j in joins]


def image_recipe(recipe: Recipe, ingests: list[IngestResult]) -> Recipe | None:
    """The recipe the download and validate phases run on: one image manifest per records source.

    An image's caption is the reply that speaks of it (``Conversation.image_texts``), carried for
    curation's alignment score and never a reason to reject the image; licenses come from the
    records (or ``conversation.license``).
    """
    storage = Storage(recipe.storage, recipe.storage_options)
    rows_per_shard = {s.name: s.rows_per_shard for s in recipe.sources}
    sources = [
        SourceConfig(
            name=image_source_name(i.source),
            manifest=storage.url(i.image_manifest),
            format="jsonl",
            caption_column="caption",
            license_column="license",
            extra_columns=("record",),
            rows_per_shard=rows_per_shard[i.source],
        )
        for i in ingests
        if i.image_manifest
    ]
    if not sources:
        return None
    v = recipe.validate_
    # Any text passes: the record's own checks judged it (conversation bounds).
    loose = CaptionRules(required=False, min_chars=0, min_words=0, max_chars=10**9, max_non_text_ratio=1.0)
    validate = v.model_copy(update={"caption": loose})
    return recipe.model_copy(update={"sources": tuple(sources), "validate_": validate})
