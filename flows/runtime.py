"""Where a run executes: one Prefect API for the flow and its workers, and the Dask cluster."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from prefect_dask import DaskTaskRunner

log = logging.getLogger("shardsmith")

# Settings every Dask worker must share with the flow; the API URL above all, or each worker
# process would start a temporary Prefect server of its own.
_SHARED_PREFIXES = ("PREFECT_",)


def worker_env() -> dict[str, str]:
    """Environment for worker processes: this process's Prefect settings, as variables."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    env = {k: str(v) for k, v in settings.to_environment_variables(exclude_unset=True).items() if v is not None}
    if settings.api.url:
        env["PREFECT_API_URL"] = str(settings.api.url)
    env.update({k: v for k, v in os.environ.items() if k.startswith(_SHARED_PREFIXES) and k not in env})
    return {k: v for k, v in env.items() if k.startswith(_SHARED_PREFIXES)}


class LocalServer:
    """A Prefect API server for one run, started in the background and stopped after it.

    Args:
        port: loopback port; default: a free one.

    ``start()`` returns at once, so the flow process, the Dask cluster and the server start
    side by side; ``wait()`` blocks until the API answers. This is the command Prefect's own
    ephemeral server runs (uvicorn over ``create_app``, no UI), in a session of its own, so a
    Ctrl-C in the terminal reaches only the CLI, which stops the server last, after the flow
    has recorded how the run ended.
    """

    def __init__(self, port: int | None = None):
        self.port = port or _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen | None = None

    def start(self) -> LocalServer:
        from prefect.settings import get_current_settings

        env = {
            **os.environ,
            **get_current_settings().to_environment_variables(exclude_unset=True),
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            # Block types are for deployments and automations, which a one-run server has none of.
            "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
        }
        env.pop("PREFECT_API_URL", None)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "prefect.server.api.server:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def wait(self, timeout: float) -> str:
        """Block until ``/api/health`` answers; returns the API URL."""
        import httpx

        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(
                        f"the local Prefect server exited with code {self.process.returncode} before it answered"
                    )
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return self.api_url
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the local Prefect server did not answer within {timeout:.0f} s (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
                    )
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _startup_timeout() -> float:
    return float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """Use the configured Prefect API, or start one local server for this run and stop it after."""
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    url = get_current_settings().api.url
    if url:
        yield str(url)
        return
    server = LocalServer().start()
    try:
        api = server.wait(_startup_timeout())
        with temporary_settings({PREFECT_API_URL: api}):
            try:
                yield api
            finally:
                _drain_prefect_workers()
    finally:
        server.stop()


def _drain_prefect_workers() -> None:
    """Send buffered logs and events while the server still runs; afterwards they would be
    retried against a closed port for a minute."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        for result in (APILogWorker.drain_all(), EventsWorker.drain_all()):
            if inspect.isawaitable(result):
                await result

    run_coro_as_sync(drain())


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


class NoGPU(RuntimeError):
    """``--cluster cuda`` on a machine where no CUDA GPU is visible."""


def require_gpu() -> None:
    """Fail fast, before any server or cluster starts, when ``cuda`` cannot work here."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as err:
        raise NoGPU(
            f"--cluster cuda needs a CUDA GPU and its driver, and none is visible here ({type(err).__name__}: {err}); use --cluster local"
        ) from err
    if count == 0:
        raise NoGPU("--cluster cuda: the NVIDIA driver sees no GPU; use --cluster local")


def _cuda_cluster(threads_per_worker: int, env: dict[str, str]):
    from dask_cuda import LocalCUDACluster

    try:
        # One worker per GPU; the GPU resource keeps CPU-only stages off them.
        return LocalCUDACluster(
            threads_per_worker=threads_per_worker, resources={"GPU": 1}, env=env, dashboard_address=None
        )
    except Exception as err:
        if "NVML" in type(err).__name__ or "nvml" in str(err).lower() or "cuda" in str(err).lower():
            raise NoGPU(
                f"--cluster cuda needs a CUDA GPU and its driver, and none is visible here ({type(err).__name__}: {err}); use --cluster local"
            ) from err
        raise


