"""`shardsmith run`: a recipe's phases on a session's Prefect API and Dask cluster, with its live progress and summary."""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import fail
from cli.summary import print_json, print_summary

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


class PhaseName(str, Enum):
    download = "download"
    validate = "validate"
    curate = "curate"
    reshard = "reshard"
    precache = "precache"
    release = "release"


def parse_sets(values: list[str]) -> dict[str, object]:
    import yaml

    out: dict[str, object] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(raw)
    return out


def run_recipe(recipe_path: Path, phases: list[str], overrides: dict[str, Any], force: bool = True) -> dict:
    # Prefect, Dask and the flows are imported only once there is something to run.
    from flows.preflight import phases_problem, up_to_date, work_ahead
    from tasks.formats.manifests import ManifestError
    from tasks.formats.recipe import load_recipe
    from tasks.formats.recipe_base import RecipeError

    try:
        recipe = load_recipe(recipe_path, overrides)
        if recipe.execution.cluster == "cuda":
            from flows.runtime import require_gpu

            require_gpu()
        problem = phases_problem(recipe, phases)
        if problem:
            raise RecipeError(f"{recipe_path}: {problem}")
    except RecipeError as err:
        raise fail(str(err), 2) from None
    except RuntimeError as err:  # flows.runtime.NoGPU
        raise fail(str(err), 2) from None

    from flows.runtime import early_server

    # The local Prefect server, the slowest part to start (its answer is what a small run waits
    # for longest), starts before the planning and the flows' imports. Until a session owns
    # it, any way out (nothing to do, a failed plan, Ctrl-C) stops it unused.
    server = early_server()
    session = None
    try:
        try:
            # Nothing changed since the last run covered these phases: say so, start nothing more.
            pending = work_ahead(recipe, phases)
            last, gaps = (None, []) if force else up_to_date(recipe, phases, pending)
        except ManifestError as err:
            raise fail(f"{type(err).__name__}: {err}", 1) from None
        if last is not None:
            return {"up_to_date": last, "storage": recipe.storage, "dataset": recipe.dataset}
        if gaps:
            more = f"\n  ... and {len(gaps) - 10} more" if len(gaps) > 10 else ""
            typer.echo(
                "the last run's outputs are not all stored; this run makes them again:\n  "
                + "\n  ".join(gaps[:10])
                + more,
                err=True,
            )
        from flows.session import Session, stop_on_signals

        ex = recipe.execution
        session = Session(ex.cluster, ex.workers, ex.threads_per_worker, server=server)
    finally:
        if session is None and server is not None:
            server.stop()
    with session, stop_on_signals(session):
        if pending != 0:
            # Work is coming: the Dask cluster (no more workers than the tasks ahead: chunks to
            # fetch, or reshard outputs) starts now, beside the Prefect server, before this
            # process imports the flows; otherwise the flows start it at their first task.
            session.start_cluster(workers=pending)
        from prefect import flow

        from flows.audit import GateFailed
        from flows.download import PhaseFailed
        from flows.pretraining import run_phases
        from flows.runtime import NoGPU
        from tasks.finetune.records import RecordsError
        from tasks.formats.locks import LockHeld, LockLost
        from tasks.models.placement import ModelError

        @flow(name=f"shardsmith-{recipe.dataset}")
        def cli_run() -> dict:
            if recipe.kind == "finetuning":
                from flows.finetuning import run_finetuning

                return run_finetuning(recipe, session)  # its phases always run together
            return run_phases(recipe, phases, session)

        if pending != 0:
            # Great Expectations (seconds to import) for the first gate: imported while this
            # process waits for the Prefect server to answer, not after the first phase.
            from flows.phase import warm_gates

            warm_gates()
        with session.api():
            try:
                return cli_run()
            except RecipeError as err:
                raise fail(f"{recipe_path}: {err}", 2) from None
            except (ManifestError, RecordsError, PhaseFailed, NoGPU, GateFailed, LockHeld, LockLost, ModelError) as err:
                raise fail(f"{type(err).__name__}: {err}", 1) from None


def quiet_logs(verbose: bool) -> None:
    """Before Prefect and Dask are imported: their INFO logs off the terminal unless asked for.

    The Prefect UI still gets every log of the run (only the console handler is raised).
    """
    if verbose:
        return
    # A failed gate or shard is printed by the CLI itself, once, without a traceback.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    import logging
    import warnings

    # Our own warnings (a stale lock broken, a slow cluster close) still reach the terminal.
    ours = logging.getLogger("shardsmith")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    ours.addHandler(handler)
    ours.propagate = False
    # Dask says so when its default HTTP port is taken (another cluster runs); it picks another.
    warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)


def live_progress(enabled: bool):
    """The live per-phase progress display on stderr (off for --json, which prints only JSON)."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    from flows.progress import Terminal

    return Terminal()


def run(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML.", exists=True, dir_okay=False)],
    phase: Annotated[
        list[PhaseName] | None, typer.Option("--phase", "-p", help="Phase to run (repeatable); default: all.")
    ] = None,
    cluster: Annotated[str | None, typer.Option(help="local | cuda | tcp://scheduler:8786")] = None,
    storage: Annotated[str | None, typer.Option(help="Storage root: a local path or s3://bucket/prefix.")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes of a local cluster.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: download.timeout_s=5")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect's and Dask's INFO logs.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Run every phase even when the last run covered the same inputs.")
    ] = False,
) -> None:
    """Run a recipe's phases (nothing, when the last run covered them over the same inputs)."""
    quiet_logs(verbose)
    from flows.params import explicit_overrides
    from flows.preflight import PHASES

    overrides = explicit_overrides(parse_sets(set_ or []), cluster, storage, workers)

    phases = [p.value for p in phase] if phase else list(PHASES)
    with live_progress(not json_out):
        result = run_recipe(recipe, phases, overrides, force=force)
    if json_out:
        print_json(result)
    else:
        print_summary(result)
