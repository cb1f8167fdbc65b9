"""The precache phase: frozen-encoder outputs for every resharded shard, on GPU workers where there are any."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import dask
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from flows.audit import check_gate, judge_phase, phase_record
from flows.runtime import gather
from tasks.formats.ledger import Counts, committed
from tasks.formats.recipe import Recipe
from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.formats.storage import Storage
from tasks.stages.precache import (
    PrecacheInput,
    PrecacheResult,
    channel_table,
    output_names,
    precache_shard,
    read_ledgers,
    recorded,
    shard_table,
    summary_name,
)
from tasks.stages.precache_models import check_models


@dataclass
class PrecacheSummary:
    """The latent shards, one per resharded shard in the same order, and what they hold."""

    dataset: str
    run: str
    samples: int
    results: list[PrecacheResult] = field(default_factory=list)
    encodings: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


@task(name="precache-shard", task_run_name="precache-{name}")
def precache_task(
    storage: Storage, cfg: PrecacheConfig, shard: PrecacheInput, prefix: str, name: str
) -> PrecacheResult:
    return precache_shard(storage, cfg, shard, prefix)


@flow(name="precache")
def precache_flow(recipe: Recipe, reshard: Any, run: dict) -> tuple[PrecacheSummary | None, dict]:
    """Encode every resharded shard with the recipe's frozen encoders, then gate the latents.

    Returns ``None`` for the summary when the recipe configures no encoder. On a ``cuda``
    cluster the tasks ask for the workers' ``GPU`` resource, so at most one runs per GPU and
    CPU-only workers of a mixed cluster never take them.
    """
    from tasks.audit.gates import precache_gate

    logger = get_run_logger()
    cfg = recipe.precache
    if not cfg.enabled:
        logger.info("precache: no encoder configured; skipped")
        return None, run
    check_models(cfg)
    started = time.perf_counter()
    storage = Storage(recipe.storage, recipe.storage_options)
    retries = dict(retries=recipe.execution.task_retries, retry_delay_seconds=recipe.execution.task_retry_delay_s)
    progress = create_progress_artifact(
        0.0, key=f"{recipe.dataset}-precache-progress", description=f"{recipe.dataset}: precache"
    )
    inputs = [PrecacheInput(o.tar, o.sha256, tuple(o.records)) for o in reshard.outputs]
    prefix = f"{recipe.dataset}/precache"
    names = {shard.tar: output_names(cfg, prefix, shard) for shard in inputs}
    done = committed(
        storage, [summary_name(ledger) for _, ledger in names.values()] + [ledger for _, ledger in names.values()]
    )
    results: list[PrecacheResult] = [
        recorded(storage, summary_name(names[s.tar][1]))
        for s in inputs
        if {names[s.tar][1], summary_name(names[s.tar][1])} <= done
    ]
    todo = [s for s in inputs if not {names[s.tar][1], summary_name(names[s.tar][1])} <= done]
    annotations = {"resources": {"GPU": 1}} if recipe.execution.cluster == "cuda" else {}
    with dask.annotate(**annotations):
        futures = {
            precache_task.with_options(**retries).submit(
                storage, cfg, shard, prefix, shard.tar.rsplit("/", 1)[-1]
            ): shard.tar
            for shard in todo
        }
    order = {s.tar: i for i, s in enumerate(inputs)}
    results = sorted(
        results + gather(futures, progress, 0.0, 100.0, logger, "precache"), key=lambda r: order[r.image_shard]
    )

    ledger = read_ledgers(storage, results)
    channels = channel_table(results)
    gate, links = judge_phase(
        storage, recipe, run, "precache", [r.ledger for r in results], (reshard.samples, recipe.gates.precache),
        lambda: precache_gate(ledger, shard_table(results, {o.tar: o.samples for o in reshard.outputs}), channels, reshard.samples, recipe.gates.precache),
    )  # fmt: skip
    seconds = time.perf_counter() - started
    timings = {
        k: round(sum(r.timings.get(k, 0.0) for r in results if not r.skipped), 3)
        for k in ("load_s", "decode_s", "encode_s", "write_s", "total_s")
    }
    summary = PrecacheSummary(
        dataset=recipe.dataset,
        run=run["run"],
        samples=sum(r.samples for r in results),
        results=results,
        encodings=results[0].encodings if results else {},
        seconds=round(seconds, 3),
        timings=timings,
    )
    fresh = sum(r.samples for r in results if not r.skipped)
    record = phase_record(
        "precache", Counts.of(ledger), ledger, seconds, round(fresh / seconds, 1) if seconds else 0.0, gate, links
    )
    record["timings"] = timings
    run["phases"].append(record)
    update_progress_artifact(progress, 100.0)
    check_gate(storage, recipe, run, gate)
    logger.info(
        "precache: %d samples in %d latent shards (%s)", summary.samples, len(results), ", ".join(summary.encodings)
    )
    return summary, run
