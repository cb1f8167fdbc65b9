"""`shardsmith serve` and `shardsmith alerts`: the deployments without a work pool, and failure alerts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from cli import fail


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
                raise fail(str(err), 1) from None
            # Set before Prefect reads its settings, and inherited by every flow run's process.
            os.environ["PREFECT_API_URL"] = api
            typer.secho(f"Prefect UI: {api[: -len('/api')]}", bold=True)
        serve_deployments(target, limit=limit)


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
        raise fail("automations live in a Prefect server: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)", 2)
    from pydantic import ValidationError

    from flows.alerts import config_from_env, create_alert

    extra: dict[str, object] = {"headers": dict(h.partition("=")[::2] for h in header or [])}
    if flow_name:
        extra["flows"] = tuple(flow_name)
    try:
        cfg = config_from_env(webhook_url, name=name, **extra)
    except (ValueError, ValidationError) as err:
        raise fail(str(err), 2) from None
    ids = create_alert(cfg)
    typer.echo(
        f"automation {cfg.name} ({ids['automation']}): {', '.join(cfg.states)} runs of {', '.join(cfg.flows)} -> {cfg.webhook_url}"
    )


def warm(
    stop: Annotated[bool, typer.Option("--stop", help="Stop them (each finishes the runs it has first).")] = False,
) -> None:
    """List the warm services that keep a Prefect server and a Dask cluster between runs.

    The first `shardsmith run` starts one for its environment; it stops by itself after
    $SHARDSMITH_WARM_IDLE_S seconds without a command (default 1200). SHARDSMITH_WARM=0 runs
    every command without one.
    """
    import time

    from cli import warm as service

    found = service.running()
    if stop:
        for pid in service.stop_all():
            typer.echo(f"stopping warm service {pid}")
        return
    if not found:
        typer.echo("no warm service runs")
    for info in found:
        age = time.time() - info["started"]
        typer.echo(
            f"{info['pid']}: up {age / 60:.0f} min, {info.get('commands', 0)} commands, Prefect API {info['api']}, "
            f"stops after {info['idle_s']:.0f} s idle ({info['socket']})"
        )
