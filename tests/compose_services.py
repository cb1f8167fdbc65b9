"""docker-compose.yml read the way Compose reads it, and its services turned into local processes."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deployments.serve import stop_process

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"

# Compose's interpolation: $$ is a literal $, ${VAR}, ${VAR:-default} (unset or empty),
# ${VAR-default} (unset only).
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: Any, variables: Mapping[str, str]) -> Any:
    """A compose value with its variables substituted, as ``docker compose`` does."""
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3)
        got = variables.get(name)
        if op == ":-" and not got:
            return default
        if op == "-" and got is None:
            return default
        return got or ""

    return _VAR.sub(sub, value)


def variable_defaults() -> dict[str, str]:
    """Every variable docker-compose.yml interpolates, with the default it gives it ("" when none)."""
    out: dict[str, str] = {}
    for m in _VAR.finditer(COMPOSE.read_text()):
        if m.group(1):
            out.setdefault(m.group(1), m.group(3) or "")
    return out


def env_example() -> dict[str, str]:
    """The KEY=VALUE lines of .env.example."""
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


@dataclass
class Localizer:
    """Rewrites a compose service's values for a process on this machine.

    Args:
        hosts: ``host:port`` (or URL prefix) as the compose network names it -> the loopback one.
        mounts: a container path (a volume's mount point, the image's WORKDIR) -> a local folder;
            only values that start with the path are rewritten.
    """

    hosts: dict[str, str]
    mounts: dict[str, str] = field(default_factory=dict)

    def value(self, text: str) -> str:
        for old, new in self.hosts.items():
            text = text.replace(old, new)
        for old, new in self.mounts.items():
            if text == old or text.startswith(old + "/"):
                return new + text[len(old) :]
        return text

    def argv(self, argv: list[str], ports: Mapping[int, int]) -> list[str]:
        """Listen options on loopback and on this machine's ports; other values as ``value`` says."""
        out = []
        for i, arg in enumerate(argv):
            flag = argv[i - 1] if i else ""
            if flag == "--host" and arg == "0.0.0.0":
                arg = "127.0.0.1"
            elif flag == "--port" and int(arg) in ports:
                arg = str(ports[int(arg)])
            elif flag == "--dashboard-address" and arg.startswith(":") and int(arg[1:]) in ports:
                arg = f"127.0.0.1:{ports[int(arg[1:])]}"
            out.append(self.value(arg))
        return out

    def env(self, env: Mapping[str, Any]) -> dict[str, str]:
        return {k: self.value(str(v)) for k, v in (env or {}).items()}


def healthcheck_argv(service: dict[str, Any], ports: Mapping[int, int]) -> list[str]:
    """The service's ``CMD`` healthcheck with its loopback ports mapped; ``python`` is this interpreter."""
    test = list(service["healthcheck"]["test"])
    if test[0] != "CMD":
        raise ValueError(f"only CMD healthchecks run here, got {test[0]}")
    argv = test[1:]
    for cport, lport in ports.items():
        argv = [a.replace(f"127.0.0.1:{cport}/", f"127.0.0.1:{lport}/") for a in argv]
    return [sys.executable if a == "python" else a for a in argv]


def healthcheck_deadline_s(service: dict[str, Any]) -> float:
    """How long Compose waits before it calls the service unhealthy: start period plus retries."""

    def seconds(text: str | None, default: float) -> float:
        if text is None:
            return default
        m = re.fullmatch(r"(\d+)s", str(text))
        if not m:
            raise ValueError(f"durations here are in seconds, got {text!r}")
        return float(m.group(1))

    hc = service["healthcheck"]
    return seconds(hc.get("start_period"), 0) + seconds(hc.get("interval"), 30) * int(hc.get("retries", 3))


@dataclass
class Process:
    """A service started as a process.

    Args:
        name: the service (with a replica number when scaled).
        proc: the process, leader of its own session.
        log: its stdout and stderr.
        check: its compose healthcheck as a local command.
        deadline_s: how long Compose would wait for it to be healthy.
    """

    name: str
    proc: subprocess.Popen
    log: Path
    check: list[str] = field(default_factory=list)
    deadline_s: float = 0.0

    def tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return f"--- {self.name} ({self.log})\n" + self.log.read_text(errors="replace")[-chars:]
        return f"--- {self.name}: no log"


def stop(p: Process, grace_s: float = 10) -> None:
    """Stop a service and everything it started, also what left its process group.

    The Prefect worker starts each flow run in a session of its own, so a signal to the
    worker's group does not reach it; its descendants are collected first and, when the group
    is gone, whatever of them is still alive is killed by pid.
    """
    import psutil

    try:
        descendants = psutil.Process(p.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    stop_process(p.proc, grace_s=grace_s)
    _, alive = psutil.wait_procs(descendants, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def wait_healthy(p: Process) -> None:
    """Run the service's healthcheck until it passes; fail as soon as the process exits."""
    deadline = time.monotonic() + p.deadline_s
    while True:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode} before it was healthy\n{p.tail()}")
        if subprocess.run(p.check, capture_output=True, timeout=30).returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{p.name} not healthy within {p.deadline_s:.0f} s (its compose healthcheck)\n{p.tail()}"
            )
        time.sleep(1)


def service_folder(root: Path, name: str) -> dict[str, str]:
    """A container's own filesystem, in miniature: its home, temp and working folder."""
    home = root / "services" / name
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return {"HOME": str(home), "TMPDIR": str(home / "tmp"), "PREFECT_HOME": str(home / ".prefect")}


def base_env(folder: Mapping[str, str]) -> dict[str, str]:
    """What the image gives every process: our interpreter's scripts first on PATH, this checkout's code."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "LANG": "C.UTF-8",
        **folder,
    }
