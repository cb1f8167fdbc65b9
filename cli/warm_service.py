"""The warm service: a Prefect server, a Dask cluster and the CLI's modules, kept between commands.

``python -m cli.warm_service SOCKET``, started by the first ``shardsmith run`` (``cli/warm.py``).
It starts a local Prefect server and a Dask cluster (``flows/warm_cluster.py``) as processes of
their own, imports what a run imports (Prefect, Dask's client, Great Expectations, the flows),
then listens on ``SOCKET``. For each command it forks a child that takes the command's standard
streams, working directory, umask and environment and runs the CLI in them; the child finds the
server and the cluster through ``SHARDSMITH_WARM_API`` and ``SHARDSMITH_WARM_CLUSTER``
(flows/session.py). Children are separate processes, so concurrent commands share the server and
the cluster and nothing else. The process stays single-threaded, so a fork copies no lock that another
thread holds. It stops after ``SHARDSMITH_WARM_IDLE_S`` seconds without a command, on SIGTERM
(``shardsmith warm stop``), or when its server or cluster dies, each time after its running
commands end; the server and the cluster stop with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from flows.warm_cluster import API_ENV, CLUSTER_ENV

if TYPE_CHECKING:
    from flows.runtime import LocalServer

# What a command imports on its way through a run, imported once here instead.
WARM_MODULES = (
    "cli.main",
    "cli.summary",
    "flows.preflight",
    "flows.session",
    "flows.progress",
    "flows.pretraining",
    "flows.finetuning",
    "flows.curate",
    "flows.semdedup",
    "flows.audit",
    "flows.phase",
    "tasks.formats.recipe",
    "tasks.audit.report",
    "tasks.audit.data_docs",
    "prefect_dask",
    "distributed",
    # What a run imports lazily on its way (found by listing sys.modules after a cold run):
    # Prefect's engines and the encoder of flow parameters (FastAPI's, 0.5 s), the gates'
    # and reports' modules, the planning of sources.
    "prefect.engine",
    "prefect.flow_engine",
    "prefect.task_engine",
    "prefect.concurrency.v1.context",
    "prefect.utilities.visualization",
    "prefect._internal.control_listener",
    "fastapi.encoders",
    "cli.warm",
    "tasks.audit.curate_gate",
    "tasks.audit.gate_cache",
    "tasks.audit.gates",
    "tasks.audit.ge_views",
    "tasks.audit.phase_markdown",
    "tasks.audit.reconcile",
    "tasks.audit.report_markdown",
    "tasks.audit.report_web",
    "tasks.sources.planning",
)
REQUEST_LIMIT = 1 << 20
POLL_S = 0.25


def log(message: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} warm[{os.getpid()}]: {message}\n")
    sys.stderr.flush()


class Service:
    """The warm service's processes and its loop.

    Args:
        socket_path: where commands connect; ``.pid`` and ``.json`` files beside it name the
            service (``shardsmith warm`` lists them).
        idle_s: seconds without a command before it stops.
    """

    def __init__(self, socket_path: Path, idle_s: float):
        self.socket_path = socket_path
        self.idle_s = idle_s
        self.pid_path = socket_path.with_suffix(".pid")
        self.info_path = socket_path.with_suffix(".json")
        self.cluster_file = socket_path.with_suffix(".scheduler")
        self.server: LocalServer | None = None
        self.cluster: subprocess.Popen | None = None
        self.children: dict[int, socket.socket] = {}
        self._hung_up: dict[int, float] = {}  # pid -> when its client hung up
        self.info: dict = {}
        self.stopping = False
        self.child_env: dict[str, str] = {}

    def start_processes(self) -> None:
        """The Prefect server (unless the environment names an API) and the Dask cluster, started
        before the imports so that all three start side by side."""
        from flows.runtime import LocalServer

        if not os.environ.get("PREFECT_API_URL"):
            self.server = LocalServer().start()
            self.child_env[API_ENV] = self.server.api_url
        api = self.child_env.get(API_ENV) or os.environ["PREFECT_API_URL"]
        with contextlib.suppress(FileNotFoundError):
            self.cluster_file.unlink()
        self.cluster = subprocess.Popen(
            [sys.executable, "-m", "flows.warm_cluster", str(self.cluster_file), str(os.getpid())],
            env={**os.environ, "PREFECT_API_URL": api},
            stdin=subprocess.DEVNULL,
        )
        self.child_env[CLUSTER_ENV] = str(self.cluster_file)

    def warm(self) -> None:
        """Import what every command imports; the process must stay single-threaded."""
        import importlib

        started = time.monotonic()
        for name in WARM_MODULES:
            importlib.import_module(name)
        from tasks.audit.ge_runner import import_gx

        import_gx()
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        if threads:
            raise RuntimeError(f"importing started threads ({', '.join(threads)}); a fork would copy their locks")
        log(f"imported in {time.monotonic() - started:.1f} s")

    def listen(self) -> socket.socket:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        old = os.umask(0o177)
        try:
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(str(self.socket_path))
        finally:
            os.umask(old)
        server.listen(64)
        server.setblocking(False)
        self.info = {
            "pid": os.getpid(),
            "socket": str(self.socket_path),
            "api": self.child_env.get(API_ENV) or os.environ.get("PREFECT_API_URL"),
            "server_pid": self.server.process.pid if self.server and self.server.process else None,
            "cluster_pid": self.cluster.pid if self.cluster else None,
            "idle_s": self.idle_s,
            "started": time.time(),
            "commands": 0,
        }
        self._write_info()
        return server

    def _write_info(self) -> None:
        tmp = self.info_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.info))
        os.replace(tmp, self.info_path)

    def serve(self) -> None:
        server = self.listen()
        log(f"taking commands on {self.socket_path}")
        selector = selectors.DefaultSelector()
        selector.register(server, selectors.EVENT_READ, "accept")
        last = time.monotonic()
        while True:
            for key, _ in selector.select(POLL_S):
                if key.data == "accept":
                    self._accept(server, selector)
                else:  # a command's client hung up before its run ended: stop the run
                    pid = key.data
                    selector.unregister(key.fileobj)
                    self._hung_up[pid] = time.monotonic()
                    log(f"the client of pid {pid} hung up; stopping its run")
                    # SIGINT, as Ctrl-C would: the run's own handler takes it first and bounds its
                    # stop (flows.session.stop_on_signals), where SIGTERM waits for Prefect to
                    # record the crash of every flow run it is in.
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGINT)
            self._kill_stuck()
            self._reap(selector)
            if self.children:
                last = time.monotonic()
            gone = self._processes_gone()
            if gone and not self.stopping:
                log(f"{gone} ended; stopping")
                self.stopping = True
            if not self.stopping and time.monotonic() - last > self.idle_s:
                log(f"idle for {self.idle_s:.0f} s; stopping")
                self.stopping = True
            if self.stopping:
                self._unpublish(server, selector)
                if not self.children:
                    return

    def _accept(self, server: socket.socket, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except BlockingIOError:
                return
            if self.stopping:
                conn.close()  # the client starts a new service
                continue
            try:
                request, fds = read_request(conn)
            except (OSError, ValueError) as err:
                log(f"a bad request: {err}")
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                # The child keeps only its own streams: no other command waits on what it holds.
                for held in (server, conn, *self.children.values()):
                    held.close()
                selector.close()
                run_child(request, fds, self.child_env)  # never returns
            for fd in fds:
                os.close(fd)
            self.info["commands"] += 1
            self._write_info()
            log(f"command {self.info['commands']}: pid {pid}: {' '.join(request['argv'][1:])} (in {request['cwd']})")
            conn.setblocking(True)
            conn.sendall(f"pid {pid}\n".encode())
            self.children[pid] = conn
            selector.register(conn, selectors.EVENT_READ, pid)

    def _kill_stuck(self) -> None:
        """A run still there well after its own stop watchdog should have ended it: kill it."""
        from flows.session import STOP_GRACE_S

        for pid, since in list(self._hung_up.items()):
            if pid not in self.children:
                del self._hung_up[pid]
            elif time.monotonic() - since > 2 * STOP_GRACE_S:
                log(f"pid {pid} did not stop within {2 * STOP_GRACE_S:.0f} s of its client's hang-up; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # its session (setsid): its helpers too
                del self._hung_up[pid]

    def _reap(self, selector: selectors.BaseSelector) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue  # the server or the cluster process: _processes_gone says so
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {code}\n".encode())
            conn.close()

    def _processes_gone(self) -> str | None:
        if self.server is not None and self.server.process is not None and self.server.process.poll() is not None:
            return "the Prefect server"
        if self.cluster is not None and self.cluster.poll() is not None:
            return "the Dask cluster"
        return None

    def _unpublish(self, server: socket.socket, selector: selectors.BaseSelector) -> None:
        """New commands start a new service from now on; those already here run to their end."""
        if self.socket_path.exists() and self._ours():
            self.socket_path.unlink()
        self._accept(server, selector)  # answers (with nothing) whoever connected meanwhile

    def _ours(self) -> bool:
        with contextlib.suppress(OSError, ValueError):
            return int(self.pid_path.read_text()) == os.getpid()
        return False

    def stop(self, _signum: int, _frame: object) -> None:
        self.stopping = True

    def close(self) -> None:
        if self._ours():
            for path in (self.pid_path, self.info_path, self.socket_path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if self.cluster is not None and self.cluster.poll() is None:
            self.cluster.terminate()
            try:
                self.cluster.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.cluster.kill()
        if self.server is not None:
            self.server.stop()
        with contextlib.suppress(FileNotFoundError):
            self.cluster_file.unlink()


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One command: its JSON (argv, env, cwd, umask) and its three standard streams."""
    conn.setblocking(True)
    conn.settimeout(10)
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 3)
    try:
        if len(fds) != 3 or len(data) < 4:
            raise ValueError("expected a request with three file descriptors")
        (size,) = struct.unpack("!I", data[:4])
        if size > REQUEST_LIMIT:
            raise ValueError(f"a request of {size} bytes")
        body = data[4:]
        while len(body) < size:
            more = conn.recv(size - len(body))
            if not more:
                raise ValueError("the request ended early")
            body += more
        conn.settimeout(None)
        return json.loads(body), fds
    except BaseException:
        for fd in fds:  # the command's streams stay open in its own process only
            os.close(fd)
        raise


