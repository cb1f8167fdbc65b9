"""The fine-tuning samples and packs: images joined back, tiles, tokens, padding, packing, gates."""

from __future__ import annotations

import bisect

import pyarrow as pa
from prefect import task

from flows.curate import CurateSummary
from flows.finetune_release import release_finetune
from flows.phase import Phase, all_skipped, phase_flow
from flows.validate import ValidateSummary
from tasks.audit.download_summary import DownloadSummary
from tasks.audit.runrecord import RunRecord
from tasks.finetune.ingest import IngestResult
from tasks.finetune.outcome import (
    FinetuneSummary,
    final_tables,
    pack_ledger,
    packs_table,
    plan_with_rows,
    turn_privacy,
)
from tasks.finetune.packs import PackShardResult, output_paths, write_pack_shard
from tasks.finetune.samples import BuildResult, build_paths, build_samples, image_source_name
from tasks.formats.ledger import Counts, read_parquet
from tasks.formats.reasons import original_of
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage
from tasks.stages.release import ReleaseResult, verify_shard


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


# The pack plan and every record's sample row, planned on a worker.
plan_task = task(name="plan-packs")(plan_with_rows)


@task(name="write-packs", task_run_name="packs-{spec.index:06d}")
def write_task(storage: Storage, spec, cfg, tar_rel: str, ledger_rel: str) -> PackShardResult:
    return write_pack_shard(storage, spec, cfg, tar_rel, ledger_rel)


@task(name="verify-shard", task_run_name="verify-{tar}")
def verify_task(storage: Storage, tar: str, sha256: str) -> dict:
    return verify_shard(storage, tar, sha256, ("json",))


def _duplicates(storage: Storage, image_ledgers: list[list[str]]) -> dict[str, dict[int, tuple[str, int]]]:
    """Per image source, the row of each image validation refused as a duplicate -> the image
    source and row of the one it duplicates, which may be another source's (dedup spans the
    dataset): from the key and reason of the validation ledgers, a few bytes a row."""
    out: dict[str, dict[int, tuple[str, int]]] = {}
    for rel in (rel for phase in image_ledgers for rel in phase if rel.split("/")[-3] == "validate"):
        table = read_parquet(storage, rel, ["key", "reason"])
        for key, reason in zip(table.column("key").to_pylist(), table.column("reason").to_pylist()):
            original = original_of(reason)
            if original is not None:
                source, row = original.rsplit("-", 1)
                out.setdefault(rel.split("/")[-2], {})[int(key.rsplit("-", 1)[1])] = (source, int(row))
    return out


def _by_shard(ledgers: list[str]) -> dict[tuple[str, int], list[str]]:
    """A phase's ledgers (``{dataset}/{phase}/{source}/{index:06d}-...``) by (source, shard index), in order."""
    out: dict[tuple[str, int], list[str]] = {}
    for rel in ledgers:
        parts = rel.split("/")
        out.setdefault((parts[-2], int(parts[-1].split("-", 1)[0])), []).append(rel)
    return out


