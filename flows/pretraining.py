"""The pretraining dataset end to end: its phases in order on one Dask cluster."""

from __future__ import annotations

import contextlib
from typing import Literal

from prefect import flow
from prefect_dask import DaskTaskRunner

from flows.audit import GateFailed, intermediate_phase, new_run, publish_unfinished
from flows.curate import curate_flow
from flows.download import download_flow, run_name
from flows.params import ClusterChoice, RecipeOverrides, RecipePath, StorageRoot, Workers, recipe_overrides
from flows.phase import run_phase
from flows.precache import precache_flow
from flows.preflight import phases_problem, remember_run
from flows.recheck import recheck_flow
from flows.release import release_flow
from flows.reshard import reshard_flow
from flows.runtime import dask_cluster
from flows.session import Session, cleanup_on_stop
from flows.validate import validate_flow
from tasks.formats.locks import run_lock
from tasks.formats.recipe import Recipe, load_recipe
from tasks.formats.recipe_base import RecipeError
from tasks.formats.storage import Storage
from tasks.policies.licenses import policy_problems

Phase = Literal["download", "validate", "curate", "reshard", "precache", "release"]
PHASES: tuple[Phase, ...] = ("download", "validate", "curate", "reshard", "precache", "release")


@flow(name="pretraining")
def pretraining_flow(
    recipe_path: RecipePath,
    phases: list[Phase] | None = None,
    cluster: ClusterChoice | None = None,
    storage: StorageRoot | None = None,
    workers: Workers | None = None,
    overrides: RecipeOverrides | None = None,
) -> dict:
    """Run the recipe's phases (all by default) and return each phase's summary.

    Args:
        recipe_path: the recipe YAML; relative to the project folder.
        phases: which phases to run, in pipeline order; empty runs them all.
        cluster: local, cuda or a Dask scheduler address; overrides the recipe.
        storage: storage root (local path or s3:// URL); overrides the recipe.
        workers: worker processes of a local cluster; overrides the recipe.
        overrides: recipe values for this run (shard size, gate thresholds, other keys dotted).
    """
    recipe = load_recipe(recipe_path, recipe_overrides(overrides, cluster, storage, workers))
    return run_phases(recipe, list(phases or PHASES))


def stored_outputs(out: dict) -> list[str]:
    """Every file the phases of a run left for the next run to skip on: what the next run's
    up-to-date check finds stored, or runs again (the download's raw shards are not needed)."""
    files: list[str] = list(out["download"].ledgers)
    for phase in ("validate", "curate"):
        if out.get(phase) is not None:
            files += [*out[phase].ledgers, *out[phase].tars]
    if out.get("curate") is not None:
        files += list(out["curate"].side_shards.values())
    if out.get("reshard") is not None:
        files += [f for o in out["reshard"].outputs for f in (o.tar, o.ledger)]
    if out.get("precache") is not None:
        files += [f for r in out["precache"].results for f in (r.tar, r.ledger)]
    return files


def due_at(out: dict) -> str | None:
    """When the earliest retry (download) or recheck (released rows) of this run's dataset falls
    due, as ISO time; None when nothing will."""
    times = [getattr(out.get("download"), "next_retry_at", None), getattr(out.get("recheck"), "next_recheck_at", None)]
    known = [t for t in times if t is not None]
    return min(known).isoformat() if known else None


def run_phases(recipe: Recipe, phases: list[str], session: Session | None = None) -> dict:
    """Run phases in pipeline order; a phase needs the ones before it (done now or earlier:
    their committed shards are skipped, so rerunning them is cheap).

    ``session`` holds the cluster the caller started (the CLI starts it beside the Prefect
    server); without it the recipe's ``execution.cluster`` is used here.
    """
    wanted = [p for p in PHASES if p in phases]
    if not wanted:
        return {}
    last = PHASES.index(wanted[-1])
    problems = policy_problems(recipe.validate_.license)
    if problems:
        # An allowlist entry that names no license would silently match nothing.
        raise RecipeError("\n".join(f"validate.license: {p}" for p in problems))
    if recipe.takedown and last >= PHASES.index("reshard"):
        from tasks.formats.takedown import TakedownError, read_lists

        try:  # a bad entry must stop the run before it starts, never match nothing
            read_lists(recipe.takedown, recipe.storage_options)
        except TakedownError as err:
            raise RecipeError(str(err)) from None
    problem = phases_problem(recipe, wanted)
    if problem:
        raise RecipeError(problem)
    record = new_run(recipe, run_name())
    ex = recipe.execution
    out: dict = {"run": record.run, "record": record}
    # One run per dataset at a time: a second one waits or refuses, naming the holder.
    lock = run_lock(Storage(recipe.storage, recipe.storage_options), recipe.dataset, record.run)
    cluster = (
        contextlib.nullcontext() if session is not None else dask_cluster(ex.cluster, ex.workers, ex.threads_per_worker)
    )
    with lock as held, cluster as scheduler, cleanup_on_stop(session, held):
        # The CLI's session starts its cluster when the first task is submitted (or earlier, when
        # it saw work coming); a flow run from a deployment has its cluster here already.
        runner = session.task_runner() if session is not None else DaskTaskRunner(address=scheduler)
        pending = False  # an intermediate phase's report page is still to be written

        def phase(name: str, flow, **params):
            # A phase before the run's last leaves the report page to the phases after it.
            nonlocal pending
            intermediate = PHASES.index(name) < last
            with intermediate_phase(intermediate):
                done = run_phase(flow, runner, run=record, **params)
            pending = intermediate
            return done

        try:
            # With validation to follow, each chunk is fetched and validated in one pass.
            fuse = last >= PHASES.index("validate")
            out["download"], record = phase("download", download_flow, recipe=recipe, fuse_validation=fuse)
            if last >= PHASES.index("release"):
                # Released rows checked again (download.recheck) before the release that applies it.
                out["recheck"] = run_phase(recheck_flow, runner, recipe=recipe, ledgers=out["download"].ledgers)
            if last >= PHASES.index("validate"):
                out["validate"], record = phase("validate", validate_flow, recipe=recipe, download=out["download"])
            if last >= PHASES.index("curate") and recipe.curate.enabled:
                out["curate"], record = phase("curate", curate_flow, recipe=recipe, validated=out["validate"])
            # Resharding reads the curated shards when there was curation, the validated ones otherwise.
            kept = out.get("curate") or out.get("validate")
            if last >= PHASES.index("reshard"):
                out["reshard"], record = phase(
                    "reshard",
                    reshard_flow,
                    recipe=recipe,
                    validated=kept,
                    download=out["download"],
                    validation=out["validate"],
                )
            if last >= PHASES.index("precache"):
                out["precache"], record = phase(
                    "precache", precache_flow, recipe=recipe, reshard=out["reshard"], curated=out.get("curate")
                )
            if last >= PHASES.index("release"):
                held.check()
                out["release"], record = phase(
                    "release",
                    release_flow,
                    recipe=recipe,
                    download=out["download"],
                    validated=out["validate"],
                    curated=out.get("curate"),
                    reshard=out["reshard"],
                    precache=out["precache"],
                )
        except GateFailed:
            raise  # its phase published the whole report
        except BaseException:
            if pending:
                publish_unfinished(Storage(recipe.storage, recipe.storage_options), recipe, record)
            raise
        release = out.get("release")
        remember_run(
            Storage(recipe.storage, recipe.storage_options),
            recipe,
            list(PHASES[: last + 1]),
            out["download"].ledgers,
            record.run,
            release.version if release else None,
            stored_outputs(out),
            due_at(out),
        )
    out["record"] = record
    return out
