"""`shardsmith demo`: demo corpora made and served on loopback, their recipes run to releases and every fate checked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.running import RECIPES, live_progress, quiet_logs, run_recipe
from cli.summary import print_summary


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
    problems += demo_privacy_problems(result, expected, directory / "store")
    verdict = "matches" if same and not problems else "DIFFERS from"
    typer.echo(
        f"\nThe outcome {verdict} what the corpus generator expected ({expected['rows']} rows, {expected['ok']} ok; "
        f"curation removed {len(expected['curation'])} planted rows; {len(expected['privacy'])} planted for the "
        f"privacy checks released redacted, blurred and without EXIF): {directory / 'manifests' / 'EXPECTED.json'}"
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


def demo_privacy_problems(result: dict, expected: dict, store: Path) -> list[str]:
    """Where the demo's privacy outcomes differ from the rows its corpus planted (personal data
    in captions, GPS EXIF, faces): each is released redacted, blurred and without EXIF, read
    back from its validated shard (the bytes the release copies), and no other row is flagged."""
    import pyarrow.parquet as pq

    from tasks.demo.privacy_rows import privacy_problems

    rows = {r["key"]: r for p in result["validate"].ledgers for r in pq.read_table(store / p).to_pylist()}

    def released(key: str) -> dict[str, bytes] | None:
        row = rows.get(key)
        if row is None or not row.get("shard"):
            return None
        with open(store / row["shard"], "rb") as fh:
            out = {}
            for m in row["members"]:
                fh.seek(m["offset"])
                out[m["name"].rpartition(".")[2]] = fh.read(m["size"])
            return out

    return privacy_problems(expected["privacy"], rows, released)
