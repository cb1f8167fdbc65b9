"""The fine-tuning dataset end to end: records, images, tiles, tokens, padding, packs, release."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect_dask import DaskTaskRunner

from flows.audit import GateFailed, check_gate, new_run, phase_record, publish, report_dir, run_gate
from flows.download import download_flow, run_name
from flows.release import copy_audit, reconcile
from flows.runtime import Session, cleanup_on_stop, dask_cluster, gather
from flows.validate import validate_flow
from tasks.finetune.ingest import (
    IngestPlan,
    IngestResult,
    RangeResult,
    RecordRange,
    finish_ingest,
    ingest_range,
    plan_ingest,
)
from tasks.finetune.packs import PackPlan, PackShardResult, output_paths, plan_packs, write_pack_shard
from tasks.finetune.samples import BuildResult, build_paths, build_samples, image_source_name
from tasks.finetune.tiling import all_tags
from tasks.formats.indexes import ENERGON_CRUDE_TYPE, ShardIndexInput, all_indexes
from tasks.formats.ledger import Counts, read_parquet
from tasks.formats.locks import run_lock
from tasks.formats.recipe import Recipe, load_recipe
from tasks.formats.recipe_base import RecipeError
from tasks.formats.recipe_download import SourceConfig
from tasks.formats.storage import Storage
from tasks.policies.licenses import policy_problems
from tasks.stages.release import (
    ReleaseResult,
    commit_release_index,
    fingerprint,
    latest,
    next_version,
    place_file,
    read_index,
    releases_dir,
    set_latest,
    verify_shard,
    write_tables,
)

REPORT_COLUMNS = [
    "key",
    "source",
    "status",
    "reason",
    "text_only",
    "images",
    "tiles",
    "tokens_text",
    "tokens_image",
    "tokens_total",
]


@dataclass
class FinetuneSummary:
    """What the fine-tuning phases made: counts, the padding cut-off, packs and their fill."""

    dataset: str
    run: str
    counts: Counts
    stats: dict[str, Any]
    outputs: list[PackShardResult] = field(default_factory=list)
    seconds: float = 0.0


@task(name="plan-records", task_run_name="records-plan-{source.name}")
def plan_records_task(storage: Storage, dataset: str, source: SourceConfig, cfg, options: dict) -> IngestPlan:
    return plan_ingest(storage, dataset, source, cfg, options)


@task(name="ingest-records", task_run_name="records-{plan.source.name}-{part.index:05d}")
def ingest_range_task(storage: Storage, plan: IngestPlan, part: RecordRange, cfg, options: dict) -> RangeResult:
    return ingest_range(storage, plan, part, cfg, options)


@task(name="join-records", task_run_name="records-join-{plan.source.name}")
def join_records_task(storage: Storage, plan: IngestPlan, parts: list[RangeResult]) -> IngestResult:
    return finish_ingest(storage, plan, parts)


@task(name="build-samples", task_run_name="samples-{source}-{index:06d}")
def build_task(
    storage: Storage,
    source: str,
    index: int,
    chunk: str,
    first_image: int,
    ledgers: list[str],
    cfg,
    tar_rel: str,
    table_rel: str,
) -> BuildResult:
    return build_samples(storage, source, index, chunk, first_image, ledgers, cfg, tar_rel, table_rel)


@task(name="plan-packs")
def plan_task(storage: Storage, tables: list[str], cfg, per_shard: int, seed: int | None) -> tuple[PackPlan, pa.Table]:
    """The pack plan, and the sample rows (report and gate columns) of every record."""
    from tasks.finetune.packs import PLAN_COLUMNS

    loaded = [read_parquet(storage, t) for t in tables]
    plan = plan_packs([t.select(PLAN_COLUMNS) for t in loaded], cfg, per_shard, seed)
    return plan, pa.concat_tables(loaded)


@task(name="write-packs", task_run_name="packs-{spec.index:06d}")
def write_task(storage: Storage, spec, cfg, tar_rel: str, ledger_rel: str) -> PackShardResult:
    return write_pack_shard(storage, spec, cfg, tar_rel, ledger_rel)


@task(name="verify-shard", task_run_name="verify-{tar}")
def verify_task(storage: Storage, tar: str, sha256: str) -> dict:
    return verify_shard(storage, tar, sha256, ("json",))


def image_recipe(
    recipe: Recipe, ingests: list[IngestResult], storage: Storage, rows_per_shard: dict[str, int]
) -> Recipe | None:
    """The recipe the download and validate phases run on: one image manifest per records source.

    Images have no captions; licenses come from the records (or ``conversation.license``).
    """
    sources = [
        SourceConfig(
            name=image_source_name(i.source),
            manifest=storage.url(i.image_manifest),
            format="jsonl",
            caption_column=None,
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
    validate = v.model_copy(update={"caption": v.caption.model_copy(update={"required": False})})
    return recipe.model_copy(update={"sources": tuple(sources), "validate_": validate})


def _chunk_ledgers(ledgers: list[str], source: str, first: int, end: int, rows_per_shard: int) -> list[str]:
    """The image-phase ledgers (``{dataset}/{phase}/{source}/{index:06d}-{hash}...``) that hold rows first..end."""
    if end <= first:
        return []
    wanted = set(range(first // rows_per_shard, (end - 1) // rows_per_shard + 1))
    out = []
    for rel in ledgers:
        parts = rel.split("/")
        if parts[-2] == source and int(parts[-1].split("-", 1)[0]) in wanted:
            out.append(rel)
    return out


@flow(name="finetune-ingest")
def ingest_flow(recipe: Recipe) -> list[IngestResult]:
    """Read and check every records file; derive the manifests of images to fetch.

    Per source: a plan task hashes the file and counts records per byte range, one task per
    range reads and checks its records (in parallel), and a join task orders their outputs.
    """
    storage = Storage(recipe.storage, recipe.storage_options)
    retries = dict(retries=recipe.execution.task_retries, retry_delay_seconds=recipe.execution.task_retry_delay_s)
    opts = recipe.storage_options
    plans = [
        plan_records_task.with_options(**retries).submit(storage, recipe.dataset, s, recipe.finetune, opts)
        for s in recipe.sources
    ]
    joins: list[Any] = []
    for future in plans:
        plan = future.result()
        if plan.done is not None:
            joins.append(plan.done)
            continue
        parts = [
            ingest_range_task.with_options(**retries).submit(storage, plan, r, recipe.finetune, opts)
            for r in plan.ranges
        ]
        joins.append(join_records_task.with_options(**retries).submit(storage, plan, parts))
    return [j if isinstance(j, IngestResult) else j.result() for j in joins]


@flow(name="finetune")
def finetune_flow(
    recipe: Recipe, ingests: list[IngestResult], download: Any, validated: Any, run: dict
) -> tuple[dict, dict]:
    """Samples (images joined back, tiles, tags, tokens) -> padding and packing -> gates -> release."""
    logger = get_run_logger()
    started = time.perf_counter()
    storage = Storage(recipe.storage, recipe.storage_options)
    cfg = recipe.finetune
    retries = dict(retries=recipe.execution.task_retries, retry_delay_seconds=recipe.execution.task_retry_delay_s)
    rps = {s.name: s.rows_per_shard for s in recipe.sources}
    dl_ledgers = list(download.ledgers) if download is not None else []
    val_ledgers = list(validated.ledgers) if validated is not None else []
    out: dict[str, Any] = {}
    progress = create_progress_artifact(
        0.0, key=f"{recipe.dataset}-finetune-progress", description=f"{recipe.dataset}: fine-tuning samples and packs"
    )
    futures = {}
    for ing in ingests:
        src = image_source_name(ing.source)
        for index, (chunk, (first, end)) in enumerate(zip(ing.chunks, ing.chunk_image_rows)):
            ledgers = _chunk_ledgers(dl_ledgers, src, first, end, rps[ing.source]) + _chunk_ledgers(
                val_ledgers, src, first, end, rps[ing.source]
            )
            tar_rel, table_rel = build_paths(recipe.dataset, ing.source, index, chunk, cfg, ledgers)
            futures[
                build_task.with_options(**retries).submit(
                    storage, ing.source, index, chunk, first, ledgers, cfg, tar_rel, table_rel
                )
            ] = tar_rel
    built: list[BuildResult] = gather(futures, progress, 0.0, 50.0, logger, "samples")
    built.sort(key=lambda b: (b.source, b.index))
    plan, rows = plan_task.submit(
        storage, [b.table for b in built], cfg, recipe.reshard.samples_per_shard, recipe.reshard.seed
    ).result()
    names = [n for n in rows.column("tokenizer").to_pylist() if n]
    plan.stats["tokenizer"] = names[0] if names else None

    futures = {}
    for spec in plan.outputs:
        tar_rel, ledger_rel = output_paths(recipe.dataset, spec, cfg)
        futures[write_task.with_options(**retries).submit(storage, spec, cfg, tar_rel, ledger_rel)] = tar_rel
    outputs: list[PackShardResult] = sorted(
        gather(futures, progress, 50.0, 40.0, logger, "packs"), key=lambda o: o.index
    )
    checks = {
        c["shard"]: c
        for c in gather(
            {verify_task.submit(storage, o.tar, o.sha256): o.tar for o in outputs},
            progress,
            90.0,
            10.0,
            logger,
            "verify",
        )
    }

    from tasks.audit.finetune_gate import finetune_gate
    from tasks.audit.gates import reshard_gate

    per_shard = recipe.reshard.samples_per_shard
    shard_rows = [dict(checks[o.tar], is_last=(i == len(outputs) - 1)) for i, o in enumerate(outputs)]
    n_packs = sum(len(s.packs) for s in plan.outputs)
    gate = reshard_gate(pa.Table.from_pylist(shard_rows) if shard_rows else pa.table({}), per_shard, n_packs)
    links = run_gate(storage, recipe, run, gate)
    pack_ledger = pa.table(
        {
            "key": [p["key"] for o in outputs for p in o.packs],
            "source": ["packs"] * n_packs,
            "status": ["ok"] * n_packs,
            "reason": pa.nulls(n_packs, pa.string()),
        }
    )
    run["phases"].append(
        phase_record("reshard", Counts.of(pack_ledger), pack_ledger, time.perf_counter() - started, 0.0, gate, links)
    )
    check_gate(storage, recipe, run, gate)

    ledger, samples, report = _final_tables(rows, plan, outputs)
    packs = (
        pa.Table.from_pylist(
            [{k: p[k] for k in ("key", "tokens", "images", "tiles", "samples")} for o in outputs for p in o.packs]
        )
        if n_packs
        else pa.table({})
    )
    gate = finetune_gate(ledger, samples, packs, recipe.gates.finetune, cfg.packing)
    links = run_gate(storage, recipe, run, gate)
    counts = Counts.of(ledger)
    seconds = time.perf_counter() - started
    record = phase_record(
        "finetune", counts, ledger, seconds, round(counts.ok / seconds, 1) if seconds else 0.0, gate, links
    )
    record["packing"] = plan.stats
    run["phases"].append(record)
    update_progress_artifact(progress, 100.0)
    check_gate(storage, recipe, run, gate, report)
    logger.info(
        "finetune: %d records, %d accepted, %d packs, fill %.4f (pad-to-longest %.4f), cut-off %d",
        counts.rows,
        counts.ok,
        n_packs,
        plan.stats["fill_ratio"] or 0,
        plan.stats["pad_to_longest_ratio"],
        plan.cutoff,
    )
    out["finetune"] = FinetuneSummary(recipe.dataset, run["run"], counts, plan.stats, outputs, round(seconds, 3))
    out["release"], run = release_finetune(recipe, storage, ingests, out["finetune"], ledger, report, run)
    return out, run


def _final_tables(
    rows: pa.Table, plan: PackPlan, outputs: list[PackShardResult]
) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(ledger: every record's fate; samples: one row per accepted sample, for the gate; report rows)."""
    verdict = {v["key"]: v for v in plan.verdicts.to_pylist()}
    where = {}
    for o in outputs:
        for p in o.packs:
            for k in p["members"]:
                where[k] = (p["key"], f"shard-{o.index:06d}.tar")
    led, smp = [], []
    for r in rows.select(["key", "source", "row", "id", "tags_ok", "text_only", "images", "tokens_total"]).to_pylist():
        v = verdict[r["key"]]
        pack, shard = where.get(r["key"], (None, None))
        status = v["status"] if v["status"] != "ok" or pack is not None else "error"
        reason = v["reason"] if status == v["status"] else "image_failed"
        led.append(
            {
                "key": r["key"],
                "source": r["source"],
                "row": r["row"],
                "id": r["id"],
                "status": status,
                "reason": reason,
                "detail": v["detail"],
                "pack": pack,
                "shard": shard,
                "truncated": v["truncated"],
            }
        )
        if status == "ok":
            smp.append(
                {
                    "key": r["key"],
                    "pack": pack,
                    "shard": shard,
                    "tags_ok": r["tags_ok"],
                    "schema_ok": r["images"] is not None and r["tokens_total"] is not None,
                    "text_only": r["text_only"],
                    "tokens": r["tokens_total"],
                }
            )
    ledger = pa.Table.from_pylist(led)
    samples = pa.Table.from_pylist(smp) if smp else pa.table({"key": pa.array([], pa.string())})
    report = rows.select(REPORT_COLUMNS).drop_columns(["status", "reason"])
    report = report.append_column("status", ledger.column("status")).append_column("reason", ledger.column("reason"))
    return ledger, samples, report