# Worker settings, measured on the download and validate phases (bench/RESULTS.md):
# - no MALLOC_TRIM_THRESHOLD_: Dask sets it to 64 KiB to hand memory back eagerly, and setting
#   it turns off glibc's adaptive mmap threshold, so every image body (100 KB to MBs) is
#   mmapped, page-faulted in and unmapped again;
# - no statistical profiler: it samples every thread every 10 ms for a dashboard we do not run.
WORKER_CONFIG = {
    "distributed.nanny.pre-spawn-environ": {"OMP_NUM_THREADS": 1, "MKL_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1},
    "distributed.worker.profile.enabled": False,
}
# Imported by every worker as it starts (see flows/worker.py), while the Prefect server starts.
WORKER_PRELOAD = "flows.worker"


def start_cluster(choice: str, workers: int | None, threads_per_worker: int, env: dict[str, str]):
    """A new ``local`` or ``cuda`` Dask cluster whose workers get ``env`` and our worker settings."""
    import dask

    with dask.config.set(WORKER_CONFIG):
        if choice == "cuda":
            return _cuda_cluster(threads_per_worker, env)
        from distributed import LocalCluster

        return LocalCluster(
            n_workers=workers or default_workers(),
            threads_per_worker=threads_per_worker,
            processes=True,
            dashboard_address=None,
            # No dashboard; the scheduler's health routes on a free port, not on a busy 8787.
            scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
            env=env,
            preload=[WORKER_PRELOAD],
        )


def close_cluster(cluster) -> None:
    """Close a cluster we started; a worker slow to exit is killed (the run's work is committed)."""
    try:
        cluster.close(timeout=60)
    except TimeoutError as err:
        log.warning("dask cluster did not close within 60 s (%r); its workers were killed", err)


@contextlib.contextmanager
def dask_cluster(choice: str, workers: int | None = None, threads_per_worker: int = 1) -> Iterator[str]:
    """Yield a scheduler address for ``local``, ``cuda`` or an existing scheduler's address.

    ``local`` and ``cuda`` clusters live for the block; their workers get this process's
    Prefect settings. An existing cluster's workers must already point at the same Prefect
    API (the docker-compose stack sets ``PREFECT_API_URL`` on every service).
    """
    if choice not in ("local", "cuda"):
        yield choice
        return
    cluster = start_cluster(choice, workers, threads_per_worker, worker_env())
    try:
        log.info("dask cluster %s at %s", choice, cluster.scheduler_address)
        yield cluster.scheduler_address
    finally:
        close_cluster(cluster)


class Session:
    """What one CLI run needs, started side by side: the Prefect API and the Dask cluster.

    Args:
        cluster: ``local``, ``cuda`` or a scheduler address (the recipe's ``execution.cluster``).
        workers, threads_per_worker: of a cluster we start.

    Without a configured ``PREFECT_API_URL`` a :class:`LocalServer` starts; the cluster starts
    in a thread at the same time, its workers importing the stage modules meanwhile, and the
    caller goes on reading the recipe and planning. ``api()`` and ``address()`` wait for
    their part. On exit the cluster closes and the server stops, side by side.
    """

    def __init__(self, cluster: str, workers: int | None = None, threads_per_worker: int = 1):
        from prefect.settings import get_current_settings

        self.choice = cluster
        self.server: LocalServer | None = None
        configured = get_current_settings().api.url
        if configured:
            self.api_url = str(configured)
        else:
            self.server = LocalServer().start()
            self.api_url = self.server.api_url
        self._cluster = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._spec = (cluster, workers, threads_per_worker)

    def start_cluster(self, workers: int | None = None) -> None:
        """Start our cluster in the background now (idempotent); a run that turns out to have
        nothing to compute never starts one. ``workers`` caps the worker processes (a run with
        one chunk to fetch starts one worker, not one per core)."""
        choice, configured, threads = self._spec
        workers = min(configured or default_workers(), workers) if workers else configured
        if choice not in ("local", "cuda"):
            return
        with self._lock:
            if self._thread is not None:
                return
            env = {**worker_env(), "PREFECT_API_URL": self.api_url}
            self._thread = threading.Thread(
                target=self._start_cluster, args=(choice, workers, threads, env), name="start-dask-cluster", daemon=True
            )
            self._thread.start()

    def task_runner(self):
        """A DaskTaskRunner that asks this session for the scheduler when it first submits a task."""
        return SessionTaskRunner(self.address)

    def _start_cluster(self, choice: str, workers: int | None, threads: int, env: dict[str, str]) -> None:
        try:
            self._cluster = start_cluster(choice, workers, threads, env)
        except BaseException as err:  # handed to whoever asks for the address
            self._error = err

    @contextlib.contextmanager
    def api(self) -> Iterator[str]:
        """The Prefect API for the block: the configured one, or ours once it answers."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        if self.server is None:
            yield self.api_url
            return
        self.server.wait(_startup_timeout())
        with temporary_settings({PREFECT_API_URL: self.api_url}):
            try:
                yield self.api_url
            finally:
                _drain_prefect_workers()

    def address(self) -> str:
        """The scheduler address, once the cluster we start is up (or the configured one)."""
        if self.choice not in ("local", "cuda"):
            return self.choice
        self.start_cluster()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._cluster.scheduler_address

    @property
    def owns_cluster(self) -> bool:
        return self.choice in ("local", "cuda")

    def stop_workers(self) -> None:
        """Kill our cluster's worker processes now, and keep their nannies from restarting them.

        What a killed worker was writing stays a temp file beside its target, never committed;
        the next run's lock sweep removes it.
        """
        cluster = self._cluster
        if cluster is None:
            return
        pids = []
        for nanny in list(getattr(cluster, "workers", {}).values()):
            with contextlib.suppress(Exception):
                nanny.close_gracefully(reason="shardsmith-stop")  # only a status: no restart
                if nanny.pid:
                    pids.append(nanny.pid)
        _kill(pids)

    def close(self) -> None:
        """Close the cluster, then stop the server: what the closing workers log still has an API."""
        if self._thread is not None:
            self._thread.join()
            if self._cluster is not None:
                close_cluster(self._cluster)
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SessionTaskRunner(DaskTaskRunner):
    """A DaskTaskRunner whose scheduler address is resolved when it first submits a task, so a
    phase with nothing to compute neither waits for nor starts a cluster.

    Args:
        resolve: gives the scheduler address (``Session.address``: starts our cluster if needed).
    """

    def __init__(self, resolve: Callable[[], str]):
        super().__init__(address="tcp://127.0.0.1:0")  # replaced before the client connects
        self._resolve = resolve

    @property
    def client(self):
        if not self._client:
            self.address = self._resolve()
        return DaskTaskRunner.client.fget(self)

    def duplicate(self) -> SessionTaskRunner:
        return type(self)(self._resolve)

    def __reduce__(self):
        # Prefect ships the flow run's context, this runner included, with every task; there it
        # is a plain DaskTaskRunner at the resolved address (the session stays in this process).
        return (DaskTaskRunner, (None, self.address))


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run; ``signum`` says which (exit status 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


# The signal that stopped this process's run, for the CLI's exit status (128 + signum).
stopped_by: int | None = None

# How long a stopping run may take to record its end, release the lock and stop its servers
# before the watchdog kills what is left and exits.
STOP_GRACE_S = 20.0


@contextlib.contextmanager
def stop_on_signals(session: Session) -> Iterator[None]:
    """SIGINT and SIGTERM stop the run within about ``STOP_GRACE_S`` seconds, exit 128 + signum.

    The first signal kills the workers of our cluster (what they were writing stays a temp
    file, never committed, removed by the next run) and raises :class:`Interrupted` in the main
    thread, so the flows record a crashed run, the dataset lock is released and the servers
    stop on the way out. A watchdog ends the process if that takes too long; a second signal
    ends it at once. Inside a flow, Prefect's own SIGTERM handler runs first and hands the
    signal back to ours when the outermost flow run has recorded it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    state: dict[str, int] = {}

    def hard_exit(signum: int) -> None:
        session.stop_workers()
        if session.server is not None and session.server.process is not None:
            _kill([session.server.process.pid])
        os._exit(128 + signum)

    def watchdog(signum: int) -> None:
        time.sleep(STOP_GRACE_S)
        log.error(
            "the run did not stop within %.0f s of %s; killing what is left", STOP_GRACE_S, signal.Signals(signum).name
        )
        hard_exit(signum)

    def handler(signum: int, _frame: object) -> None:
        if state:
            hard_exit(state["signum"])
        global stopped_by
        state["signum"] = stopped_by = signum
        sys.stderr.write(
            f"\n{signal.Signals(signum).name}: stopping; committed shards stay, the rest is redone by the next run\n"
        )
        threading.Thread(target=watchdog, args=(signum,), name="stop-watchdog", daemon=True).start()
        session.stop_workers()
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except BaseException:
        if state:  # a signal came: what is propagating is (or replaced) our Interrupted
            session.stop_workers()
            raise Interrupted(state["signum"]) from None
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def cleanup_on_stop(session: Session | None, lock) -> Iterator[None]:
    """On a signal inside the block, stop our workers and sweep their temp files while the
    dataset lock (``lock``, a held RunLock) is still ours, so only committed outputs remain.

    Prefect's SIGTERM handler runs first inside a flow and raises ``TerminationSignal`` here,
    before our own handler has run; a cluster we did not start is left alone (its workers may
    still write, and the next run's sweep removes what they leave).
    """
    from prefect.exceptions import ExternalSignal

    try:
        yield
    except (KeyboardInterrupt, ExternalSignal):
        if session is not None and session.owns_cluster:
            session.stop_workers()
            with contextlib.suppress(Exception):
                lock.sweep()
        raise


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


_warming = threading.Lock()
_warmed = False


def warm_gates() -> None:
    """Import Great Expectations (about 5 s) in the background once this process has shard work
    running, so the gate after it does not wait for it; a rerun with nothing to do (every
    verdict reused, tasks/audit/gate_cache.py) never imports it."""
    global _warmed
    with _warming:
        if _warmed:
            return
        _warmed = True
    from tasks.audit.ge_runner import preload

    threading.Thread(target=preload, name="preload-great-expectations", daemon=True).start()


def gather_all(
    futures: dict, progress, what: str, rows: int | None = None, offset: float = 0.0, share: float = 100.0, logger=None
) -> tuple[list, list[str]]:
    """(results, failures) in completion order; a failure is ``"{label}: {Type}: {message}"``.

    ``futures`` maps each future to a label for people (its shard). ``progress`` is the phase's
    Prefect progress artifact (``offset`` + ``share`` percent of it is this step), updated at
    most once a second; the terminal of a CLI run shows ``what`` with shards and rows done.
    """
    from prefect.artifacts import update_progress_artifact
    from prefect.futures import as_completed

    from flows import progress as terminal

    if logger is None:
        from prefect import get_run_logger

        logger = get_run_logger()
    out, failed = [], []
    if futures:
        warm_gates()
        terminal.start(what, len(futures), rows)
    last = 0.0
    for done, fut in enumerate(as_completed(list(futures)), start=1):
        try:
            result = fut.result()
            out.append(result)
            terminal.advance(what, result[0] if isinstance(result, tuple) else result)
        except Exception as err:
            failed.append(f"{futures[fut]}: {type(err).__name__}: {err}")
            logger.error("shard %s failed: %s", futures[fut], err)
            terminal.advance(what)
        now = time.monotonic()
        if progress is not None and (now - last > 1.0 or done == len(futures)):
            update_progress_artifact(progress, offset + share * done / max(len(futures), 1))
            last = now
    if not futures and progress is not None:
        update_progress_artifact(progress, offset + share)
    if futures:
        terminal.finish(what)
    return out, failed


def gather(
    futures: dict, progress, offset: float, share: float, logger, what: str = "shard", rows: int | None = None
) -> list:
    """Results in completion order; a shard that failed after its retries raises after all finish.

    ``progress`` is the phase's Prefect progress artifact (``offset`` + ``share`` percent of it
    is this step); the terminal of a CLI run shows ``what`` with shards and rows done.
    """
    out, failed = gather_all(futures, progress, what, rows, offset, share, logger)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(futures)} {what} shards failed:\n" + "\n".join(failed[:20]))
    return out
