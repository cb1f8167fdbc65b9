"""The `shardsmith` command line."""

from __future__ import annotations

import os

# Before Prefect is imported: no network here for analytics, and a cold ephemeral server can
# take longer than Prefect's default to start on a small machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

import json  # noqa: E402
import sys  # noqa: E402
from enum import Enum  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Annotated  # noqa: E402

import typer  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Build release-gated multimodal training datasets.")

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


class PhaseName(str, Enum):
    download = "download"
    validate = "validate"
    reshard = "reshard"
    precache = "precache"
    release = "release"


def _parse_sets(values: list[str]) -> dict[str, object]:
    import yaml

    out: dict[str, object] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(raw)
    return out


def _fail(message: str, code: int) -> typer.Exit:
    typer.secho(message, fg="red", err=True)
    return typer.Exit(code)


def _run(recipe_path: Path, phases: list[str], overrides: dict[str, object], force: bool = True) -> dict:
    # Prefect, Dask and the flows are imported only once there is something to run.
    from flows.preflight import up_to_date, work_ahead
    from tasks.formats.manifests import ManifestError
    from tasks.formats.recipe import load_recipe
    from tasks.formats.recipe_base import RecipeError

    try:
        recipe = load_recipe(recipe_path, overrides)
        if recipe.execution.cluster == "cuda":
            from flows.runtime import require_gpu

            require_gpu()
    except RecipeError as err:
        raise _fail(str(err), 2) from None
    except RuntimeError as err:  # flows.runtime.NoGPU
        raise _fail(str(err), 2) from None

    try:
        # Nothing changed since the last run covered these phases: say so, start nothing.
        pending = work_ahead(recipe, phases)
        last = None if force else up_to_date(recipe, phases, pending)
    except ManifestError as err:
        raise _fail(f"{type(err).__name__}: {err}", 1) from None
    if last is not None:
        return {"up_to_date": last, "storage": recipe.storage, "dataset": recipe.dataset}
    from flows.audit import GateFailed
    from flows.download import PhaseFailed
    from flows.runtime import NoGPU, Session, stop_on_signals
    from tasks.formats.locks import LockHeld, LockLost
    from tasks.stages.precache_models import PrecacheError

    ex = recipe.execution
    # The Prefect server and, when there is work, the Dask cluster start side by side, while
    # this process imports the flows; otherwise the flows start the cluster at their first task.
    with Session(ex.cluster, ex.workers, ex.threads_per_worker) as session, stop_on_signals(session):
        if pending != 0:
            # Work is coming: the cluster (no more workers than chunks to fetch) starts now,
            # beside the Prefect server, before this process imports the flows. Great
            # Expectations is imported once shard work runs (flows.runtime.gather_all), not
            # here, where every core is busy starting.
            session.start_cluster(workers=pending)
        from prefect import flow

        from flows.pretraining import run_phases

        @flow(name=f"shardsmith-{recipe.dataset}")
        def cli_run() -> dict:
            if recipe.kind == "finetuning":
                from flows.finetuning import run_finetuning

                return run_finetuning(recipe, session)  # its phases always run together
            return run_phases(recipe, phases, session)

        with session.api():
            try:
                return cli_run()
            except RecipeError as err:
                raise _fail(f"{recipe_path}: {err}", 2) from None
            except (ManifestError, PhaseFailed, NoGPU, GateFailed, LockHeld, LockLost, PrecacheError) as err:
                raise _fail(f"{type(err).__name__}: {err}", 1) from None


