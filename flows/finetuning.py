"""The fine-tuning dataset end to end: records, images, tiles, tokens, padding, packs, release."""

from __future__ import annotations

import contextlib
from typing import Any

from prefect import flow
from prefect_dask import DaskTaskRunner

from flows.audit import GateFailed, new_run
from flows.curate import curate_flow
from flows.download import download_flow, run_name
from flows.finetune_ingest import image_recipe, ingest_flow
from flows.finetune_packs import finetune_flow
from flows.params import cluster_or_env, explicit_overrides
from flows.phase import run_phase
from flows.preflight import gpu_problem, model_problem
from flows.runtime import dask_cluster
from flows.session import Session, cleanup_on_stop
from flows.validate import validate_flow
from tasks.formats.locks import run_lock
from tasks.formats.recipe import Recipe, load_recipe
from tasks.formats.recipe_base import RecipeError
from tasks.formats.storage import Storage
from tasks.policies.licenses import policy_problems


def run_finetuning(recipe: Recipe, session: Session | None = None) -> dict:
    """Run every fine-tuning phase on one Dask cluster; returns each phase's summary.

    ``session`` holds the cluster the caller started (see run_phases).
    """
    if recipe.kind != "finetuning":
        raise RecipeError(f"{recipe.dataset}: kind is {recipe.kind}, not finetuning")
    problems = policy_problems(recipe.validate_.license)
    if problems:
        raise RecipeError("\n".join(f"validate.license: {p}" for p in problems))
    problem = gpu_problem(recipe, []) or model_problem(recipe, [])
    if problem:
        raise RecipeError(problem)
    record = new_run(recipe, run_name())
    ex = recipe.execution
    out: dict[str, Any] = {}
    # One run per dataset at a time: a second one waits or refuses, naming the holder.
    lock = run_lock(Storage(recipe.storage, recipe.storage_options), recipe.dataset, record.run)
    cluster = (
        contextlib.nullcontext() if session is not None else dask_cluster(ex.cluster, ex.workers, ex.threads_per_worker)
    )
    with lock as held, cluster as scheduler, cleanup_on_stop(session, held):
        # The CLI's session starts its cluster when the first task is submitted (or earlier, when
        # it saw work coming); a flow run from a deployment has its cluster here already.
        runner = session.task_runner() if session is not None else DaskTaskRunner(address=scheduler)
        ingests = run_phase(ingest_flow, runner, recipe=recipe)
        images = image_recipe(recipe, ingests)
        if images is not None:
            out["download"], record = run_phase(download_flow, runner, recipe=images, run=record, fuse_validation=True)
            out["validate"], record = run_phase(
                validate_flow, runner, recipe=images, download=out["download"], run=record
            )
            if images.curate.enabled:
                out["curate"], record = run_phase(
                    curate_flow, runner, recipe=images, validated=out["validate"], run=record
                )
        held.check()
        phases, record = run_phase(
            finetune_flow,
            runner,
            recipe=recipe,
            ingests=ingests,
            download=out.get("download"),
            validated=out.get("validate"),
            run=record,
            curated=out.get("curate"),
        )
        out.update(phases)
    out["run"] = record.run
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
        cluster: local, cuda or a Dask scheduler address; overrides the recipe (default:
            ``SHARDSMITH_CLUSTER`` when set, as on the compose stack's worker).
        storage: storage root (local path or s3:// URL); overrides the recipe.
        workers: worker processes of a local cluster; overrides the recipe.
        overrides: other recipe keys, dotted: ``{"finetune.packing.budget": 4096}``.
    """
    return run_finetuning(
        load_recipe(recipe_path, explicit_overrides(overrides, cluster_or_env(cluster), storage, workers))
    )


__all__ = ["GateFailed", "finetuning_flow", "run_finetuning"]
