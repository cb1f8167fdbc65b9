"""The client side of the warm service: ``shardsmith run`` handed to a process that is already warm.

A small run is mostly start-up: Prefect's client and server, Dask's cluster, Great Expectations
and the flows take seconds to import and start, the run itself less. The first ``shardsmith
run`` starts a warm service (``cli/warm_service.py``) that keeps them: a Prefect server, a Dask
cluster and a process with every module imported, which forks a child per command. The
child runs this very CLI on the command's arguments, environment, working directory and
standard streams (passed over a Unix socket), so a run through the service behaves and prints
as one without it; this process only forwards signals and ends with the child's status.

One service serves one environment: its socket is named by a digest of the interpreter, the
project's sources and the environment, so a changed variable (credentials, a fault switch, the
Prefect API) or an edited module gets a service of its own, and the old one stops when idle.
Only the standard library is imported here: this runs before anything else in every command.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

# On by default; SHARDSMITH_WARM=0 runs every command in its own process, as before.
ENABLED_ENV = "SHARDSMITH_WARM"
IDLE_ENV = "SHARDSMITH_WARM_IDLE_S"
DIR_ENV = "SHARDSMITH_WARM_DIR"
DEFAULT_IDLE_S = 1200.0
# How long a command waits for a new service to take commands (it imports for seconds).
START_TIMEOUT_S = 120.0

# Shell and terminal variables that differ between two terminals of one user without changing
# what a run does; every other variable is part of the service's identity.
VOLATILE = {"PWD", "OLDPWD", "SHLVL", "_", "COLUMNS", "LINES", "PS1", "PS2", "PROMPT_COMMAND", "HISTFILE"}
VOLATILE_PREFIXES = ("TERM", "SSH_", "TMUX", "STY", "WINDOWID", "DISPLAY", "XDG_SESSION", "LS_COLORS", "COLORTERM")
SOURCES = ("cli", "flows", "tasks", "loaders")
ROOT = Path(__file__).resolve().parent.parent

# Set in a child the service forked: the command runs here, never forwarded again.
in_service = False


def eligible(argv: list[str], env: Mapping[str, str] | None = None) -> bool:
    """Whether this command goes through the warm service: ``run`` without ``--verbose`` or
    ``--help`` (the service's processes were started with the quiet logs), unless turned off."""
    env = os.environ if env is None else env
    if in_service or env.get(ENABLED_ENV, "1").lower() in ("0", "false", "no", "off"):
        return False
    if len(argv) < 2 or argv[1] != "run":
        return False
    return not any(a in ("--verbose", "-v", "--help") for a in argv[2:])


def service_env(env: dict[str, str]) -> dict[str, str]:
    """The part of an environment that names a service (and that its processes run with)."""
    return {
        k: v for k, v in env.items() if k not in VOLATILE and not k.startswith(VOLATILE_PREFIXES) and k != ENABLED_ENV
    }


def identity(env: dict[str, str]) -> str:
    """A digest of what a warm service's processes hold: the interpreter, every project
    source file (name, size, mtime) and the environment they were started with."""
    h = hashlib.sha256()
    h.update(sys.executable.encode())
    for top in SOURCES:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith(".py"):
                    st = os.stat(os.path.join(dirpath, name))
                    h.update(f"{dirpath}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    h.update(json.dumps(sorted(service_env(env).items())).encode())
    return h.hexdigest()[:16]


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the services' sockets, locks and logs live: a folder only this user can enter."""
    env = os.environ if env is None else env
    base = env.get(DIR_ENV) or os.path.join(env.get("XDG_RUNTIME_DIR") or "/tmp", f"shardsmith-{os.getuid()}")
    path = Path(base)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must belong to this user and be closed to others (chmod 700)")
    return path


def paths(env: dict[str, str]) -> tuple[Path, Path, Path]:
    """The socket, start lock and log of the service for this environment."""
    folder = runtime_dir(env)
    name = identity(env)
    return folder / f"{name}.sock", folder / f"{name}.lock", folder / f"{name}.log"


# --- the protocol: a length-prefixed JSON request with the three standard streams attached ---


def send_request(sock: socket.socket, request: dict) -> None:
    body = json.dumps(request).encode()
    socket.send_fds(sock, [struct.pack("!I", len(body)) + body], [0, 1, 2])


def connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def _alive(pid_path: Path) -> bool:
    """Whether the pid file names a live warm service (not a process that took over its pid)."""
    try:
        pid = int(pid_path.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    try:
        return b"cli.warm_service" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (macOS): the pid alone


def connect_or_wait(sock_path: Path) -> socket.socket | None:
    """Connect to the service; wait for one that is starting (its pid file names a live
    process) until it takes commands; None when there is none."""
    pid_path = sock_path.with_suffix(".pid")
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        sock = connect(sock_path)
        if sock is not None or not _alive(pid_path) or time.monotonic() > deadline:
            return sock
        time.sleep(0.02)


def start_service(env: dict[str, str]) -> bool:
    """Start the service for ``env`` in the background, unless one runs or starts already (one
    starter at a time); True when this call started it."""
    sock_path, lock_path, log_path = paths(env)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _alive(sock_path.with_suffix(".pid")):
            return False
        with contextlib.suppress(FileNotFoundError):
            sock_path.unlink()  # a service that died without removing it
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cli.warm_service", str(sock_path)],
                env={**service_env(env), IDLE_ENV: env.get(IDLE_ENV, str(DEFAULT_IDLE_S))},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=str(ROOT),
                start_new_session=True,  # not in the terminal's process group: Ctrl-C reaches us only
            )
        # Written by the starter too, so that a command arriving now waits for this service.
        sock_path.with_suffix(".pid").write_text(str(proc.pid))
    return True


# Set by forward() when no service answered: the command runs here, then starts one on its way
# out, for the environment it started with (a run sets variables of its own as it goes).
start_at_exit: dict[str, str] | None = None


def forward(argv: list[str]) -> int | None:
    """Run this command in the warm service; its exit status, or None to run it here instead.

    The first command of an environment runs in its own process (as fast as without a
    service) and starts the service as it exits (``after_run``), so the next one finds it warm.
    """
    global start_at_exit
    env = dict(os.environ)
    try:
        sock_path, _, _ = paths(env)
        for _ in range(2):  # a service that was just stopping hangs up before it answers
            sock = connect_or_wait(sock_path)
            if sock is None:
                start_at_exit = env
                return None
            code = _converse(sock, argv, env)
            if code is not None:
                return code
    except OSError as err:
        sys.stderr.write(f"warm service unavailable ({err}); running in this process\n")
    return None


def after_run() -> None:
    """On a command's way out: start the service the next command will use, if it needs one."""
    env = start_at_exit
    if env is None:
        return
    try:
        started = start_service(env)
    except OSError as err:
        sys.stderr.write(f"could not start a warm service ({err})\n")
        return
    if started:
        idle = float(env.get(IDLE_ENV, DEFAULT_IDLE_S))
        sys.stderr.write(
            f"started a warm service for the next runs (stops after {idle / 60:.0f} min idle; "
            "`shardsmith warm` lists it, SHARDSMITH_WARM=0 runs without)\n"
        )


def _converse(sock: socket.socket, argv: list[str], env: dict[str, str]) -> int | None:
    """Send the command, forward signals to the child, and return its status (None: the
    service hung up before it forked one)."""
    umask = os.umask(0)
    os.umask(umask)
    with sock:
        send_request(sock, {"argv": argv, "env": env, "cwd": os.getcwd(), "umask": umask})
        reader = sock.makefile("r")
        first = reader.readline().split()
        if len(first) != 2 or first[0] != "pid":
            return None
        child = int(first[1])

        def relay(signum: int, _frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, relay)
        words = reader.readline().split()  # a relayed signal does not interrupt it (PEP 475)
        if len(words) == 2 and words[0] == "exit":
            return int(words[1])
        sys.stderr.write("the warm service ended without the run's exit status\n")
        return 1


def stop_all(env: Mapping[str, str] | None = None) -> list[int]:
    """Ask every warm service of this user to stop (each finishes the runs it has); their pids.
    A pid file left by a service that died is passed over: its pid may be another process's now."""
    stopped = []
    for pid_file in runtime_dir(env).glob("*.pid"):
        if not _alive(pid_file):
            continue
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text())
            os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
    return stopped


def running(env: Mapping[str, str] | None = None) -> list[dict]:
    """The warm services of this user that live, with what each said of itself."""
    out = []
    for info in sorted(runtime_dir(env).glob("*.json")):
        if not _alive(info.with_suffix(".pid")):
            continue
        with contextlib.suppress(ValueError, OSError):
            out.append(json.loads(info.read_text()))
    return out
