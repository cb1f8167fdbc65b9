"""The reshard phase: equal-size shards planned from counts, built from byte ranges, then gated."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from flows.audit import check_gate, phase_record, run_gate
from flows.runtime import gather
from tasks.ledger import Counts, read_parquet
from tasks.recipe import Recipe
from tasks.release import verify_shard
from tasks.reshard import InputCensus, OutputResult, build_output, census_input, plan_reshard
from tasks.storage import Storage


@dataclass
class ReshardSummary:
    """The resharded dataset: equal shards (the last holds ``tail``), and their records."""

    dataset: str
    run: str
    samples_per_shard: int
    seed: int | None
    samples: int
    tail: int
    incomplete: int
    outputs: list[OutputResult] = field(default_factory=list)
    incomplete_rows: list[pa.Table] = field(default_factory=list)  # ledger rows of samples not carried
    seconds: float = 0.0


@task(name="census", task_run_name="census-{tar}")
def census_task(storage: Storage, tar: str, ledger: str, required: tuple[str, ...]) -> InputCensus:
    return census_input(storage, tar, ledger, required=required)


@task(name="reshard-shard", task_run_name="reshard-{output.index:06d}")
def build_task(storage: Storage, output: Any) -> OutputResult:
    return build_output(storage, output)


@task(name="verify-shard", task_run_name="verify-{tar}")
def verify_task(storage: Storage, tar: str, sha256: str, required: tuple[str, ...]) -> dict:
    return verify_shard(storage, tar, sha256, required)


@flow(name="reshard")
def reshard_flow(recipe: Recipe, validated: Any, run: dict) -> tuple[ReshardSummary, dict]:
    """Reshard the validated shards into shards of exactly N samples, verify them, and gate."""
    from tasks.gates import reshard_gate

    logger = get_run_logger()
    started = time.perf_counter()
    storage = Storage(recipe.storage, recipe.storage_options)
    cfg = recipe.reshard
    required = cfg.required(recipe.validate_)
    retries = dict(retries=recipe.execution.task_retries, retry_delay_seconds=recipe.execution.task_retry_delay_s)
    progress = create_progress_artifact(0.0, key=f"{recipe.dataset}-reshard-progress", description=f"{recipe.dataset}: reshard")

    futures = {census_task.with_options(**retries).submit(storage, t, l, required): t for t, l in zip(validated.tars, validated.ledgers)}
    censuses: list[InputCensus] = gather(futures, progress, 0.0, 10.0, logger, "census")
    order = {t: i for i, t in enumerate(validated.tars)}
    censuses.sort(key=lambda c: order[c.shard.tar])
    plan = plan_reshard([c.shard for c in censuses], cfg.samples_per_shard, prefix=f"{recipe.dataset}/reshard", seed=cfg.seed, required=required)

    futures = {build_task.with_options(**retries).submit(storage, o): o.name for o in plan.outputs}
    outputs: list[OutputResult] = sorted(gather(futures, progress, 10.0, 70.0, logger, "reshard"), key=lambda r: r.index)
    futures = {verify_task.submit(storage, o.tar, o.sha256, required): o.tar for o in outputs}
    checks = {c["shard"]: c for c in gather(futures, progress, 80.0, 20.0, logger, "verify")}
    rows = [dict(checks[o.tar], is_last=(i == len(outputs) - 1)) for i, o in enumerate(outputs)]
    table = pa.Table.from_pylist(rows) if rows else pa.table({})
    incomplete = sum(c.incomplete.num_rows for c in censuses)
    accepted_in = sum(c.ok for c in censuses)
    gate = reshard_gate(table, cfg.samples_per_shard, accepted_in - incomplete)
    links = run_gate(storage, recipe, run, gate)
    seconds = time.perf_counter() - started
    summary = ReshardSummary(
        dataset=recipe.dataset,
        run=run["run"],
        samples_per_shard=cfg.samples_per_shard,
        seed=cfg.seed,
        samples=plan.total,
        tail=plan.tail,
        incomplete=incomplete,
        outputs=outputs,
        incomplete_rows=[c.incomplete for c in censuses if c.incomplete.num_rows],
        seconds=round(seconds, 3),
    )
    ledger = pa.concat_tables([read_parquet(storage, o.ledger, ["key", "source", "status", "reason", "bytes"]) for o in outputs]) if outputs else pa.table({"source": pa.array([], pa.string()), "status": pa.array([], pa.string())})
    if incomplete:
        ledger = pa.concat_tables([ledger, *[c.incomplete.select(ledger.column_names) for c in censuses if c.incomplete.num_rows]])
    counts = Counts.of(ledger) if ledger.num_rows else Counts.zero()
    fresh = sum(o.samples for o in outputs if not o.skipped)
    run["phases"].append(phase_record("reshard", counts, ledger, seconds, round(fresh / seconds, 1) if seconds else 0.0, gate, links))
    update_progress_artifact(progress, 100.0)
    check_gate(storage, recipe, run, gate)
    logger.info("reshard: %d samples into %d shards of %d (tail %d)", plan.total, len(outputs), cfg.samples_per_shard, plan.tail)
    return summary, run
