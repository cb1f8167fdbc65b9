"""The release phase: an immutable, indexed version of the dataset, committed by its index.json."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from flows.audit import GateFailed, publish, report_dir, run_gate
from tasks.formats.indexes import ShardIndexInput, all_indexes, dali_indexes
from tasks.formats.ledger import read_parquet
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage
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
    write_tables,
)

LEDGER_COLUMNS = ["key", "source", "row", "status", "reason"]


class Unreconciled(GateFailed):
    """The ledgers do not account for every manifest row exactly once; nothing is released."""


@task(name="release-tables")
def release_tables(
    storage: Storage,
    download_ledgers: list[str],
    validate_ledgers: list[str],
    outputs: list[tuple[str, str]],
    incomplete: list[Any],
) -> tuple[pa.Table, pa.Table]:
    """(samples, ledger): where each released sample is, and every manifest row's final fate."""
    samples = []
    for name, ledger in outputs:
        t = read_parquet(storage, ledger, ["key", "source", "row", "offset", "length"])
        samples.append(t.append_column("shard", pa.array([name] * t.num_rows, pa.string())))
    samples_t = pa.concat_tables(samples) if samples else pa.table({"key": pa.array([], pa.string())})
    parts = []
    for phase, ledgers in (("download", download_ledgers), ("validate", validate_ledgers)):
        for rel in ledgers:
            t = read_parquet(storage, rel, LEDGER_COLUMNS)
            t = t.filter(pa.compute.not_equal(t.column("status"), "ok"))
            parts.append(t.append_column("phase", pa.array([phase] * t.num_rows, pa.string())))
    for t in incomplete:
        t = t.select(LEDGER_COLUMNS)
        parts.append(t.append_column("phase", pa.array(["reshard"] * t.num_rows, pa.string())))
    ok = samples_t.select(["key", "source", "row"])
    ok = ok.append_column("status", pa.array(["ok"] * ok.num_rows, pa.string()))
    ok = ok.append_column("reason", pa.array([None] * ok.num_rows, pa.string()))
    parts.append(ok.append_column("phase", pa.array(["release"] * ok.num_rows, pa.string())))
    return samples_t, pa.concat_tables(parts)


def reconcile(
    storage: Storage, recipe: Recipe, run: dict, ledger: pa.Table, outputs: pa.Table | None, manifest_rows: int
) -> dict:
    """Gate the release on reconciliation (rows in = ok + rejected + error, no duplicate rows,
    no output without an ok ledger row); raise ``Unreconciled`` after writing the report.

    Returns the gate's entry for index.json.
    """
    from tasks.audit.reconcile import Reconciliation, release_gate

    tally = Reconciliation(manifest_rows)
    tally.add_ledger(ledger)
    if outputs is not None:
        tally.add_outputs(outputs)
    gate = release_gate(tally, check_outputs=outputs is not None)
    run_gate(storage, recipe, run, gate)
    if not gate.success:
        run["blocked"] = gate.failure_message()
        url = publish(storage, recipe, run)
        raise Unreconciled(f"ledgers do not reconcile; nothing released: {run['blocked']}\nreport: {url}")
    return {"success": True, "outcomes": [o.__dict__ for o in gate.outcomes]}


def copy_audit(storage: Storage, recipe: Recipe, run: dict, base: str, reconciled: dict) -> dict:
    """Copy the run's report, run.json and every gate's JSON (the reconciliation's included)
    into the release folder ``base``; return the gates' entry for index.json."""
    reports = report_dir(recipe, run["run"])
    for rel in ("report.html", "run.json"):
        storage.write_bytes(f"{base}/{rel}", storage.read_bytes(f"{reports}/{rel}"))
    gates = {}
    for phase in run["phases"]:
        if phase.get("gate"):
            storage.write_bytes(
                f"{base}/gates/{phase['phase']}.json", storage.read_bytes(f"{reports}/gates/{phase['phase']}.json")
            )
            gates[phase["phase"]] = {"success": phase["gate"]["success"], "outcomes": phase["gate"]["outcomes"]}
    storage.write_bytes(f"{base}/gates/release.json", storage.read_bytes(f"{reports}/gates/release.json"))
    gates["release"] = reconciled
    return gates


