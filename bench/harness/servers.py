"""What the tools run against: a child's environment, a free port, the loopback image server, a Prefect server."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .procs import REPO, Children, Session

VENV_PY = REPO / ".venv" / "bin" / "python"
PREFECT = REPO / ".venv" / "bin" / "prefect"
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child: no proxy (all is loopback; img2dataset's urllib would use one), Prefect's
    analytics off, each shardsmith command in its own process (``SHARDSMITH_WARM=0``), and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    env |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "SHARDSMITH_WARM": "0", **extra}
    return env


def prefect_env(home: Path, api: str | None = None, **extra: str) -> dict[str, str]:
    """A shardsmith command's environment: its ``PREFECT_HOME``, this checkout first on the path, and
    ``PREFECT_API_URL`` only for a server started beforehand (without it, the command starts its own)."""
    env = child_env(PREFECT_HOME=str(home), PYTHONPATH=str(REPO), **extra)
    env.pop("PREFECT_API_URL", None)
    if api:
        env["PREFECT_API_URL"] = api
    return env


def start_image_server(children: Children, root: Path) -> tuple[subprocess.Popen, str]:
    """``python -m tasks.demo.webserver`` serving ``root`` on a free loopback port: (process, base URL)."""
    cmd = [str(VENV_PY), "-m", "tasks.demo.webserver", "--root", str(root), "--port", "0"]
    proc = children.start(cmd, cwd=REPO, env=child_env(PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip() if proc.stdout else ""
    if not line.startswith("serving "):
        raise SystemExit(f"image server did not start (said {line!r})")
    return proc, line.split(" ", 1)[1]


def start_prefect_server(children: Children, home: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``prefect server start`` (no UI) on a free loopback port, once healthy: (process, API URL)."""
    port = free_port()
    env = child_env(PREFECT_HOME=str(home), PREFECT_SERVER_UI_ENABLED="false")
    with open(log, "wb") as fh:
        cmd = [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        proc = children.start(cmd, cwd=home, env=env, stdout=fh, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"prefect server exited with {proc.returncode}; see {log}")
        with contextlib.suppress(OSError), opener.open(api + "/health", timeout=2) as resp:
            if resp.status == 200:
                return proc, api
        time.sleep(0.5)
    raise SystemExit(f"prefect server did not answer {api}/health within 180 s; see {log}")


@dataclass
class Loopback:
    """The servers of a web benchmark: the image server's URL, a Prefect API (None: none), pids to ``watch``."""

    base_url: str
    api: str | None
    watch: dict[str, int]


def serve(session: Session, pool: Path, prefect: bool) -> Loopback:
    """Serve ``pool`` on loopback and, when ``prefect``, start a Prefect server (untimed); the session's
    ``prefect-home`` is every shardsmith command's."""
    server, base_url = start_image_server(session.children, pool)
    loop, home = Loopback(base_url, None, {"server": server.pid}), session.work / "prefect-home"
    home.mkdir(exist_ok=True)
    if prefect:
        print("starting a Prefect server (not timed) ...", flush=True)
        proc, loop.api = start_prefect_server(session.children, home, session.work / "prefect-server.log")
        loop.watch["prefect"] = proc.pid
    return loop


def wait_warm(folder: Path, timeout: float = 180.0) -> int:
    """Wait until the warm service of ``SHARDSMITH_WARM_DIR=folder`` takes commands with its cluster up
    (its socket, its scheduler's address), as a user's second command finds it; its pid."""
    deadline = time.monotonic() + timeout
    while not (any(folder.glob("*.sock")) and any(folder.glob("*.scheduler"))):
        if time.monotonic() > deadline:
            raise SystemExit(f"the warm service did not start; see {folder}")
        time.sleep(0.2)
    return json.loads(next(folder.glob("*.json")).read_text())["pid"]


def stop_warm(env: dict[str, str], pid: int | None = None) -> None:
    """``shardsmith warm --stop`` in ``env``, then wait (up to 60 s) for ``pid`` to be gone."""
    import psutil

    subprocess.run([str(VENV_PY), "-m", "cli", "warm", "--stop"], env=env, cwd=REPO, capture_output=True)
    with contextlib.suppress(psutil.Error):
        if pid:
            psutil.Process(pid).wait(60)