def release_finetune(
    recipe: Recipe,
    storage: Storage,
    ingests: list[IngestResult],
    summary: FinetuneSummary,
    ledger: pa.Table,
    report: pa.Table,
    run: dict,
) -> tuple[ReleaseResult, dict]:
    """Make ``releases/vNNNN/`` of the packed shards unless the latest release has the same content."""
    logger = get_run_logger()
    base_dir = releases_dir(recipe.dataset)
    outputs = summary.outputs
    names = [f"shard-{o.index:06d}.tar" for o in outputs]
    shards = [{"name": n, "sha256": o.sha256, "bytes": o.bytes, "samples": o.samples} for n, o in zip(names, outputs)]
    n_samples = sum(p["samples"] for o in outputs for p in o.packs)
    fp = fingerprint(shards, recipe.recipe_hash())
    head = latest(storage, recipe.dataset)
    if head is not None and read_index(storage, recipe.dataset, head).get("fingerprint") == fp:
        logger.info("release: unchanged since %s; no new release", head)
        run["release"] = {"version": head, "created": False}
        publish(storage, recipe, run, report)
        return ReleaseResult(head, storage.url(f"{base_dir}/{head}"), False, n_samples, len(shards)), run
    # Packs hold the ok records; the fine-tuning gate checked each is in exactly one pack.
    reconciled = reconcile(storage, recipe, run, ledger, None, sum(i.rows for i in ingests))

    version = next_version(storage, recipe.dataset)
    base = f"{base_dir}/{version}"
    for name, o in zip(names, outputs):
        place_file(storage, o.tar, f"{base}/{name}")
    index_inputs = [ShardIndexInput(name=n, size=o.bytes, samples=o.records) for n, o in zip(names, outputs)]
    # Packs are not one image and one caption: Energon reads them as CrudeWebdataset samples,
    # decoded by a cooker in the training TaskEncoder.
    for rel, data in all_indexes(index_inputs, name=recipe.dataset, sample_type=ENERGON_CRUDE_TYPE).items():
        storage.write_bytes(f"{base}/{rel}", data)
    pack_rows = [
        {
            "key": p["key"],
            "shard": n,
            "offset": r.offset,
            "length": r.length,
            "tokens": p["tokens"],
            "images": p["images"],
            "tiles": p["tiles"],
            "samples": p["samples"],
            "sample_keys": p["members"],
        }
        for n, o in zip(names, outputs)
        for p, r in zip(o.packs, o.records)
    ]
    write_tables(
        storage,
        base,
        pa.Table.from_pylist(pack_rows) if pack_rows else pa.table({"key": pa.array([], pa.string())}),
        ledger,
    )

    run["release"] = {"version": version, "created": True, "path": storage.url(base)}
    publish(storage, recipe, run, report)
    reports = report_dir(recipe, run["run"])
    gates = copy_audit(storage, recipe, run, base, reconciled)
    cfg = recipe.finetune
    t = cfg.tiling
    tokenizer = summary.stats.get("tokenizer")
    index = commit_release_index(
        storage,
        base,
        version=version,
        dataset=recipe.dataset,
        kind=recipe.kind,
        fp=fp,
        parent=head,
        run=run["run"],
        shards=shards,
        # samples: WebDataset samples in the shards (packs when packed), as in every release and
        # as readers count them; records: the conversation samples they hold.
        totals={
            "samples": sum(s["samples"] for s in shards),
            "records": n_samples,
            "packs": sum(s["samples"] for s in shards) if cfg.packing.packed else 0,
            "bytes": sum(s["bytes"] for s in shards),
            "shards": len(shards),
            "packs_per_shard": recipe.reshard.samples_per_shard,
            "tail": shards[-1]["samples"] if shards else 0,
        },
        schema={
            "packed": cfg.packing.packed,
            "budget": cfg.packing.budget,
            "max_images": cfg.packing.max_images,
            "max_tiles": cfg.packing.max_tiles,
            "tile_size": t.tile_size,
            "tokens_per_tile": t.tokens_per_tile,
            "max_tiles_per_image": t.max_tiles,
            "thumbnail": t.thumbnail,
            "store": t.store,
            "tags": {
                "image_start": t.image_start,
                "image_end": t.image_end,
                "tile": t.tile_tag,
                "thumbnail": t.thumbnail_tag,
                "all": all_tags(t),
            },
            "tokenizer": tokenizer,
            "padding": {"cutoff": summary.stats["cutoff"], "policy": cfg.padding.policy, "mode": cfg.padding.cutoff},
        },
        shuffle_seed=recipe.reshard.seed,
        recipe_hash=recipe.recipe_hash(),
        sources={i.source: {"sha256": i.sha256, "records": i.rows} for i in ingests},
        gates=gates,
        ledger_rows=ledger.num_rows,
        released=n_samples,
        reports=reports,
        extra={"packing": summary.stats},
    )
    set_latest(storage, recipe.dataset, version)
    create_markdown_artifact(
        f"# {recipe.dataset} {version}\n\n{n_samples} samples in {index['totals']['samples']} {'packs' if cfg.packing.packed else 'records'}, {len(shards)} shards; "
        f"fill ratio {summary.stats['fill_ratio']}; parent {head or '-'}.\n\n`{storage.url(base)}`\n",
        key=f"{recipe.dataset}-release",
        description=f"{recipe.dataset}: latest release",
    )
    logger.info("released %s: %d samples in %d shards at %s", version, n_samples, len(shards), storage.url(base))
    return ReleaseResult(version, storage.url(base), True, n_samples, len(shards)), run