@flow(name="release")
def release_flow(
    recipe: Recipe, download: Any, validated: Any, reshard: Any, run: dict, precache: Any = None
) -> tuple[ReleaseResult, dict]:
    """Make ``releases/vNNNN/`` unless the latest release already has the same content.

    With ``precache`` (the precache phase's summary), the latent shards go under ``latents/``
    beside the image shards they mirror, each with its DALI index, and index.json records
    them and their encodings under ``precache``.
    """
    logger = get_run_logger()
    storage = Storage(recipe.storage, recipe.storage_options)
    base_dir = releases_dir(recipe.dataset)
    names = [f"shard-{o.index:06d}.tar" for o in reshard.outputs]
    shards = [
        {"name": n, "sha256": o.sha256, "bytes": o.bytes, "samples": o.samples} for n, o in zip(names, reshard.outputs)
    ]
    latent_shards = [
        {"name": f"latents/{n}", "image_shard": n, "sha256": r.sha256, "bytes": r.bytes, "samples": r.samples}
        for n, r in zip(names, precache.results if precache else [])
    ]
    fp = fingerprint(shards + latent_shards, recipe.recipe_hash())
    head = latest(storage, recipe.dataset)
    if head is not None and read_index(storage, recipe.dataset, head).get("fingerprint") == fp:
        logger.info("release: unchanged since %s; no new release", head)
        run["release"] = {"version": head, "created": False}
        publish(storage, recipe, run)
        return ReleaseResult(head, storage.url(f"{base_dir}/{head}"), False, reshard.samples, len(shards)), run

    samples, ledger = release_tables.submit(
        storage,
        download.ledgers,
        validated.ledgers,
        [(n, o.ledger) for n, o in zip(names, reshard.outputs)],
        reshard.incomplete_rows,
    ).result()
    # The released samples come from the reshard ledgers, the ok rows from the samples table;
    # reconciling the download and validate ledgers' ok rows too would count a row per phase.
    reconciled = reconcile(storage, recipe, run, ledger, samples.select(["source", "row"]), download.counts.rows)

    version = next_version(storage, recipe.dataset)
    base = f"{base_dir}/{version}"
    for name, o in zip(names, reshard.outputs):
        place_file(storage, o.tar, f"{base}/{name}")
    index_inputs = [ShardIndexInput(name=n, size=o.bytes, samples=o.records) for n, o in zip(names, reshard.outputs)]
    # Two index files per shard: fsynced together, once, before index.json commits them.
    for rel, data in all_indexes(index_inputs, name=recipe.dataset).items():
        storage.write_bytes(f"{base}/{rel}", data, fsync=False)
    if latent_shards:
        for entry, r in zip(latent_shards, precache.results):
            place_file(storage, r.tar, f"{base}/{entry['name']}")
        latent_inputs = [
            ShardIndexInput(name=e["name"], size=r.bytes, samples=r.records)
            for e, r in zip(latent_shards, precache.results)
        ]
        for rel, data in dali_indexes(latent_inputs).items():
            storage.write_bytes(f"{base}/{rel}", data, fsync=False)
    write_tables(storage, base, samples, ledger)

    run["release"] = {"version": version, "created": True, "path": storage.url(base)}
    publish(storage, recipe, run)
    reports = report_dir(recipe, run["run"])
    gates = copy_audit(storage, recipe, run, base, reconciled)
    commit_release_index(
        storage,
        base,
        version=version,
        dataset=recipe.dataset,
        kind=recipe.kind,
        fp=fp,
        parent=head,
        run=run["run"],
        shards=shards,
        totals={
            "samples": reshard.samples,
            "bytes": sum(s["bytes"] for s in shards),
            "shards": len(shards),
            "samples_per_shard": reshard.samples_per_shard,
            "tail": reshard.tail,
        },
        schema={
            "members": list(recipe.reshard.required(recipe.validate_)),
            "image_format": recipe.validate_.image.output_format,
        },
        shuffle_seed=reshard.seed,
        recipe_hash=recipe.recipe_hash(),
        sources={name: {"sha256": sha} for name, sha in download.manifests.items()},
        gates=gates,
        ledger_rows=ledger.num_rows,
        released=reshard.samples,
        reports=reports,
        extra={"precache": {"shards": latent_shards, "encodings": precache.encodings}} if latent_shards else None,
    )
    set_latest(storage, recipe.dataset, version)
    create_markdown_artifact(
        f"# {recipe.dataset} {version}\n\n{reshard.samples} samples in {len(shards)} shards "
        f"({reshard.samples_per_shard} per shard, tail {reshard.tail}); parent {head or '-'}.\n\n`{storage.url(base)}`\n",
        key=f"{recipe.dataset}-release",
        description=f"{recipe.dataset}: latest release",
    )
    logger.info("released %s: %d samples in %d shards at %s", version, reshard.samples, len(shards), storage.url(base))
    return ReleaseResult(version, storage.url(base), True, reshard.samples, len(shards)), run
