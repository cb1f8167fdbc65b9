"""The release phase: an immutable, indexed version of the dataset, committed by its index.json."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from flows.audit import GateFailed, publish, report_dir, run_gate
from flows.curate import CurateSummary
from flows.phase import phase_flow
from flows.precache import PrecacheSummary
from flows.reshard import ReshardSummary
from flows.validate import ValidateSummary
from tasks.audit.changes import Changes, since_release
from tasks.audit.download_summary import DownloadSummary
from tasks.audit.runrecord import ReleaseRecord, RunRecord
from tasks.formats.indexes import ShardIndexInput, all_indexes, dali_indexes
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
    release_problems,
    release_shard_names,
    releases_dir,
    set_latest,
    write_tables,
)
from tasks.stages.release_tables import one_per_row, release_tables


def _extra(
    latent_shards: list[dict[str, Any]],
    encodings: dict[str, Any],
    curated: CurateSummary | None,
    changes: Changes | None = None,
) -> dict | None:
    """index.json's entries of the optional phases: precache's latents, curation's model and
    cuts; and the counts of what changed since the last release (none for a first release)."""
    extra: dict[str, Any] = {}
    if changes is not None:
        extra["changes"] = changes.summary()
    if latent_shards:
        extra["precache"] = {"shards": latent_shards, "encodings": encodings}
    if curated is not None:
        extra["curation"] = {
            "model_sha256": curated.model,
            "compute_dtype": curated.compute_dtype,
            "cuts": curated.cuts,
            "removed": curated.counts.by_reason,
        }
    return extra or None


class Unreconciled(GateFailed):
    """The ledgers do not account for every manifest row exactly once; nothing is released."""


# Where each released sample is and every row's fate: the ledgers read on a worker.
release_tables_task = task(name="release-tables")(release_tables)


def reconcile(
    storage: Storage,
    recipe: Recipe,
    run: RunRecord,
    ledger: pa.Table,
    outputs: pa.Table | None,
    manifest_rows: int,
    shards: int | None = None,
    started: float | None = None,
    changes: Changes | None = None,
) -> tuple[dict, RunRecord]:
    """Gate the release on reconciliation (rows in = ok + rejected + error, no duplicate rows,
    no output without an ok ledger row) and on gates.upkeep's bounds of ``changes`` (what the
    release changes since the last one); raise ``Unreconciled`` after writing the report.

    Returns the gate's entry for index.json, and the run with its ``release`` phase: every
    manifest row's final fate (``ledger``), the released ``shards``, the seconds since ``started``
    (a ``time.perf_counter()``) and this gate; the report's phase table ends with it.
    """
    from flows.audit import phase_record
    from tasks.audit.reconcile import UPKEEP_COLUMNS, Reconciliation, release_gate
    from tasks.formats.ledger import Counts

    tally = Reconciliation(manifest_rows)
    tally.add_ledger(ledger)
    if outputs is not None:
        tally.add_outputs(outputs)
    gate = release_gate(tally, check_outputs=outputs is not None, changes=changes, bounds=recipe.gates.upkeep)
    links = run_gate(storage, recipe, run, gate)
    counts = Counts.of(ledger)
    seconds = time.perf_counter() - started if started is not None else 0.0
    rate = round(counts.ok / seconds, 1) if seconds else 0.0
    run = run.with_phase(phase_record("release", counts, ledger, seconds, rate, gate, links, shards))
    if not gate.success:
        run, url = publish(storage, recipe, run.blocked_by(gate.failure_message()))
        bounded = all(o.column in UPKEEP_COLUMNS for o in gate.failed)
        why = "too much changed since the last release" if bounded else "ledgers do not reconcile"
        # The changes named in the message reach the failure alert (flows/alerts.py) with it.
        seen = f"\n{changes.text()}" if changes is not None and changes.any else ""
        raise Unreconciled(f"{why}; nothing released: {run.blocked}{seen}\nreport: {url}", run)
    return {"success": True, "outcomes": [o.__dict__ for o in gate.outcomes]}, run


def copy_audit(storage: Storage, recipe: Recipe, run: RunRecord, base: str, reconciled: dict) -> dict:
    """Copy the run's report, run.json and every gate's JSON (the reconciliation's included)
    into the release folder ``base``; return the gates' entry for index.json."""
    reports = report_dir(recipe, run.run)
    for rel in ("report.html", "run.json"):
        storage.write_bytes(f"{base}/{rel}", storage.read_bytes(f"{reports}/{rel}"))
    gates = {}
    for phase in run.phases:
        if phase.gate:
            name = phase.phase
            storage.write_bytes(f"{base}/gates/{name}.json", storage.read_bytes(f"{reports}/gates/{name}.json"))
            gates[name] = {"success": phase.gate["success"], "outcomes": phase.gate["outcomes"]}
    storage.write_bytes(f"{base}/gates/release.json", storage.read_bytes(f"{reports}/gates/release.json"))
    gates["release"] = reconciled
    return gates


def unchanged(
    storage: Storage,
    recipe: Recipe,
    run: RunRecord,
    fp: str,
    samples: int,
    shards: int,
    report: pa.Table | None = None,
    rows: int | None = None,
) -> tuple[str | None, RunRecord, ReleaseResult | None]:
    """(the latest release, the run record, and a result when that release has this very
    content ``fp`` and its ledger as many rows as the run has input ``rows``: then the run records
    it and publishes its report, and nothing new is released). New input rows that all failed
    (or failed rows gone from the manifest) change no shard, but the release ledger must have
    one row per input row: they make a new release."""
    head = latest(storage, recipe.dataset)
    if head is None:
        return head, run, None
    index = read_index(storage, recipe.dataset, head)
    if index.get("fingerprint") != fp:
        return head, run, None
    held = (index.get("ledger") or {}).get("rows")
    if rows is not None and held is not None and held != rows:
        get_run_logger().info("release: %s has these shards but %s ledger rows for %s input rows", head, held, rows)
        return head, run, None
    damaged = release_problems(storage, recipe.dataset, head)
    if damaged:
        # The same content, but not all of it is stored any more: release it again, whole, under
        # the next number (a release folder is never rewritten).
        get_run_logger().warning(
            "release: %s has this content but is damaged (%s); releasing it again", head, "; ".join(damaged[:5])
        )
        return head, run, None
    get_run_logger().info("release: unchanged since %s; no new release", head)
    run, _ = publish(storage, recipe, run.with_release(ReleaseRecord(head, created=False)), report)
    url = storage.url(f"{releases_dir(recipe.dataset)}/{head}")
    return head, run, ReleaseResult(head, url, False, samples, shards)


@dataclass(frozen=True)
class NewRelease:
    """A release being made: where it goes and the entries of its index.json that every kind has.

    Args:
        version: its version (``vNNNN``, the next free one).
        base: its folder under the storage root.
        fp: the fingerprint of its content.
        parent: the latest release before it (None for the first).
        shards: index.json's shard entries (name, sha256, bytes, samples).
        reconciled: the reconciliation gate's entry (``reconcile``).
    """

    version: str
    base: str
    fp: str
    parent: str | None
    shards: list[dict[str, Any]]
    reconciled: dict

    @classmethod
    def next(
        cls,
        storage: Storage,
        recipe: Recipe,
        fp: str,
        parent: str | None,
        shards: list[dict[str, Any]],
        reconciled: dict,
    ) -> NewRelease:
        """The next version of the recipe's dataset, with its folder."""
        version = next_version(storage, recipe.dataset)
        return cls(version, f"{releases_dir(recipe.dataset)}/{version}", fp, parent, shards, reconciled)


def commit_new_release(
    storage: Storage,
    recipe: Recipe,
    run: RunRecord,
    new: NewRelease,
    report: pa.Table | None = None,
    **fields: Any,
) -> tuple[dict[str, Any], RunRecord]:
    """Record the new release in the run, publish the report, copy the audit into the release's
    folder, then commit its index.json (``fields``: the kind's entries, as
    ``tasks.stages.release.commit_release_index`` takes them); returns the index and the record."""
    record = ReleaseRecord(new.version, created=True, path=storage.url(new.base))
    run, _ = publish(storage, recipe, run.with_release(record), report)
    index = commit_release_index(
        storage,
        new.base,
        # what the recipe and the run say, then what this release is
        dataset=recipe.dataset,
        kind=recipe.kind,
        recipe_hash=recipe.recipe_hash(),
        run=run.run,
        reports=report_dir(recipe, run.run),
        version=new.version,
        fp=new.fp,
        parent=new.parent,
        shards=new.shards,
        gates=copy_audit(storage, recipe, run, new.base, new.reconciled),
        **fields,
    )
    return index, run


def announce(storage: Storage, recipe: Recipe, new: NewRelease, samples: int, text: str) -> ReleaseResult:
    """Move LATEST to the committed release and say so: an artifact (``text`` as its body) and a log line."""
    version, url, shards = new.version, storage.url(new.base), len(new.shards)
    set_latest(storage, recipe.dataset, version)
    create_markdown_artifact(
        f"# {recipe.dataset} {version}\n\n{text}\n\n`{url}`\n",
        key=f"{recipe.dataset}-release",
        description=f"{recipe.dataset}: latest release",
    )
    get_run_logger().info("released %s: %d samples in %d shards at %s", version, samples, shards, url)
    return ReleaseResult(version, url, True, samples, shards)


@phase_flow(name="release", validate_parameters=False)  # inputs: earlier phases' typed results (flows/phase.py)
def release_flow(
    recipe: Recipe,
    download: DownloadSummary,
    validated: ValidateSummary,
    reshard: ReshardSummary,
    run: RunRecord,
    precache: PrecacheSummary | None = None,
    curated: CurateSummary | None = None,
) -> tuple[ReleaseResult, RunRecord]:
    """Make ``releases/vNNNN/`` unless the latest release already has the same content.

    With ``precache`` (the precache phase's summary), the latent shards go under ``latents/``
    beside the image shards they mirror, each with its DALI index, and index.json records
    them and their encodings under ``precache``. With ``curated`` (the curation phase's
    summary), the rows curation removed get their fate from its ledgers, and index.json
    records the dual encoder's digest and the cuts under ``curation``.
    """
    started = time.perf_counter()
    storage = Storage(recipe.storage, recipe.storage_options)
    names = release_shard_names([o.sha256 for o in reshard.outputs])
    shards = [
        {"name": n, "sha256": o.sha256, "bytes": o.bytes, "samples": o.samples} for n, o in zip(names, reshard.outputs)
    ]
    latents, encodings = (precache.results, precache.encodings) if precache is not None else ([], {})
    latent_shards: list[dict[str, Any]] = [
        {"name": f"latents/{n}", "image_shard": n, "sha256": r.sha256, "bytes": r.bytes, "samples": r.samples}
        for n, r in zip(names, latents)
    ]
    upkeep = reshard.upkeep
    # Rows a recheck flagged but the recipe keeps change no shard: a new release records them.
    applied = f":upkeep:{upkeep.digest}" if upkeep is not None and upkeep.digest else ""
    fp = fingerprint(shards + latent_shards, recipe.recipe_hash() + applied)
    head, run, same = unchanged(storage, recipe, run, fp, reshard.samples, len(shards), rows=download.counts.rows)
    if same is not None:
        return same, run

    samples, ledger = release_tables_task.submit(
        storage,
        download.ledgers,
        validated.ledgers,
        [(n, o.ledger) for n, o in zip(names, reshard.outputs)],
        reshard.incomplete_rows,
        curated.ledgers if curated is not None else [],
        upkeep.removed if upkeep is not None else None,
        upkeep.flagged if upkeep is not None else None,
    ).result()
    # The released samples come from the reshard ledgers, the ok rows from the samples table;
    # reconciling the download and validate ledgers' ok rows too would count a row per phase.
    # A video's clips are one output of its row (the ledger has one fate per row already).
    outputs = one_per_row(samples).select(["source", "row"])
    # What this release changes since the latest one (none for a first release): in the report,
    # the run's summary, index.json, and gated by gates.upkeep.
    changes = since_release(storage, recipe.dataset, head, ledger)
    run = run.with_changes(changes.to_json()) if changes is not None else run
    reconciled, run = reconcile(
        storage, recipe, run, ledger, outputs, download.counts.rows, len(shards), started, changes
    )

    new = NewRelease.next(storage, recipe, fp, head, shards, reconciled)
    base = new.base
    for name, o in zip(names, reshard.outputs):
        place_file(storage, o.tar, f"{base}/{name}")
    index_inputs = [ShardIndexInput(name=n, size=o.bytes, samples=o.records) for n, o in zip(names, reshard.outputs)]
    # Two index files per shard: fsynced together, once, before index.json commits them.
    for rel, data in all_indexes(index_inputs, name=recipe.dataset).items():
        storage.write_bytes(f"{base}/{rel}", data, fsync=False)
    if latent_shards:
        for entry, r in zip(latent_shards, latents):
            place_file(storage, r.tar, f"{base}/{entry['name']}")
        latent_inputs = [
            ShardIndexInput(name=e["name"], size=r.bytes, samples=r.records) for e, r in zip(latent_shards, latents)
        ]
        for rel, data in dali_indexes(latent_inputs).items():
            storage.write_bytes(f"{base}/{rel}", data, fsync=False)
    write_tables(storage, base, samples, ledger)

    _, run = commit_new_release(
        storage,
        recipe,
        run,
        new,
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
        sources={name: {"sha256": sha} for name, sha in download.manifests.items()},
        ledger_rows=ledger.num_rows,
        released=reshard.samples,
        extra=_extra(latent_shards, encodings, curated, changes),
    )
    text = (
        f"{reshard.samples} samples in {len(shards)} shards "
        f"({reshard.samples_per_shard} per shard, tail {reshard.tail}); parent {head or '-'}."
    ) + (f"\n\n{changes.text()}." if changes is not None else "")
    return announce(storage, recipe, new, reshard.samples, text), run
