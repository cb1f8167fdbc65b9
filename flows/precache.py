"""The precache phase: frozen-encoder outputs for every resharded shard, on GPU workers where there are any."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dask
from prefect import get_run_logger, task

from flows.phase import Phase, all_skipped, phase_flow
from flows.reshard import ReshardSummary
from tasks.audit.runrecord import RunRecord
from tasks.formats.ledger import Counts, committed, committed_pairs
from tasks.formats.recipe import Recipe
from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.formats.storage import Storage
from tasks.models.frozen import check_models
from tasks.stages.precache import (
    PrecacheInput,
    PrecacheResult,
    channel_table,
    output_names,
    placement,
    precache_shard,
    read_ledgers,
    recorded,
    shard_table,
    summary_name,
)


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
    storage: Storage, cfg: PrecacheConfig, shard: PrecacheInput, prefix: str, dtypes: dict[str, str], name: str
) -> PrecacheResult:
    return precache_shard(storage, cfg, shard, prefix, dtypes)


@task(name="precache-placement")
def placement_task(cfg: PrecacheConfig) -> dict[str, str]:
    """The compute dtype of each model block, resolved where the encoders run (a worker)."""
    return placement(cfg)


def _side_shards(storage: Storage, cfg: PrecacheConfig, reshard: ReshardSummary, curated: Any) -> list[tuple[str, ...]]:
    """Per output shard, curation's side shards that hold its samples, when curation embedded them
    with ``precache.image_embedding``'s very model (the same folder digest); else none."""
    from tasks.formats.ledger import read_tables
    from tasks.models.placement import folder_digest

    none: list[tuple[str, ...]] = [() for _ in reshard.outputs]
    if cfg.image_embedding is None or curated is None or folder_digest(cfg.image_embedding.model) != curated.model:
        return none
    tables = read_tables(storage, [o.ledger for o in reshard.outputs], ["input_shard"])
    return [
        tuple(
            sorted(
                {
                    curated.side_shards[t]
                    for t in tables[o.ledger].column("input_shard").to_pylist()
                    if t in curated.side_shards
                }
            )
        )
        for o in reshard.outputs
    ]


@phase_flow(name="precache", validate_parameters=False)  # inputs: earlier phases' typed results (flows/phase.py)
def precache_flow(
    recipe: Recipe, reshard: ReshardSummary, run: RunRecord, curated: Any = None
) -> tuple[PrecacheSummary | None, RunRecord]:
    """Encode every resharded shard with the recipe's frozen encoders, then gate the latents.

    Returns ``None`` for the summary when the recipe configures no encoder. On a ``cuda``
    cluster the tasks ask for the workers' ``GPU`` resource, so at most one runs per GPU and
    CPU-only workers of a mixed cluster never take them.
    """
    from tasks.audit.gates import precache_gate

    cfg = recipe.precache
    if not cfg.enabled:
        get_run_logger().info("precache: no encoder configured; skipped")
        return None, run
    check_models(cfg)
    ph = Phase(recipe, run, "precache", "precache")
    storage = ph.storage
    sides = _side_shards(storage, cfg, reshard, curated)
    inputs = [PrecacheInput(o.tar, o.sha256, tuple(o.records), side) for o, side in zip(reshard.outputs, sides)]
    prefix = f"{recipe.dataset}/precache"
    annotations = {"resources": {"GPU": 1}} if recipe.execution.cluster == "cuda" else {}
    with dask.annotate(**annotations):
        dtypes = placement_task.submit(cfg).result()
    names = {shard.tar: output_names(cfg, prefix, shard, dtypes) for shard in inputs}
    # A latent shard is committed when its ledger, its record and the shard itself are stored.
    stored = committed_pairs(storage, list(names.values()))
    records = committed(storage, [summary_name(ledger) for _, ledger in names.values()])
    done = {ledger for ledger in stored if summary_name(ledger) in records}
    results: list[PrecacheResult] = [
        recorded(storage, summary_name(names[s.tar][1]), s.tar) for s in inputs if names[s.tar][1] in done
    ]
    todo = [s for s in inputs if names[s.tar][1] not in done]
    with dask.annotate(**annotations):
        futures = {
            ph.submit(precache_task, storage, cfg, shard, prefix, dtypes, shard.tar.rsplit("/", 1)[-1]): shard.tar
            for shard in todo
        }
    order = {s.tar: i for i, s in enumerate(inputs)}
    results = sorted(results + ph.gather(futures, 0.0, 100.0, "precache"), key=lambda r: order[r.image_shard])

    ledger = read_ledgers(storage, results)
    channels = channel_table(results)
    gate, links = ph.judge(
        [r.ledger for r in results], (reshard.samples, recipe.gates.precache),
        lambda: precache_gate(ledger, shard_table(results, {o.tar: o.samples for o in reshard.outputs}), channels, reshard.samples, recipe.gates.precache),
    )  # fmt: skip
    seconds = ph.seconds
    timings = {
        k: round(sum(r.timings.get(k, 0.0) for r in results if not r.skipped), 3)
        for k in ("load_s", "embed_s", "decode_s", "encode_s", "write_s", "total_s")
    }
    summary = PrecacheSummary(
        dataset=recipe.dataset,
        run=run.run,
        samples=sum(r.samples for r in results),
        results=results,
        encodings=results[0].encodings if results else {},
        seconds=round(seconds, 3),
        timings=timings,
    )
    fresh = ph.rate(sum(r.samples for r in results if not r.skipped), seconds)
    ph.record(
        Counts.of(ledger),
        ledger,
        fresh,
        gate,
        links,
        seconds=seconds,
        shards=len(results),
        timings=timings,
        skipped=all_skipped(results),
    )
    ph.close(gate)
    ph.logger.info(
        "precache: %d samples in %d latent shards (%s)", summary.samples, len(results), ", ".join(summary.encodings)
    )
    return summary, ph.run
