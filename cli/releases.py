"""`shardsmith report`, `releases` and `diff`: a run's audit summary and a dataset's releases."""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from cli import fail

if TYPE_CHECKING:
    from tasks.formats.storage import Storage


def report(
    target: Annotated[
        str | None,
        typer.Argument(help="A run's report folder (path or URL), or DATASET/RUN, or DATASET/latest under --storage."),
    ] = None,
    storage: Annotated[str | None, typer.Option(help="Storage root, for DATASET/RUN targets and for --serve.")] = None,
    serve: Annotated[
        bool, typer.Option("--serve", help="Serve the storage root's reports read-only over HTTP until Ctrl-C.")
    ] = False,
    host: Annotated[
        str, typer.Option(help="Address --serve listens on (loopback: only this machine can read).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port --serve listens on; 0 picks a free one.", min=0, max=65535)] = 4280,
) -> None:
    """Print a run's audit summary (the same numbers as its HTML report), or serve every run's
    reports to a browser (--serve), which is where the Prefect UI's report links lead."""
    from tasks.audit.report import load_run, summary_text
    from tasks.audit.report_web import report_link
    from tasks.formats.storage import Storage

    if serve:
        _serve_reports(storage or target, host, port)
        return
    if target is None:
        raise fail("give a run (a report folder, or DATASET/RUN with --storage), or --serve", 2)
    root, rel = _locate_run(target, storage)
    try:
        run, _ = load_run(Storage(root), rel)
    except FileNotFoundError:
        raise fail(f"no run.json under {Storage(root).url(rel)}", 2) from None
    typer.echo(summary_text(run))
    link = report_link(Storage(root), rel + "/report.html")
    typer.echo(f"HTML report: {link.url}" + (f"\n  ({link.note})" if link.note else ""))


def _serve_reports(root: str | None, host: str, port: int) -> None:
    """`shardsmith report --serve`: the storage root's {dataset}/reports/ over HTTP, read-only."""
    from tasks.audit.report_web import REPORT_URL_ENV, ReportServer
    from tasks.formats.storage import Storage

    if not root:
        raise fail("give the storage root to serve: shardsmith report --serve --storage ROOT", 2)
    try:
        server = ReportServer(Storage(root), host=host, port=port)
    except OSError as err:
        raise fail(f"cannot listen on {host}:{port}: {err}", 1) from None
    typer.secho(
        f"serving the reports under {Storage(root).url()} at {server.url}/ (read-only; Ctrl-C stops)", bold=True
    )
    typer.echo(f"for links in the Prefect UI, run flows with {REPORT_URL_ENV}={server.url}")
    sys.stdout.flush()
    try:
        server.serve_forever()
    finally:
        server.stop()


def _storage_for(dataset_or_recipe: str, storage: str | None) -> tuple[str, Storage]:
    """(dataset, Storage) from a recipe file or a dataset name plus --storage."""
    from tasks.formats.recipe import load_recipe
    from tasks.formats.recipe_base import RecipeError
    from tasks.formats.storage import Storage

    if dataset_or_recipe.endswith((".yaml", ".yml")):
        try:
            recipe = load_recipe(dataset_or_recipe)
        except RecipeError as err:
            raise fail(str(err), 2) from None
        return recipe.dataset, Storage(storage or recipe.storage, recipe.storage_options)
    if storage is None:
        raise fail("give --storage ROOT with a dataset name (or pass the recipe file instead)", 2)
    return dataset_or_recipe, Storage(storage)


def releases(
    dataset: Annotated[str, typer.Argument(help="A dataset name (with --storage) or a recipe file.")],
    storage: Annotated[str | None, typer.Option(help="Storage root.")] = None,
) -> None:
    """List a dataset's releases, newest last."""
    from tasks.stages.release import latest, list_versions, read_index

    name, st = _storage_for(dataset, storage)
    versions = list_versions(st, name)
    if not versions:
        typer.echo(f"no releases of {name} under {st.url(name + '/releases')}")
        return
    head = latest(st, name)
    typer.echo(f"{'version':<8} {'created':<26} {'samples':>9} {'shards':>7} {'tail':>6}  parent")
    for v in versions:
        ix = read_index(st, name, v)
        t = ix["totals"]
        mark = "  <- LATEST" if v == head else ""
        typer.echo(
            f"{v:<8} {ix['created']:<26} {t['samples']:>9} {t['shards']:>7} {t['tail']:>6}  {ix.get('parent') or '-'}{mark}"
        )