def run_finetuning(recipe: Recipe, session: Session | None = None) -> dict:
    """Run every fine-tuning phase on one Dask cluster; returns each phase's summary.

    ``session`` holds the cluster the caller started (see run_phases).
    """
    if recipe.kind != "finetuning":
        raise RecipeError(f"{recipe.dataset}: kind is {recipe.kind}, not finetuning")
    problems = policy_problems(recipe.validate_.license)
    if problems:
        raise RecipeError("\n".join(f"validate.license: {p}" for p in problems))
    record = new_run(recipe, run_name())
    ex = recipe.execution
    out: dict[str, Any] = {}
    # One run per dataset at a time: a second one waits or refuses, naming the holder.
    lock = run_lock(Storage(recipe.storage, recipe.storage_options), recipe.dataset, record["run"])
    cluster = (
        contextlib.nullcontext() if session is not None else dask_cluster(ex.cluster, ex.workers, ex.threads_per_worker)
    )
    with lock as held, cluster as scheduler, cleanup_on_stop(session, held):
        # The CLI's session starts its cluster when the first task is submitted (or earlier, when
        # it saw work coming); a flow run from a deployment has its cluster here already.
        runner = session.task_runner() if session is not None else DaskTaskRunner(address=scheduler)
        ingests = ingest_flow.with_options(task_runner=runner)(recipe=recipe)
        images = image_recipe(
            recipe,
            ingests,
            Storage(recipe.storage, recipe.storage_options),
            {s.name: s.rows_per_shard for s in recipe.sources},
        )
        if images is not None:
            out["download"], record = download_flow.with_options(task_runner=runner)(
                recipe=images, run=record, fuse_validation=True
            )
            out["validate"], record = validate_flow.with_options(task_runner=runner)(
                recipe=images, download=out["download"], run=record
            )
        held.check()
        phases, record = finetune_flow.with_options(task_runner=runner)(
            recipe=recipe, ingests=ingests, download=out.get("download"), validated=out.get("validate"), run=record
        )
        out.update(phases)
    out["run"] = record["run"]
    out["record"] = record
    return out


@flow(name="finetuning")
def finetuning_flow(
    recipe_path: str,
    cluster: str | None = None,
    storage: str | None = None,
    workers: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict:
    """Run a fine-tuning recipe end to end.

    Args:
        recipe_path: the recipe YAML (``kind: finetuning``).
        cluster: local, cuda or a Dask scheduler address; overrides the recipe.
        storage: storage root (local path or s3:// URL); overrides the recipe.
        workers: worker processes of a local cluster; overrides the recipe.
        overrides: other recipe keys, dotted: ``{"finetune.packing.budget": 4096}``.
    """
    overrides = dict(overrides or {})
    for key, value in (("execution.cluster", cluster), ("storage", storage), ("execution.workers", workers)):
        if value:
            overrides[key] = value
    return run_finetuning(load_recipe(recipe_path, overrides))


__all__ = ["GateFailed", "finetuning_flow", "run_finetuning"]
