"""The reshard phase: equal-size shards planned from counts, built from byte ranges in a few large tasks, then gated."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from prefect import task

from flows.curate import CurateSummary
from flows.phase import Phase, all_skipped, phase_flow
from flows.runtime import default_workers
from flows.validate import ValidateSummary
from tasks.audit.download_summary import DownloadSummary
from tasks.audit.runrecord import RunRecord
from tasks.formats.ledger import Counts, committed_pairs
from tasks.formats.recipe import Recipe
from tasks.formats.recipe_outputs import ReshardConfig
from tasks.formats.storage import Storage
from tasks.stages.reshard import InputCensus, census_inputs, count_inputs, group_outputs, plan_reshard
from tasks.stages.reshard_build import OutputResult, build_outputs, recorded_output
from tasks.stages.upkeep import UpkeepResult, apply_upkeep


@dataclass
class ReshardSummary:
    """The resharded dataset: equal shards (the last holds ``tail``), and their records.

    ``upkeep``: what the takedown lists and the recheck outcomes removed from the inputs or
    flagged in them (None when the recipe has neither). ``timings``: wall seconds of the phase's
    steps (``start``: the progress artifact and the flow's Dask client; ``upkeep``: applying the
    lists and the rechecks, where there were any; ``plan``: counting and planning; ``build``:
    the build tasks, checks included; ``gate``: the Great Expectations suite; ``report``: its
    JSON, Data Docs, the phase record and the HTML report).
    """

    dataset: str
    run: str
    samples_per_shard: int
    seed: int | None
    samples: int
    tail: int
    incomplete: int
    outputs: list[OutputResult] = field(default_factory=list)
    incomplete_rows: list[pa.Table] = field(default_factory=list)  # ledger rows of samples not carried
    upkeep: UpkeepResult | None = None
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


@task(name="reshard-census", task_run_name="census-{first}")
def census_task(
    storage: Storage, tars: list[str], ledgers: list[str], required: tuple[str, ...], first: str
) -> list[InputCensus]:
    return census_inputs(storage, tars, ledgers, required=required)


@task(name="reshard-upkeep")
def upkeep_task(storage: Storage, dataset: str, inputs: dict[str, Any]) -> UpkeepResult:
    return apply_upkeep(storage, dataset, **inputs)


@task(name="reshard-shards", task_run_name="reshard-{first:06d}-{last:06d}")
def build_task(storage: Storage, outputs: tuple, first: int, last: int) -> list[OutputResult]:
    return build_outputs(storage, outputs)


@phase_flow(name="reshard", validate_parameters=False)  # inputs: earlier phases' typed results (flows/phase.py)
def reshard_flow(
    recipe: Recipe,
    validated: ValidateSummary | CurateSummary,
    run: RunRecord,
    download: DownloadSummary | None = None,
    validation: ValidateSummary | None = None,
) -> tuple[ReshardSummary, RunRecord]:
    """Reshard the validated (or curated) shards into shards of exactly N samples, check them, and gate.

    First the takedown lists and the recheck outcomes are applied to those shards' ledgers
    (tasks/stages/upkeep.py): rows they remove are rejected in overlay ledgers beside the same
    tars, which the plan then reads. ``validation`` (the validation phase's summary, where
    ``validated`` is curation's) and ``download`` give the facts the lists match: URLs, digests,
    perceptual hashes, the sha256 of the bytes as fetched.

    Tasks are few and large (``group_outputs``): one run of consecutive outputs per worker
    thread, or a multiple of that for large datasets. Each output is checked by the task that
    writes it, from what its writer recorded (tasks/stages/reshard_check.py); the gate judges those
    rows, so no task reads the outputs back.
    """
    from tasks.audit.gates import reshard_gate

    ph = Phase(recipe, run, "reshard", "reshard")
    storage, cfg = ph.storage, recipe.reshard
    required = cfg.required(recipe.validate_)
    timings = {"start": ph.seconds}
    mark = time.perf_counter()
    upkeep = _upkeep(ph, validated, download, validation)
    tars, ledgers = (upkeep.tars, upkeep.ledgers) if upkeep is not None else (validated.tars, validated.ledgers)
    if upkeep is not None:
        timings["upkeep"] = time.perf_counter() - mark
        mark = time.perf_counter()

    # The validate phase writes the image and json of every ok sample, and its txt when
    # captions are required (ReshardConfig's default members): its ledgers then vouch for
    # completeness, and counting ok rows replaces the census.
    if set(required) <= set(ReshardConfig().required(recipe.validate_)):
        inputs = count_inputs(storage, tars, ledgers)
        censuses: list[InputCensus] = []
        accepted_in = sum(s.count for s in inputs)
    else:
        censuses = _census(ph, tars, ledgers, required, _task_slots(recipe))
        inputs = [c.shard for c in censuses]
        accepted_in = sum(c.ok for c in censuses)
    incomplete = sum(c.incomplete.num_rows for c in censuses)
    plan = plan_reshard(
        inputs, cfg.samples_per_shard, prefix=f"{recipe.dataset}/reshard", seed=cfg.seed, required=required
    )
    timings["plan"] = time.perf_counter() - mark

    mark = time.perf_counter()
    # Outputs an earlier run committed (same plan, so same names) are read back here, in the
    # flow; only the rest go to the cluster, which a rerun with nothing new never needs.
    done = committed_pairs(storage, [(o.name, o.ledger) for o in plan.outputs])
    outputs: list[OutputResult] = [recorded_output(storage, o) for o in plan.outputs if o.ledger in done]
    todo = [o for o in plan.outputs if o.ledger not in done]
    if todo:
        todo_plan = dataclasses.replace(plan, outputs=tuple(todo))
        futures = {
            ph.submit(build_task, storage, g, g[0].index, g[-1].index): f"outputs {g[0].index}..{g[-1].index}"
            for g in group_outputs(todo_plan, _task_slots(recipe))
        }
        outputs += [o for part in ph.gather(futures, 10.0, 80.0, "reshard", shards=len(todo)) for o in part]
    outputs.sort(key=lambda r: r.index)
    timings["build"] = time.perf_counter() - mark

    mark = time.perf_counter()

    def evaluate():
        rows = [dict(o.check, is_last=(i == len(outputs) - 1)) for i, o in enumerate(outputs)]
        return reshard_gate(
            pa.Table.from_pylist(rows) if rows else pa.table({}), cfg.samples_per_shard, accepted_in - incomplete
        )

    # A rerun over outputs committed before reuses the verdict on exactly these outputs.
    settings = (cfg.samples_per_shard, accepted_in - incomplete, tuple(required), [o.check for o in outputs])
    gate, links = ph.judge([o.ledger for o in outputs], settings, evaluate)
    timings["gate"] = time.perf_counter() - mark

    mark = time.perf_counter()
    summary = ReshardSummary(
        dataset=recipe.dataset,
        run=run.run,
        samples_per_shard=cfg.samples_per_shard,
        seed=cfg.seed,
        samples=plan.total,
        tail=plan.tail,
        incomplete=incomplete,
        outputs=outputs,
        incomplete_rows=[c.incomplete for c in censuses if c.incomplete.num_rows],
        upkeep=upkeep,
        timings=timings,
    )
    removed = [upkeep.removed] if upkeep is not None and upkeep.removed.num_rows else []
    ledger = _phase_ledger(outputs, summary.incomplete_rows + removed)
    counts = Counts.of(ledger) if ledger.num_rows else Counts.zero()
    seconds = ph.seconds
    ph.record(
        counts,
        ledger,
        ph.rate(sum(o.samples for o in outputs if not o.skipped), seconds),
        gate,
        links,
        seconds=seconds,
        shards=len(outputs),
        skipped=all_skipped(outputs),
    )
    ph.close(gate, _shown(storage, recipe, run, removed), _why_empty(plan.total, removed))
    timings["report"] = time.perf_counter() - mark
    summary.seconds = round(ph.seconds, 3)
    ph.logger.info(
        "reshard: %d samples into %d shards of %d (tail %d) in %.2f s: %s",
        plan.total,
        len(outputs),
        cfg.samples_per_shard,
        plan.tail,
        summary.seconds,
        {k: round(v, 2) for k, v in timings.items()},
    )
    return summary, ph.run


def _upkeep(
    ph: Phase,
    kept: ValidateSummary | CurateSummary,
    download: DownloadSummary | None,
    validation: ValidateSummary | None,
) -> UpkeepResult | None:
    """The takedown lists and the recheck outcomes applied to the kept shards, in one task; None
    when the recipe names no list and no row was ever rechecked (nothing is read then).

    A list that cannot be read or holds a bad line stops the phase here, naming the list and
    the line: a bad entry must never match nothing in silence."""
    from tasks.formats.recheck_store import read_current
    from tasks.formats.takedown import read_lists

    recipe, storage = ph.recipe, ph.storage
    lists = read_lists(recipe.takedown, recipe.storage_options)
    # What rechecks saw of the rows the current download chunks hold, not of chunks the manifest has since moved away from
    recheck = read_current(storage, recipe.dataset, list(download.ledgers) if download is not None else [])
    if not lists and not recheck.num_rows:
        return None
    facts = validation or (kept if isinstance(kept, ValidateSummary) else None)
    inputs = {
        "tars": list(kept.tars),
        "ledgers": list(kept.ledgers),
        "lists": lists,
        "recheck": recheck,
        "actions": recipe.download.recheck.actions,
        "facts": list(facts.ledgers) if facts is not None else None,
        "downloads": list(download.ledgers) if download is not None else [],
    }
    (result,) = ph.gather({ph.submit(upkeep_task, storage, recipe.dataset, inputs): "upkeep"}, 0.0, 5.0, "upkeep")
    counts = result.counts()
    if counts:
        ph.logger.info(
            "reshard: upkeep in %.2f s (%d overlay ledgers written): %s", result.seconds, result.overlays, counts
        )
    return result


def _census(ph: Phase, tars: list[str], ledgers: list[str], required: tuple[str, ...], slots: int) -> list[InputCensus]:
    """Census of every input, in as many tasks as the cluster has slots (a ledger read each is milliseconds)."""
    pairs = list(zip(tars, ledgers))
    parts = max(1, min(slots, len(pairs)))
    groups = [pairs[k * len(pairs) // parts : (k + 1) * len(pairs) // parts] for k in range(parts)]
    futures = {
        ph.submit(census_task, ph.storage, [t for t, _ in g], [led for _, led in g], required, g[0][0]): g[0][0]
        for g in groups
        if g
    }
    censuses = [c for part in ph.gather(futures, 0.0, 10.0, "census") for c in part]
    order = {t: i for i, t in enumerate(tars)}
    return sorted(censuses, key=lambda c: order[c.shard.tar])


def _why_empty(samples: int, removed: list[pa.Table]) -> str:
    """What a reshard with no sample left says where upkeep removed the last ones: the release is
    refused, and the latest one still holds them."""
    if samples or not removed:
        return ""
    reasons = pa.concat_arrays([t.column("reason").combine_chunks() for t in removed]).value_counts().to_pylist()
    counted = ", ".join(f"{r['values']} {r['counts']}" for r in sorted(reasons, key=lambda r: -r["counts"]))
    return (
        f"upkeep removed every sample left ({counted}); no release of none is made, and the latest "
        "release still holds them: docs/guide/upkeep.md says how to withdraw it"
    )


def _shown(storage: Storage, recipe: Recipe, run: RunRecord, removed: list[pa.Table]) -> pa.Table | None:
    """The run's report samples without pictures of what upkeep removed (a taken-down sample's
    thumbnail must not ship in the release's report); None: the table as the validation phase
    wrote it."""
    if not removed:
        return None
    from flows.audit import report_dir
    from tasks.audit.report import SAMPLES_PARQUET, read_samples
    from tasks.audit.validate_samples import without_pictures

    samples = read_samples(storage, f"{report_dir(recipe, run.run)}/{SAMPLES_PARQUET}")
    if samples is None or "key" not in samples.column_names:
        return None
    return without_pictures(samples, pa.concat_arrays([t.column("key").combine_chunks() for t in removed]))


def _phase_ledger(outputs: list[OutputResult], incomplete: list[pa.Table]) -> pa.Table:
    """The phase's rows for its record: one per carried sample (from the outputs' layouts) and per incomplete one."""
    parts = []
    for o in outputs:
        layout = o.layout
        if layout is None:  # every reshard output reports its layout
            raise ValueError(f"reshard output {o.tar} reported no layout")
        n = layout.num_rows
        parts.append(
            pa.table(
                {
                    "key": layout.column("key"),
                    "source": layout.column("source"),
                    "status": pa.array(["ok"] * n, pa.string()),
                    "reason": pa.nulls(n, pa.string()),
                    "bytes": layout.column("bytes"),
                }
            )
        )
    parts += [
        t.select(["key", "source", "status", "reason"]).append_column(
            "bytes", t.column("bytes") if "bytes" in t.column_names else pa.nulls(t.num_rows, pa.int64())
        )
        for t in incomplete
    ]
    if not parts:
        return pa.table({"source": pa.array([], pa.string()), "status": pa.array([], pa.string())})
    return pa.concat_tables(parts)


def _task_slots(recipe: Recipe) -> int:
    """Tasks the cluster runs at once: its workers' threads as the Dask scheduler reports them,
    else the recipe's local worker count."""
    from prefect.context import get_run_context
    from prefect_dask import DaskTaskRunner

    runner = get_run_context().task_runner
    if isinstance(runner, DaskTaskRunner):
        workers = runner.client.scheduler_info()["workers"]
        if workers:
            return sum(int(w.get("nthreads", 1)) for w in workers.values())
    return (recipe.execution.workers or default_workers()) * recipe.execution.threads_per_worker
