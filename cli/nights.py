"""`shardsmith demo --nights`: four nightly runs of one manifest over a loopback web that fails, heals, changes and opts out."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.running import RECIPES, live_progress, run_recipe
from cli.summary import print_summary

if TYPE_CHECKING:
    from tasks.demo.nights import Story

RECIPE = RECIPES / "demo-nights.yaml"


def run_nights_demo(directory: Path, workers: int | None) -> None:
    """The nights story (tasks/demo/nights.py) in ``directory/nights``: each night's changes to
    the web, its run, what the web was asked, and the diff of its release against the night
    before; then whether every release says of every row what the story expects."""
    import pyarrow.parquet as pq

    from flows.params import explicit_overrides
    from flows.preflight import PHASES
    from tasks.demo.nights import NIGHTS, prepare_story, set_night, takedown_entries
    from tasks.formats.clock import NOW_ENV
    from tasks.formats.takedown import add

    root = directory / "nights"
    # The story starts from an empty store and an empty takedown list every time it is shown.
    shutil.rmtree(root / "store", ignore_errors=True)
    (root / "takedown" / "requests.txt").unlink(missing_ok=True)
    typer.echo(f"nights demo: {root}")
    story = prepare_story(root)
    saved = {k: os.environ.get(k) for k in ("SHARDSMITH_DEMO_DIR", NOW_ENV)}
    problems: list[str] = []
    released: list[str] = []
    try:
        os.environ["SHARDSMITH_DEMO_DIR"] = str(root)
        typer.echo(f"{len(story.rows)} rows over {len(story.web.origins)} origins: {story.manifest}")
        for night, when in enumerate(NIGHTS, start=1):
            typer.secho(f"\nnight {night}, {when}", bold=True)
            for line in set_night(story, night):
                typer.echo(f"  {line}")
            os.environ[NOW_ENV] = when
            if night == 3:
                entries = add(
                    str(story.takedown_list), takedown_entries(story), "shardsmith demo", "requests of the day before"
                )
                typer.echo(f"  shardsmith takedown add {story.takedown_list.name} " + " ".join(e.text for e in entries))
            story.web.reset_stats()
            with live_progress(True):
                result = run_recipe(RECIPE, list(PHASES), explicit_overrides({}, workers=workers), force=False)
            print_summary(result)
            typer.echo(f"the web was asked {story.web.requests()} requests and sent {story.web.bodies():,} body bytes")
            release = result.get("release")
            if release is None or not release.created:
                continue
            if released:
                typer.secho(f"\nshardsmith diff {RECIPE.name} {released[-1]} {release.version}", bold=True)
                from cli.releases import diff

                diff(str(RECIPE), released[-1], release.version)
            released.append(release.version)
            problems += _fate_problems(story, night, pq.read_table(Path(release.path) / "ledger.parquet").to_pylist())
    finally:
        story.web.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if len(released) != 3:
        problems.append(f"nights 1-3 should each release and night 4 not; released {released}")
    verdict = "matches" if not problems else "DIFFERS from"
    typer.echo(f"\nEvery release's ledger {verdict} what the story expects (tasks/demo/nights.py).")
    for p in problems:
        typer.echo(f"  {p}")
    if problems:
        raise typer.Exit(1)


def _fate_problems(story: Story, night: int, rows: list[dict[str, Any]]) -> list[str]:
    """Where a release's ledger differs from what night ``night`` should give each row."""
    from tasks.demo.nights import Fate, expected

    want = expected(story, night)
    got = {r["key"]: Fate(r["status"], r["reason"], r["phase"], r.get("upkeep")) for r in rows}
    return [
        f"night {night}: {key}: {got.get(key)} instead of {want.get(key)}"
        for key in sorted(set(want) | set(got))
        if got.get(key) != want.get(key)
    ]
