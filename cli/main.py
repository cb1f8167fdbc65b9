"""The `shardsmith` application: its commands, and the exit status of a run a signal stopped."""

from __future__ import annotations

import sys

import typer

from cli.ops import alerts, serve
from cli.releases import diff, releases, report
from cli.running import demo, run

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Build release-gated multimodal training datasets.")
for command in (run, demo, report, releases, diff, serve, alerts):
    app.command()(command)


def main() -> None:
    def stopped_by() -> int | None:
        # Only a run that got as far as flows.session has our signal handlers.
        session = sys.modules.get("flows.session")
        return getattr(session, "stopped_by", None)

    try:
        app()
    except SystemExit:
        # typer turns KeyboardInterrupt (our Interrupted included) into exit status 130.
        signum = stopped_by()
        if signum is not None:
            sys.exit(128 + signum)
        raise
    except KeyboardInterrupt:
        sys.exit(128 + (stopped_by() or 2))
