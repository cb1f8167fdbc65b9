"""What the tools run against: a child's environment, a free port, the loopback image server, a Prefect server."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from harness.procs import REPO, Children, Session

VENV_PY = REPO / ".venv" / "bin" / "python"
PREFECT = REPO / ".venv" / "bin" / "prefect"
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child: no proxy (every tool talks to loopback only; urllib, which
    img2dataset uses, would honour one), Prefect's analytics off, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    # Each shardsmith command in its own process, as the figures before the warm service were
    # taken (and no service outlives the benchmark); bench_small.py measures the warm service.
    env["SHARDSMITH_WARM"] = "0"
    env.update(extra)
    return env


def prefect_env(home: Path, api: str | None = None, **extra: str) -> dict[str, str]:
    """A shardsmith command's environment: its ``PREFECT_HOME``, the checkout this harness is in
    (not whatever the venv's editable install points at), and ``PREFECT_API_URL`` only when a
    server was started beforehand (without it, the command starts its own)."""
    env = child_env(PREFECT_HOME=str(home), PYTHONPATH=str(REPO), **extra)
    env.pop("PREFECT_API_URL", None)
    if api:
        env["PREFECT_API_URL"] = api
    return env


def start_image_server(children: Children, root: Path) -> tuple[subprocess.Popen, str]:
    """``python -m tasks.demo.webserver`` serving ``root`` on a free loopback port: (process, base URL)."""
    proc = children.start(
        [str(VENV_PY), "-m", "tasks.demo.webserver", "--root", str(root), "--port", "0"],
        cwd=REPO,
        env=child_env(PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip() if proc.stdout else ""
    if not line.startswith("serving "):
        raise SystemExit(f"image server did not start (said {line!r})")
    return proc, line.split(" ", 1)[1]


def start_prefect_server(children: Children, home: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``prefect server start`` (no UI) on a free loopback port, once healthy: (process, API URL)."""
    port = free_port()
    env = child_env(PREFECT_HOME=str(home), PREFECT_SERVER_UI_ENABLED="false")
    with open(log, "wb") as fh:
        proc = children.start(
            [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            cwd=home,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    api = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"prefect server exited with {proc.returncode}; see {log}")
        with contextlib.suppress(OSError):
            with opener.open(api + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, api
        time.sleep(0.5)
    raise SystemExit(f"prefect server did not answer {api}/health within 180 s; see {log}")


@dataclass
class Loopback:
    """The servers of a web benchmark: the image server's base URL, a Prefect server's API
    (None: not started), and their pids by name for ``timed``'s ``watch``."""

    base_url: str
    api: str | None
    watch: dict[str, int]


def serve(session: Session, pool: Path, prefect: bool) -> Loopback:
    """Serve ``pool`` on loopback and, when ``prefect``, start a Prefect server (not timed) whose
    home is the session's ``prefect-home``."""
    server, base_url = start_image_server(session.children, pool)
    loop = Loopback(base_url, None, {"server": server.pid})
    if prefect:
        home = session.work / "prefect-home"
        home.mkdir(exist_ok=True)
        print("starting a Prefect server (not timed) ...", flush=True)
        proc, loop.api = start_prefect_server(session.children, home, session.work / "prefect-server.log")
        loop.watch["prefect"] = proc.pid
    return loop
