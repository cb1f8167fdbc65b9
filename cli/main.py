"""The `shardsmith` application: its commands, and the exit status of a run a signal stopped."""

from __future__ import annotations

import os
import sys

import typer

from cli.demo import demo
from cli.ops import alerts, serve, warm
from cli.releases import diff, releases, report
from cli.running import run
from cli.takedown import takedown


def _no_type_for_flags() -> None:
    """``--json``, ``--force``, ``--help`` in ``--help`` without ``<bool>`` after them: a flag
    takes no value (typer 0.2x prints its Python type there as for options that do)."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: typer.Context) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign,assignment]


_no_type_for_flags()
app = typer.Typer(add_completion=False, no_args_is_help=True, help="Build release-gated multimodal training datasets.")
for command in (run, demo, report, releases, diff, serve, alerts, warm):
    app.command()(command)
app.add_typer(takedown, name="takedown")


def main() -> None:
    from cli import warm

    if warm.eligible(sys.argv):
        status = warm.forward(sys.argv)  # the run, in the warm service (cli/warm.py)
        if status is not None:
            exit_now(status)

    def stopped_by() -> int | None:
        # Only a run that got as far as flows.session has our signal handlers.
        session = sys.modules.get("flows.session")
        return getattr(session, "stopped_by", None)

    try:
        app()
        code: object = 0
    except SystemExit as stop:
        # typer turns KeyboardInterrupt (our Interrupted included) into exit status 130.
        signum = stopped_by()
        code = 128 + signum if signum is not None else stop.code
    except KeyboardInterrupt:
        code = 128 + (stopped_by() or 2)
    if stopped_by() is None:
        warm.after_run()
    exit_now(code)


def exit_now(code: object) -> None:
    """Exit with ``code`` as ``sys.exit`` would, without tearing the interpreter down.

    After a run, Python's own shutdown (freeing every module of Prefect, Dask, Great
    Expectations and their objects, one by one) took 1.5-2.5 s of the command's wall time and
    does nothing a user needs: the run's files are committed and closed by then. So the exit
    handlers run (logging's flush, Prefect's and Dask's own), the standard streams are
    flushed, and the process ends. A thread still running that is not a daemon gets the
    ordinary exit, which waits for it.
    """
    import atexit
    import threading

    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)  # what sys.exit("message") prints
        code = 0 if code is None else 1
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say to it
            pass
    os._exit(code)