def run_child(request: dict, fds: list[int], extra_env: dict[str, str]) -> None:
    """In the forked child: become the command, run the CLI, exit with its status."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        with contextlib.suppress(AttributeError, ValueError):
            sys.stdout.reconfigure(line_buffering=os.isatty(1))  # type: ignore[union-attr]
        os.chdir(request["cwd"])
        os.umask(int(request["umask"]))
        env = {**request["env"], **extra_env}
        for key, value in os.environ.items():
            env.setdefault(key, value)  # the quiet-log and Prefect defaults the service set
        os.environ.clear()
        os.environ.update(env)
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
        import cli.warm
        from cli.main import main

        cli.warm.in_service = True
        sys.argv = list(request["argv"])
        main()  # ends the process (cli.main.exit_now)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException as err:  # noqa: BLE001 - a child must never return into the service loop
        with contextlib.suppress(Exception):
            sys.stderr.write(f"shardsmith (warm): {type(err).__name__}: {err}\n")
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> int:
    socket_path = Path(argv[0])
    service = Service(socket_path, float(os.environ.get("SHARDSMITH_WARM_IDLE_S", "1200")))
    service.pid_path.write_text(str(os.getpid()))  # commands that come meanwhile wait for this one
    signal.signal(signal.SIGTERM, service.stop)  # also while it starts: it stops once it could serve
    try:
        from cli.running import quiet_logs

        quiet_logs(False)  # as a command without --verbose; the server and the cluster inherit it
        service.start_processes()
        service.warm()
        service.serve()
    except Exception as err:  # noqa: BLE001 - said in the log; commands then run without us
        log(f"{type(err).__name__}: {err}")
        return 1
    finally:
        service.close()
        log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
