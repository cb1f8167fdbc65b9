"""`shardsmith run` and `shardsmith demo`: a recipe's phases on a session's Prefect API and Dask cluster."""

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
        from tasks.formats.locks import LockHeld, LockLost
        from tasks.stages.precache_models import PrecacheError

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
            except (ManifestError, PhaseFailed, NoGPU, GateFailed, LockHeld, LockLost, PrecacheError) as err:
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


def demo(
    directory: Annotated[Path, typer.Option("--dir", help="Where the demo corpus and its outputs go.")] = Path(
        "shardsmith-demo"
    ),
    images: Annotated[int, typer.Option(help="Images in the generated corpus.")] = 300,
    workers: Annotated[int | None, typer.Option(help="Worker processes of the local cluster.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect's and Dask's INFO logs.")] = False,
    examples: Annotated[
        bool,
        typer.Option(
            "--examples",
            help="Instead: make the example recipes' inputs from the demo's pictures and run every recipes/example-*.yaml to a release.",
        ),
    ] = False,
    video: Annotated[
        bool,
        typer.Option(
            "--video",
            help="Instead: generate the video demo (short videos, a scene cut, a few bad files), serve it and run recipes/demo-video.yaml to a release of clips.",
        ),
    ] = False,
    nights: Annotated[
        bool,
        typer.Option(
            "--nights",
            help="Instead: four nightly runs of recipes/demo-nights.yaml over a loopback web that fails, heals, changes and opts out, with a takedown list on night 3; prints each night's diff.",
        ),
    ] = False,
) -> None:
    """Generate a demo corpus, serve it on loopback, and run the demo recipe on it."""
    quiet_logs(verbose)
    from tasks.demo.corpus import prepare_demo

    directory = directory.resolve()
    if examples:
        run_examples(directory, images, workers)
        return
    if video:
        run_video_demo(directory, workers)
        return
    if nights:
        from cli.nights import run_nights_demo

        run_nights_demo(directory, workers)
        return
    typer.echo(f"demo corpus: {directory}")
    server, expected = prepare_demo(directory, n=images)
    result = run_served(server, directory, "demo.yaml", workers)
    got = result["download"].counts
    same = (got.rows, got.ok, got.by_reason) == (expected["rows"], expected["ok"], expected["by_reason"])
    problems = demo_curation_problems(result, expected, directory / "store")
    verdict = "matches" if same and not problems else "DIFFERS from"
    typer.echo(
        f"\nThe outcome {verdict} what the corpus generator expected ({expected['rows']} rows, {expected['ok']} ok; "
        f"curation removed {len(expected['curation'])} planted rows): {directory / 'manifests' / 'EXPECTED.json'}"
    )
    for p in problems:
        typer.echo(f"  {p}")
    if not same or problems:
        raise typer.Exit(1)


def run_served(server: Any, directory: Path, recipe: str, workers: int | None) -> dict:
    """Run the demo recipe ``recipe`` (every phase) while ``server`` serves its corpus, which
    ``directory`` holds; the server stops after, and the run's summary is printed."""
    from flows.params import explicit_overrides
    from flows.preflight import PHASES

    try:
        typer.echo(f"serving it at {server.base_url}")
        os.environ["SHARDSMITH_DEMO_DIR"] = str(directory)
        with live_progress(True):
            result = run_recipe(RECIPES / recipe, list(PHASES), explicit_overrides({}, workers=workers))
    finally:
        server.stop()
    print_summary(result)
    return result


def run_video_demo(directory: Path, workers: int | None) -> None:
    """The video demo: its corpus served on loopback, recipes/demo-video.yaml run to a release,
    and every row's fate in the release ledger checked against what the corpus planted."""
    import pyarrow.parquet as pq

    from tasks.demo.video_corpus import fate_problems, prepare_video_demo

    typer.echo(f"video demo: {directory}")
    server, expected = prepare_video_demo(directory)
    result = run_served(server, directory, "demo-video.yaml", workers)
    release = result.get("release")
    names = list(expected["fates"])
    problems = ["nothing was released"]
    if release is not None:
        ledger = pq.read_table(Path(release.path) / "ledger.parquet")
        problems = fate_problems(expected, ledger.to_pylist(), names)
    verdict = "matches" if not problems else "DIFFERS from"
    typer.echo(
        f"\nEvery video's fate {verdict} what the corpus planted: {directory / 'manifests' / 'VIDEO-EXPECTED.json'}"
    )
    for p in problems:
        typer.echo(f"  {p}")
    if problems:
        raise typer.Exit(1)


def run_examples(directory: Path, images: int, workers: int | None) -> None:
    """The example recipes on inputs made from the demo's pictures (``SHARDSMITH_EXAMPLE_DIR`` is
    ``directory/examples``), each to a release; a summary and where each release is."""
    from flows.params import explicit_overrides
    from flows.preflight import PHASES
    from tasks.demo.examples import make_example_inputs
    from tasks.demo.images import ensure_images

    pictures = ensure_images(directory, max(images, 60))
    made = make_example_inputs(directory / "examples", pictures, directory / "images")
    typer.echo(f"example inputs: {', '.join(f'{k} {v}' for k, v in made.items())}")
    os.environ["SHARDSMITH_EXAMPLE_DIR"] = str(directory / "examples")
    released = []
    for recipe in sorted(RECIPES.glob("example-*.yaml")):
        typer.secho(f"\n{recipe.name}", bold=True)
        with live_progress(True):
            result = run_recipe(recipe, list(PHASES), explicit_overrides({}, workers=workers))
        print_summary(result)
        rel = result.get("release")
        released.append(
            f"  {recipe.name}: {rel.version} at {rel.path}" if rel is not None else f"  {recipe.name}: no release"
        )
    typer.echo("\nreleases:\n" + "\n".join(released))


def demo_curation_problems(result: dict, expected: dict, store: Path) -> list[str]:
    """Where the demo's curation differs from the rows its corpus planted (captions of another
    picture, copies, watermarks): each must go with its reason, and nothing else may."""
    import pyarrow.parquet as pq

    from tasks.demo.curation_rows import curation_problems

    def reasons(ledgers: list[str]) -> dict[str, str | None]:
        return {
            r["key"]: r["reason"]
            for p in ledgers
            for r in pq.read_table(store / p, columns=["key", "reason"]).to_pylist()
        }

    curate = result.get("curate")
    if curate is None:
        return ["the demo recipe ran no curation"]
    return curation_problems(expected["curation"], reasons(result["validate"].ledgers), reasons(curate.ledgers))
