"""A CLI run's session: its Prefect server started before Prefect is imported, its workers' end."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _own_server_env(tmp_path: Path) -> dict[str, str]:
    """This environment without an API URL (so a run starts its own server), its own Prefect home."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    return env


# A fresh interpreter, as the CLI is when it has planned a run: the server starts while this
# process has not imported Prefect, answers, and is stopped.
EARLY = """
import sys
from flows.runtime import early_server, startup_timeout
server = early_server()
print("prefect imported before the start:", "prefect" in sys.modules)
try:
    print("answered:", server.wait(startup_timeout()) == server.api_url)
finally:
    server.stop()
print("stopped:", server.process.poll() is not None)
"""


@pytest.mark.slow
def test_the_local_server_starts_before_prefect_is_imported(tmp_path):
    env = _own_server_env(tmp_path)
    out = subprocess.run([sys.executable, "-c", EARLY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "prefect imported before the start: False",
        "answered: True",
        "stopped: True",
    ]


def test_no_early_server_when_the_environment_names_an_api(monkeypatch):
    from flows.runtime import early_server

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert early_server() is None


def test_a_session_stops_an_early_server_when_the_settings_name_an_api(prefect_harness):
    """An API URL set in a Prefect profile is seen only once Prefect is imported: the server the
    CLI started early is stopped, and the run uses the configured API."""
    from prefect.settings import get_current_settings

    from flows.runtime import LocalServer
    from flows.session import Session

    early = LocalServer().start()
    try:
        session = Session("tcp://127.0.0.1:1", server=early)
        early.process.wait(timeout=30)
        assert early.process.returncode is not None
        assert session.server is None
        assert session.api_url == str(get_current_settings().api.url)
    finally:
        early.stop()


async def _logs_saying(message: str, since: dt.datetime) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTimestamp

    async with get_client() as client:
        logs = await client.read_logs(log_filter=LogFilter(timestamp=LogFilterTimestamp(after_=since)), limit=200)
    return [log.message for log in logs if log.message == message]


def _log_in_worker(message: str) -> None:
    """In a worker: queue one log for the Prefect API, as a task's logger does."""
    import datetime as dt

    from prefect.logging.handlers import APILogWorker

    APILogWorker.instance().send(
        {
            "name": "shardsmith.test",
            "level": 20,
            "message": message,
            "timestamp": dt.datetime.now(dt.UTC).isoformat(),
            "flow_run_id": None,
            "task_run_id": None,
        }
    )


@pytest.mark.slow
def test_closing_a_session_sends_what_its_workers_logged_then_ends_them(prefect_harness):
    import asyncio

    import psutil
    from distributed import Client

    from flows.session import Session

    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)
    message = f"logged just before the end {uuid.uuid4()}"
    session = Session("local", workers=1)
    with session:
        with Client(session.address()) as client:
            client.run(_log_in_worker, message)
        pids = [nanny.pid for nanny in session._cluster.workers.values()]
        assert pids and all(psutil.pid_exists(pid) for pid in pids)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)
    # Prefect batches a worker's logs (every 2 s); killed without being asked to send them,
    # the worker would take this one with it.
    assert asyncio.run(_logs_saying(message, since)) == [message]


# A run that started its server and was then killed without a chance to stop it.
KILLED = """
from flows.runtime import early_server, startup_timeout
server = early_server()
server.wait(startup_timeout())
print(server.process.pid, flush=True)
import time
time.sleep(600)
"""


def _ended(process) -> bool:
    import psutil

    try:
        return process.status() == psutil.STATUS_ZOMBIE  # ended; reaped by whoever adopted it
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_the_local_server_stops_when_the_run_that_started_it_is_killed(tmp_path):
    import psutil

    run = subprocess.Popen(
        [sys.executable, "-c", KILLED], cwd=ROOT, env=_own_server_env(tmp_path), stdout=subprocess.PIPE, text=True
    )
    server = None
    try:
        server = psutil.Process(int(run.stdout.readline()))  # the server answers
        run.kill()
        run.wait()
        deadline = time.monotonic() + 120  # not a speed check: the test must not hang
        while not _ended(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ended(server)
    finally:
        run.kill()
        if server is not None and not _ended(server):
            server.kill()


def test_a_run_whose_planning_fails_stops_the_server_it_started_first(tmp_path, monkeypatch):
    """The CLI starts its local server before it plans; a manifest it cannot read still ends
    the run with a clear error, and the server, started for nothing, is stopped."""
    import typer

    import flows.runtime
    from cli.running import run_recipe

    started: list = []
    real = flows.runtime.early_server

    def recorded():
        server = real()
        started.append(server)
        return server

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(flows.runtime, "early_server", recorded)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"dataset: x\nstorage: {tmp_path / 's'}\nsources:\n  - name: a\n    manifest: {tmp_path / 'missing.csv'}\n"
    )
    with pytest.raises(typer.Exit) as exc:
        run_recipe(recipe, ["download"], {})
    assert exc.value.exit_code == 1
    assert len(started) == 1 and started[0] is not None
    assert started[0].process.poll() is not None  # stopped (and reaped) before the error was raised
