"""The `shardsmith` command line: the top layer, above the flows, the deployments and the demo."""

from __future__ import annotations

import os

# Before Prefect is imported: no network here for analytics, and a cold ephemeral server can
# take longer than Prefect's default to start on a small machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")  # Prefect's client-side telemetry, which the above leaves on
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def fail(message: str, code: int):
    """Say ``message`` in red on stderr (control characters shown as ``?``); returns the ``typer.Exit`` to raise with ``code``."""
    import typer

    from tasks.audit.report_views import terminal_text  # an error can quote third parties' text

    typer.secho(terminal_text(message), fg="red", err=True)
    return typer.Exit(code)
