"""The pretraining dataset end to end: its phases in order on one Dask cluster."""

from __future__ import annotations

from typing import Literal

from prefect import flow
from prefect_dask import DaskTaskRunner

from flows.download import download_flow, run_name
from flows.runtime import dask_cluster
from tasks.recipe import Recipe, load_recipe

Phase = Literal["download"]
PHASES: tuple[Phase, ...] = ("download",)


@flow(name="pretraining")
def pretraining_flow(
    recipe_path: str,
    phases: list[Phase] | None = None,
    cluster: str | None = None,
    storage: str | None = None,
    workers: int | None = None,
) -> dict:
    """Run the recipe's phases (all by default) and return each phase's summary.

    Args:
        recipe_path: the recipe YAML.
        phases: which phases to run, in pipeline order.
        cluster: ``local``, ``cuda`` or a Dask scheduler address; overrides the recipe.
        storage: storage root (local path or s3:// URL); overrides the recipe.
        workers: worker processes of a local cluster; overrides the recipe.
    """
    overrides = {}
    if cluster:
        overrides["execution.cluster"] = cluster
    if storage:
        overrides["storage"] = storage
    if workers:
        overrides["execution.workers"] = workers
    recipe = load_recipe(recipe_path, overrides)
    return run_phases(recipe, list(phases or PHASES))


def run_phases(recipe: Recipe, phases: list[str]) -> dict:
    run = run_name()
    ex = recipe.execution
    out: dict = {"run": run}
    with dask_cluster(ex.cluster, ex.workers, ex.threads_per_worker) as address:
        runner = DaskTaskRunner(address=address)
        if "download" in phases:
            out["download"] = download_flow.with_options(task_runner=runner)(recipe=recipe, run=run)
    return out