def _build_samples(ph: Phase, ingests: list[IngestResult], image_ledgers: list[list[str]]) -> list[BuildResult]:
    """One sample-building task per records chunk, with the image ledgers (``image_ledgers``: the
    download phase's, then validation's, then curation's) that hold its rows, and those that
    hold the originals of its images that are exact duplicates (``samples.shared``; another
    source's too): a change to them builds the chunk again."""
    recipe = ph.recipe
    rps = {image_source_name(s.name): s.rows_per_shard for s in recipe.sources}
    duplicates = _duplicates(ph.storage, image_ledgers)
    phases = [_by_shard(phase) for phase in image_ledgers]
    futures = {}
    for ing in ingests:
        src = image_source_name(ing.source)
        dups = duplicates.get(src, {})
        dup_rows = sorted(dups)
        for index, (chunk, (first, end)) in enumerate(zip(ing.chunks, ing.chunk_image_rows)):
            shards = [(src, i) for i in range(first // rps[src], (end - 1) // rps[src] + 1)] if end > first else []
            inside = dup_rows[bisect.bisect_left(dup_rows, first) : bisect.bisect_left(dup_rows, end)]
            away = {(o, row // rps[o]) for o, row in (dups[d] for d in inside) if o != src or not first <= row < end}
            shards += sorted(away - set(shards))
            # each phase's after the one before: later phases win
            ledgers = [rel for phase in phases for shard in shards for rel in phase.get(shard, [])]
            tar_rel, table_rel = build_paths(recipe.dataset, ing.source, index, chunk, recipe.finetune, ledgers)
            args = (ph.storage, ing.source, index, chunk, first, ledgers, recipe.finetune, tar_rel, table_rel)
            futures[ph.submit(build_task, *args)] = tar_rel
    built: list[BuildResult] = ph.gather(futures, 0.0, 50.0, "samples")
    return sorted(built, key=lambda b: (b.source, b.index))


@phase_flow(name="finetune", validate_parameters=False)  # inputs: earlier phases' typed results (flows/phase.py)
def finetune_flow(
    recipe: Recipe,
    ingests: list[IngestResult],
    download: DownloadSummary | None,
    validated: ValidateSummary | None,
    run: RunRecord,
    curated: CurateSummary | None = None,
) -> tuple[dict, RunRecord]:
    """Samples (images joined back, tiles, tags, tokens) -> padding and packing -> gates -> release."""
    from tasks.audit.finetune_gate import finetune_gate
    from tasks.audit.gates import reshard_gate

    ph = Phase(recipe, run, "finetune", "fine-tuning samples and packs")
    storage, cfg = ph.storage, recipe.finetune
    # Later phases' rows win: an image curation removed has its curation reason.
    image_ledgers = [list(p.ledgers) for p in (download, validated, curated) if p is not None]
    built = _build_samples(ph, ingests, image_ledgers)
    plan, rows = plan_task.submit(
        storage, [b.table for b in built], cfg, recipe.reshard.samples_per_shard, recipe.reshard.seed
    ).result()

    futures = {}
    for spec in plan.outputs:
        tar_rel, ledger_rel = output_paths(recipe.dataset, spec, cfg)
        futures[ph.submit(write_task, storage, spec, cfg, tar_rel, ledger_rel)] = tar_rel
    outputs: list[PackShardResult] = sorted(ph.gather(futures, 50.0, 40.0, "packs"), key=lambda o: o.index)
    verified = ph.gather({verify_task.submit(storage, o.tar, o.sha256): o.tar for o in outputs}, 90.0, 10.0, "verify")
    checks = {c["shard"]: c for c in verified}

    shard_rows = [dict(checks[o.tar], is_last=(i == len(outputs) - 1)) for i, o in enumerate(outputs)]
    n_packs = sum(len(s.packs) for s in plan.outputs)
    gate = reshard_gate(
        pa.Table.from_pylist(shard_rows) if shard_rows else pa.table({}), recipe.reshard.samples_per_shard, n_packs
    )
    packs = pack_ledger(outputs)
    fresh_packs = ph.rate(sum(len(o.packs) for o in outputs if not o.skipped))
    ph.record(
        Counts.of(packs),
        packs,
        fresh_packs,
        gate,
        ph.links(gate),
        name="reshard",
        shards=len(outputs),
        skipped=all_skipped(outputs),
    )
    ph.close(gate, done=False)

    ledger, samples, report = final_tables(rows, plan, outputs)
    gate = finetune_gate(ledger, samples, packs_table(outputs), recipe.gates.finetune, cfg.packing)
    links = ph.links(gate)
    counts = Counts.of(ledger)
    seconds = ph.seconds
    ph.record(
        counts,
        ledger,
        ph.rate(counts.ok, seconds),
        gate,
        links,
        seconds=seconds,
        shards=len(outputs),
        packing=plan.stats,
    )
    ph.close(gate, report)
    ph.logger.info(
        "finetune: %d records, %d accepted, %d packs, fill %.4f (pad-to-longest %.4f), cut-off %d",
        counts.rows,
        counts.ok,
        n_packs,
        plan.stats["fill_ratio"] or 0,
        plan.stats["pad_to_longest_ratio"],
        plan.cutoff,
    )
    summary = FinetuneSummary(
        recipe.dataset, ph.run.run, counts, plan.stats, outputs, round(seconds, 3), turn_privacy(ledger)
    )
    release: ReleaseResult
    release, run = release_finetune(recipe, storage, ingests, summary, ledger, report, ph.run)
    return {"finetune": summary, "release": release}, run
