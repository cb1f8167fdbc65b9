"""Serve the deployments of prefect.yaml without a work pool (`shardsmith serve`)."""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

PROJECT = Path(__file__).resolve().parent.parent
PREFECT_FILE = PROJECT / "deployments" / "prefect.yaml"


class ServeError(RuntimeError):
    """prefect.yaml cannot be served, or a local Prefect server did not start."""


def deployment_specs(prefect_file: Path | str = PREFECT_FILE) -> list[dict[str, Any]]:
    """The ``deployments:`` entries of a prefect.yaml, aliases resolved."""
    data = yaml.safe_load(Path(prefect_file).read_text()) or {}
    specs = data.get("deployments") or []
    if not specs:
        raise ServeError(f"{prefect_file}: no deployments")
    return specs


def load_entrypoint(entrypoint: str):
    """The flow object of ``path/to/module.py:name``, imported as its package module.

    Importing ``flows.pretraining`` rather than executing the file keeps one copy of each
    module, so exception classes such as ``GateFailed`` stay the same class everywhere.
    """
    path, _, name = entrypoint.partition(":")
    if not name or not path.endswith(".py"):
        raise ServeError(f"entrypoint {entrypoint!r}: expected path/to/module.py:flow_name")
    module = importlib.import_module(path[: -len(".py")].replace("/", "."))
    return getattr(module, name)


def build_deployments(prefect_file: Path | str = PREFECT_FILE) -> list[Any]:
    """Runner deployments equal to what ``prefect deploy`` makes of the file, minus the work pool."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig
    from prefect.schedules import Cron

    out = []
    for spec in deployment_specs(prefect_file):
        schedules = []
        for s in spec.get("schedules") or []:
            if "cron" not in s:
                raise ServeError(f"{spec['name']}: only cron schedules are used here, got {sorted(s)}")
            schedules.append(Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True)))
        limit = spec.get("concurrency_limit")
        if isinstance(limit, dict):
            limit = ConcurrencyLimitConfig(**limit)
        flow = load_entrypoint(spec["entrypoint"])
        out.append(
            flow.to_deployment(
                name=spec["name"],
                description=spec.get("description"),
                tags=spec.get("tags"),
                parameters=spec.get("parameters") or {},
                schedules=schedules,
                concurrency_limit=limit,
            )
        )
    return out


def serve(prefect_file: Path | str = PREFECT_FILE, limit: int | None = None) -> None:
    """Register the deployments and run their flow runs in subprocesses until interrupted."""
    from prefect import serve as prefect_serve

    # What the pull step does for a work pool: recipe paths in parameters are relative to the
    # project folder, and the runner starts each flow run in this working directory.
    os.chdir(os.environ.get("SHARDSMITH_HOME") or PROJECT)
    prefect_serve(*build_deployments(prefect_file), limit=limit)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def local_server(
    port: int | None = None,
    host: str = "127.0.0.1",
    ui: bool = True,
    env: dict[str, str] | None = None,
    timeout_s: float = 180,
) -> Iterator[str]:
    """Run ``prefect server start`` (API, UI and its services, automations included) for the block.

    Yields the API URL. The database is SQLite under ``PREFECT_HOME`` unless
    ``PREFECT_API_DATABASE_CONNECTION_URL`` says otherwise.
    """
    port = port or free_port()
    api_url = f"http://{host}:{port}/api"
    server_env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(env or {})}
    # The server must not talk to another server's API, nor to itself as a client.
    server_env.pop("PREFECT_API_URL", None)
    server_env["PREFECT_UI_API_URL"] = server_env.get("PREFECT_UI_API_URL") or api_url
    # Links in alerts and logs point at the UI.
    server_env["PREFECT_UI_URL"] = server_env.get("PREFECT_UI_URL") or api_url[: -len("/api")]
    args = [
        sys.executable,
        "-m",
        "prefect",
        "server",
        "start",
        "--host",
        host,
        "--port",
        str(port),
        "--analytics-off",
        "--ui" if ui else "--no-ui",
    ]
    # A file, not a pipe: nobody reads a pipe while the server runs, and a full one blocks it.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(args, env=server_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(api_url):
            if proc.poll() is not None:
                log.seek(0)
                out = log.read().decode(errors="replace")
                raise ServeError(f"prefect server exited with {proc.returncode}:\n{out[-3000:]}")
            if time.monotonic() > deadline:
                raise ServeError(f"prefect server did not answer at {api_url} within {timeout_s:.0f} s")
            time.sleep(0.5)
        yield api_url
    finally:
        stop_process(proc)
        log.close()


def stop_process(proc: subprocess.Popen, grace_s: float = 5) -> None:
    """Stop a process started in its own session, and its children, gently first."""
    import signal

    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            # SIGTERM to the whole group: uvicorn and the runner shut down cleanly on it.
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    """``python -m deployments.serve [prefect.yaml]``: serve against ``PREFECT_API_URL``."""
    args = argv if argv is not None else sys.argv[1:]
    serve(args[0] if args else PREFECT_FILE)


if __name__ == "__main__":
    main()