def _json_value(value: object) -> object:
    """What ``--json`` prints for values JSON has no type for: an Arrow table (reshard's rows not
    carried, an output's layout) as its size (its rows are in the phase's ledgers), bytes as hex,
    anything else as its string."""
    import pyarrow as pa

    if isinstance(value, (pa.Table, pa.RecordBatch)):
        return {"rows": value.num_rows, "columns": value.schema.names}
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _print_summary(result: dict) -> None:
    last = result.get("up_to_date")
    if last is not None:
        release = f"; release {last['release']} is still the latest" if last.get("release") else ""
        typer.secho(
            f"{result['dataset']}: up to date, nothing to do (run {last['run']} covered {', '.join(last['phases'])} over the same inputs{release})",
            bold=True,
            fg="green",
        )
        typer.echo(
            f"  report: {result['storage']}/{result['dataset']}/reports/{last['run']}/report.html   (--force runs every phase again)"
        )
        return
    dl = result.get("download")
    if dl is None:
        return
    c = dl.counts
    typer.echo("")
    typer.secho(f"download: {c.rows} rows -> {c.ok} ok, {c.rejected} rejected, {c.error} error", bold=True)
    for reason, n in c.by_reason.items():
        typer.echo(f"  {reason:<24} {n}")
    typer.echo(
        f"  shards: {dl.shards} ({dl.shards_skipped} already done), {dl.samples_per_s} samples/s, {dl.mb_per_s} MB/s"
    )
    typer.echo(f"  shards and ledgers: {dl.storage}/{dl.dataset}/download/")
    val = result.get("validate")
    if val is not None:
        c = val.counts
        typer.secho(
            f"validate: {c.rows} samples -> {c.ok} ok, {c.rejected} rejected ({val.duplicates} duplicates)", bold=True
        )
        for reason, n in _grouped(c.by_reason).items():
            typer.echo(f"  {reason:<24} {n}")
        typer.echo(f"  shards and ledgers: {dl.storage}/{dl.dataset}/validate/")
    ft = result.get("finetune")
    if ft is not None:
        c, st = ft.counts, ft.stats
        typer.secho(f"finetune: {c.rows} records -> {c.ok} ok, {c.rejected} rejected, {c.error} error", bold=True)
        for reason, n in _grouped(c.by_reason).items():
            typer.echo(f"  {reason:<24} {n}")
        fill = (
            f", fill {st['fill_ratio']:.3f} (padding to the longest: {st['pad_to_longest_ratio']:.3f})"
            if st.get("fill_ratio") is not None
            else ""
        )
        typer.echo(f"  {st['samples']} samples in {st['packs']} packs, cut-off {st['cutoff']} tokens{fill}")
    rs = result.get("reshard")
    if rs is not None:
        typer.secho(
            f"reshard: {rs.samples} samples -> {len(rs.outputs)} shards of {rs.samples_per_shard} (last holds {rs.tail})",
            bold=True,
        )
        if rs.incomplete:
            typer.echo(f"  {'incomplete_sample':<24} {rs.incomplete}")
    pc = result.get("precache")
    if pc is not None:
        skipped = sum(1 for r in pc.results if getattr(r, "skipped", False))
        typer.secho(
            f"precache: {pc.samples} samples encoded in {len(pc.results)} latent shards ({skipped} already done)",
            bold=True,
        )
        for name, enc in pc.encodings.items():
            shape = "x".join(str(d) for d in enc.get("shape", ()))
            typer.echo(f"  {name:<24} {shape} {enc.get('dtype', '')}")
    elif "precache" in result:
        typer.echo("precache: no encoders configured")
    rel = result.get("release")
    if rel is not None:
        state = "released" if rel.created else "unchanged, still"
        typer.secho(f"release: {state} {rel.version}: {rel.path}", bold=True, fg="green")
    record = result.get("record") or {}
    report_dir = f"{dl.storage}/{dl.dataset}/reports/{record.get('run', dl.run)}"
    typer.echo(f"  report:             {report_dir}/report.html")


def _logs(verbose: bool) -> None:
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


