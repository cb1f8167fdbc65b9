"""The fine-tuning release: packed shards, their indexes and tables, committed by index.json."""

from __future__ import annotations

import time

import pyarrow as pa

from flows.release import NewRelease, announce, commit_new_release, reconcile, unchanged
from tasks.audit.runrecord import RunRecord
from tasks.finetune.ingest import IngestResult
from tasks.finetune.outcome import FinetuneSummary, records_in, release_packs, shard_names
from tasks.finetune.tiling import all_tags
from tasks.formats.indexes import ENERGON_CRUDE_TYPE, ShardIndexInput, all_indexes
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage
from tasks.stages.release import ReleaseResult, fingerprint, place_file, write_tables


def release_finetune(
    recipe: Recipe,
    storage: Storage,
    ingests: list[IngestResult],
    summary: FinetuneSummary,
    ledger: pa.Table,
    report: pa.Table,
    run: RunRecord,
) -> tuple[ReleaseResult, RunRecord]:
    """Make ``releases/vNNNN/`` of the packed shards unless the latest release has the same content."""
    started = time.perf_counter()
    outputs = summary.outputs
    by_tar = shard_names(outputs)
    names = [by_tar[o.tar] for o in outputs]
    shards = [{"name": n, "sha256": o.sha256, "bytes": o.bytes, "samples": o.samples} for n, o in zip(names, outputs)]
    n_samples = records_in(outputs)
    fp = fingerprint(shards, recipe.recipe_hash())
    head, run, same = unchanged(storage, recipe, run, fp, n_samples, len(shards), report, rows=ledger.num_rows)
    if same is not None:
        return same, run
    # Packs hold the ok records; the fine-tuning gate checked each is in exactly one pack.
    reconciled, run = reconcile(storage, recipe, run, ledger, None, sum(i.rows for i in ingests), len(shards), started)

    new = NewRelease.next(storage, recipe, fp, head, shards, reconciled)
    base = new.base
    for name, o in zip(names, outputs):
        place_file(storage, o.tar, f"{base}/{name}")
    index_inputs = [ShardIndexInput(name=n, size=o.bytes, samples=o.records) for n, o in zip(names, outputs)]
    # Packs are not one image and one caption: Energon reads them as CrudeWebdataset samples,
    # decoded by a cooker in the training TaskEncoder.
    for rel, data in all_indexes(index_inputs, name=recipe.dataset, sample_type=ENERGON_CRUDE_TYPE).items():
        storage.write_bytes(f"{base}/{rel}", data)
    write_tables(storage, base, release_packs(outputs), ledger)

    cfg = recipe.finetune
    t = cfg.tiling
    tokenizer = summary.stats.get("tokenizer")
    index, run = commit_new_release(
        storage,
        recipe,
        run,
        new,
        report,
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
        sources={i.source: {"sha256": i.sha256, "records": i.rows} for i in ingests},
        ledger_rows=ledger.num_rows,
        released=n_samples,
        extra={"packing": summary.stats},
    )
    text = (
        f"{n_samples} samples in {index['totals']['samples']} {'packs' if cfg.packing.packed else 'records'}, {len(shards)} shards; "
        f"fill ratio {summary.stats['fill_ratio']}; parent {head or '-'}."
    )
    return announce(storage, recipe, new, n_samples, text), run