def diff(
    dataset: Annotated[str, typer.Argument(help="A dataset name (with --storage) or a recipe file.")],
    a: Annotated[str, typer.Argument(help="Older version, e.g. v0001.")],
    b: Annotated[str, typer.Argument(help="Newer version, or latest.")] = "latest",
    storage: Annotated[str | None, typer.Option(help="Storage root.")] = None,
    examples: Annotated[int, typer.Option(help="Example rows shown per kind of change.", min=0, max=1000)] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="Print the diff as JSON.")] = False,
) -> None:
    """What was added and removed between two releases, and why (from the ledgers); then what
    changed row by row: rows recovered, newly failed, dead, changed, opted out, taken down,
    added and removed, each with its count, share, reasons and examples."""
    import json

    from tasks.audit.changes import between
    from tasks.stages.release import ReleaseError
    from tasks.stages.release import diff as release_diff

    name, st = _storage_for(dataset, storage)
    try:
        d = release_diff(st, name, a, b)
    except ReleaseError as err:
        raise fail(str(err), 2) from None
    rows = between(st, name, d["a"], d["b"])
    d["changes"] = rows.to_json() if rows is not None else None
    if json_out:
        typer.echo(json.dumps(d, indent=2, sort_keys=True))
        return
    # Samples (keys released); the row block below says why rows came and went (a recovered row
    # is a sample added here and a row recovered there).
    typer.echo(f"{name} {d['a']} -> {d['b']}: samples +{d['added']} added, -{d['removed']} removed, {d['kept']} kept")
    for label, n in d["removed_by_reason"].items():
        typer.echo(f"  removed  {label:<40} {n}")
    for k in d["added_keys"]:
        typer.echo(f"  added    {k}")
    if rows is not None:
        _print_changes(rows.to_json(), examples)


def _print_changes(data: dict, examples: int) -> None:
    """The row changes of a diff, one block per kind: count, share, kept, reasons, examples."""
    from tasks.audit.changes import changes_view

    view = changes_view(data)
    if view is None:
        return

    def echo(line: str) -> None:
        # Keys, reasons and details are data: no escape sequences reach the terminal.
        typer.echo(re.sub(r"[\x00-\x1f\x7f-\x9f]", "?", line))

    echo(
        f"rows since {view['since']} (by source and row; shares of the {view['released_before']:,} "
        f"released by {view['since']}):"
    )
    for c in view["rows"]:
        kept = f", {c['kept']:,} kept" if c["kept"] else ""
        reasons = ", ".join(f"{r} {n:,}" for r, n in c["reasons"])
        echo(f"  {c['label']:<16} {c['count']:>9,}  {c['share']:>7}{kept}" + (f"  ({reasons})" if reasons else ""))
        for e in c["examples"][:examples]:
            note = e["reason"] + (" (kept)" if e["kept"] else "") + (f": {e['detail']}" if e["detail"] else "")
            echo(f"      {e['key']}" + (f"  {note}" if note else ""))


def _locate_run(target: str, storage: str | None) -> tuple[str, str]:
    """(storage root, folder relative to it) holding the run's run.json."""
    from tasks.formats.storage import Storage

    if storage is None:
        target = target.rstrip("/")
        parent, _, name = target.rpartition("/")
        return (parent or "."), name
    dataset, _, run = target.partition("/")
    st = Storage(storage)
    if run in ("", "latest"):
        runs = [r for r in st.listdir(f"{dataset}/reports") if st.exists(f"{dataset}/reports/{r}/run.json")]
        if not runs:
            raise fail(f"no runs with a report under {st.url(dataset + '/reports')}", 2)
        run = runs[-1]  # names start with a UTC timestamp
    return storage, f"{dataset}/reports/{run}"