def _progress(enabled: bool):
    """The live per-phase progress display on stderr (off for --json, which prints only JSON)."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    from flows.progress import Terminal

    return Terminal()


def _grouped(by_reason: dict[str, int]) -> dict[str, int]:
    from tasks.formats.reasons import family

    out: dict[str, int] = {}
    for reason, n in by_reason.items():
        out[family(reason)] = out.get(family(reason), 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@app.command()
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
    _logs(verbose)
    overrides = _parse_sets(set_ or [])
    if cluster:
        overrides["execution.cluster"] = cluster
    if storage:
        overrides["storage"] = storage
    if workers:
        overrides["execution.workers"] = workers
    from flows.preflight import PHASES

    phases = [p.value for p in phase] if phase else list(PHASES)
    with _progress(not json_out):
        result = _run(recipe, phases, overrides, force=force)
    if json_out:
        from dataclasses import asdict

        typer.echo(
            json.dumps(
                {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in result.items()},
                indent=2,
                default=_json_value,
            )
        )
    else:
        _print_summary(result)


@app.command()
def demo(
    directory: Annotated[Path, typer.Option("--dir", help="Where the demo corpus and its outputs go.")] = Path(
        "shardsmith-demo"
    ),
    images: Annotated[int, typer.Option(help="Images in the generated corpus.")] = 300,
    workers: Annotated[int | None, typer.Option(help="Worker processes of the local cluster.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect's and Dask's INFO logs.")] = False,
) -> None:
    """Generate a demo corpus, serve it on loopback, and run the demo recipe on it."""
    _logs(verbose)
    from tasks.demo.corpus import prepare_demo

    directory = directory.resolve()
    typer.echo(f"demo corpus: {directory}")
    server, expected = prepare_demo(directory, n=images)
    try:
        typer.echo(f"serving it at {server.base_url}")
        os.environ["SHARDSMITH_DEMO_DIR"] = str(directory)
        overrides: dict[str, object] = {}
        if workers:
            overrides["execution.workers"] = workers
        from flows.preflight import PHASES

        with _progress(True):
            result = _run(RECIPES / "demo.yaml", list(PHASES), overrides)
    finally:
        server.stop()
    _print_summary(result)
    got = result["download"].counts
    same = (got.rows, got.ok, got.by_reason) == (expected["rows"], expected["ok"], expected["by_reason"])
    verdict = "matches" if same else "DIFFERS from"
    typer.echo(
        f"\nThe outcome {verdict} what the corpus generator expected ({expected['rows']} rows, {expected['ok']} ok): {directory / 'manifests' / 'EXPECTED.json'}"
    )
    if not same:
        raise typer.Exit(1)


@app.command()
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
        raise _fail("give a run (a report folder, or DATASET/RUN with --storage), or --serve", 2)
    root, rel = _locate_run(target, storage)
    try:
        run, _ = load_run(Storage(root), rel)
    except FileNotFoundError:
        raise _fail(f"no run.json under {Storage(root).url(rel)}", 2) from None
    typer.echo(summary_text(run))
    link = report_link(Storage(root), rel + "/report.html")
    typer.echo(f"HTML report: {link.url}" + (f"\n  ({link.note})" if link.note else ""))


def _serve_reports(root: str | None, host: str, port: int) -> None:
    """`shardsmith report --serve`: the storage root's {dataset}/reports/ over HTTP, read-only."""
    from tasks.audit.report_web import REPORT_URL_ENV, ReportServer
    from tasks.formats.storage import Storage

    if not root:
        raise _fail("give the storage root to serve: shardsmith report --serve --storage ROOT", 2)
    try:
        server = ReportServer(Storage(root), host=host, port=port)
    except OSError as err:
        raise _fail(f"cannot listen on {host}:{port}: {err}", 1) from None
    typer.secho(
        f"serving the reports under {Storage(root).url()} at {server.url}/ (read-only; Ctrl-C stops)", bold=True
    )
    typer.echo(f"for links in the Prefect UI, run flows with {REPORT_URL_ENV}={server.url}")
    sys.stdout.flush()
    try:
        server.serve_forever()
    finally:
        server.stop()


def _storage_for(dataset_or_recipe: str, storage: str | None) -> tuple[str, object]:
    """(dataset, Storage) from a recipe file or a dataset name plus --storage."""
    from tasks.formats.recipe import load_recipe
    from tasks.formats.recipe_base import RecipeError
    from tasks.formats.storage import Storage

    if dataset_or_recipe.endswith((".yaml", ".yml")):
        try:
            recipe = load_recipe(dataset_or_recipe)
        except RecipeError as err:
            raise _fail(str(err), 2) from None
        return recipe.dataset, Storage(storage or recipe.storage, recipe.storage_options)
    if storage is None:
        raise _fail("give --storage ROOT with a dataset name (or pass the recipe file instead)", 2)
    return dataset_or_recipe, Storage(storage)


@app.command()
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


@app.command()
def diff(
    dataset: Annotated[str, typer.Argument(help="A dataset name (with --storage) or a recipe file.")],
    a: Annotated[str, typer.Argument(help="Older version, e.g. v0001.")],
    b: Annotated[str, typer.Argument(help="Newer version, or latest.")] = "latest",
    storage: Annotated[str | None, typer.Option(help="Storage root.")] = None,
) -> None:
    """What was added and removed between two releases, and why (from the ledgers)."""
    from tasks.stages.release import ReleaseError
    from tasks.stages.release import diff as release_diff

    name, st = _storage_for(dataset, storage)
    try:
        d = release_diff(st, name, a, b)
    except ReleaseError as err:
        raise _fail(str(err), 2) from None
    typer.echo(f"{name} {d['a']} -> {d['b']}: +{d['added']} added, -{d['removed']} removed, {d['kept']} kept")
    for label, n in d["removed_by_reason"].items():
        typer.echo(f"  removed  {label:<40} {n}")
    for k in d["added_keys"]:
        typer.echo(f"  added    {k}")


@app.command()
def serve(
    prefect_file: Annotated[
        Path | None,
        typer.Option(
            "--prefect-file",
            help="Deployments to serve (default: deployments/prefect.yaml).",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    port: Annotated[
        int, typer.Option(help="Port of the local Prefect server started when PREFECT_API_URL is not set.")
    ] = 4200,
    limit: Annotated[int | None, typer.Option(help="Most flow runs at once (default: no limit).", min=1)] = None,
) -> None:
    """Serve the nightly and by-hand deployments without a work pool (Ctrl-C stops).

    With PREFECT_API_URL set, registers them with that server; otherwise starts a local Prefect
    server with its UI on --port first (SQLite under PREFECT_HOME) and stops it afterwards.
    """
    import contextlib

    from deployments.serve import PREFECT_FILE, ServeError, local_server
    from deployments.serve import serve as serve_deployments

    target = prefect_file.resolve() if prefect_file else PREFECT_FILE
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PREFECT_API_URL"):
            typer.echo(f"starting a local Prefect server on 127.0.0.1:{port} ...")
            try:
                api = stack.enter_context(local_server(port=port))
            except ServeError as err:
                raise _fail(str(err), 1) from None
            # Set before Prefect reads its settings, and inherited by every flow run's process.
            os.environ["PREFECT_API_URL"] = api
            typer.secho(f"Prefect UI: {api[: -len('/api')]}", bold=True)
        serve_deployments(target, limit=limit)


@app.command()
def alerts(
    webhook_url: Annotated[
        str | None, typer.Option(help="Receives a JSON POST per failed run (default: $SHARDSMITH_ALERT_WEBHOOK_URL).")
    ] = None,
    name: Annotated[
        str, typer.Option(help="Name of the automation and of its webhook block; rerunning replaces them.")
    ] = "shardsmith-failures",
    flow_name: Annotated[
        list[str] | None,
        typer.Option(
            "--flow",
            help="Flow name whose failures alert (repeatable; trailing * matches). Default: the end-to-end flows.",
        ),
    ] = None,
    header: Annotated[
        list[str] | None, typer.Option(help="Extra HTTP header for the receiver, NAME=VALUE (repeatable).")
    ] = None,
) -> None:
    """Create (or replace) the automation that posts failed and crashed runs to a webhook."""
    if not os.environ.get("PREFECT_API_URL"):
        raise _fail("automations live in a Prefect server: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)", 2)
    from pydantic import ValidationError

    from flows.alerts import config_from_env, create_alert

    extra: dict[str, object] = {"headers": dict(h.partition("=")[::2] for h in header or [])}
    if flow_name:
        extra["flows"] = tuple(flow_name)
    try:
        cfg = config_from_env(webhook_url, name=name, **extra)
    except (ValueError, ValidationError) as err:
        raise _fail(str(err), 2) from None
    ids = create_alert(cfg)
    typer.echo(
        f"automation {cfg.name} ({ids['automation']}): {', '.join(cfg.states)} runs of {', '.join(cfg.flows)} -> {cfg.webhook_url}"
    )


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
            raise _fail(f"no runs with a report under {st.url(dataset + '/reports')}", 2)
        run = runs[-1]  # names start with a UTC timestamp
    return storage, f"{dataset}/reports/{run}"


def main() -> None:
    def stopped_by() -> int | None:
        # Only a run that got as far as flows.runtime has our signal handlers.
        runtime = sys.modules.get("flows.runtime")
        return getattr(runtime, "stopped_by", None)

    try:
        app()
    except SystemExit:
        # typer turns KeyboardInterrupt (our Interrupted included) into exit status 130.
        if stopped_by() is not None:
            sys.exit(128 + stopped_by())
        raise
    except KeyboardInterrupt:
        sys.exit(128 + (stopped_by() or 2))


if __name__ == "__main__":
    main()
