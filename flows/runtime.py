"""Where a run executes: one Prefect API for the flow and its workers, and the Dask cluster."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

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


# What a server that lives for one run needs of Prefect's server settings.
ONE_RUN_SERVER = {
    "PREFECT_UI_ENABLED": "0",
    "PREFECT__SERVER_EPHEMERAL": "1",
    "PREFECT__SERVER_FINAL": "1",
    # Block types are for deployments and automations, which a one-run server has none of.
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
    # With the above off, the memo check around it would still import every installed Prefect
    # collection (prefect-dask, and Dask with it: ~0.5 CPU s of the server's start) to hash
    # the blocks they declare.
    "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false",
    # Events are for automations and the UI's event feed, which a local server has neither of;
    # their writer's batches took SQLite's write lock beside the flows' own writes, and a
    # request that met it got a 503 that Prefect's client retries after 2 s.
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
}


KEEP_ALIVE_S = 300


class LocalServer:
    """A Prefect API server for one run, started in the background and stopped after it.

    Args:
        port: loopback port; default: a free one.

    ``start()`` returns at once, so the flow process, the Dask cluster and the server start
    side by side; ``wait()`` blocks until the API answers. This is the command Prefect's own
    ephemeral server runs (uvicorn over ``create_app``, no UI), in a session of its own, so a
    Ctrl-C in the terminal reaches only the CLI, which stops the server last, after the flow
    has recorded how the run ended. The server also stops by itself when this process dies
    without stopping it (``flows/local_server.py``).
    """

    def __init__(self, port: int | None = None):
        self.port = port or _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen | None = None

    @classmethod
    def at(cls, api_url: str) -> LocalServer:
        """One that runs already (the warm service's): ``wait()`` works, ``stop()`` does nothing."""
        from urllib.parse import urlsplit

        server = cls(urlsplit(api_url).port)
        server.api_url = api_url
        return server

    def env(self) -> dict[str, str]:
        """The server process's environment: this process's, less its API URL, plus a one-run
        server's settings."""
        env = dict(os.environ)
        if "prefect.settings" in sys.modules:
            # Settings this process may hold only in memory (a test harness's temporary
            # settings); before Prefect is imported there are none, and the server reads the
            # same environment and profile as this process would, without the import here.
            from prefect.settings import get_current_settings

            env.update(get_current_settings().to_environment_variables(exclude_unset=True))
        env |= ONE_RUN_SERVER
        env.pop("PREFECT_API_URL", None)
        return env

    def start(self) -> LocalServer:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.local_server",  # uvicorn, ending when this process is gone
                str(os.getpid()),
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
                # uvicorn closes a connection idle for 5 s by default; a client that sends on it
                # just then (Prefect's clients keep theirs across phases) gets an error and
                # Prefect retries after 2 s. Our clients are all on this machine.
                "--timeout-keep-alive",
                str(KEEP_ALIVE_S),
            ],
            env=self.env(),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def wait(self, timeout: float) -> str:
        """Block until ``/api/health`` answers; returns the API URL."""
        import httpx

        deadline = time.monotonic() + timeout
        restarts = STARTUP_RESTARTS
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    if self.process.returncode == UVICORN_STARTUP_FAILURE and restarts:
                        # Servers starting together on a new PREFECT_HOME all create its
                        # database; the losers fail their startup ("table already exists").
                        # The database is there now: start again, on the same port (the
                        # run's workers were told it).
                        restarts -= 1
                        time.sleep(0.5)
                        self.start()
                        continue
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


def early_server() -> LocalServer | None:
    """Start this run's local Prefect server now, before this process imports Prefect.

    Importing Prefect's server takes the new process 10-14 s on 2 cores, the longest thing a
    small run waits for; started here it imports while this process imports the flows. None
    when ``PREFECT_API_URL`` is set in the environment. An API URL set only in a Prefect
    profile is seen later, by :class:`flows.session.Session`, which stops this server unused.
    """
    if os.environ.get("PREFECT_API_URL") or os.environ.get("SHARDSMITH_WARM_API"):
        return None  # a configured server, or the warm service's (cli/warm_service.py)
    return LocalServer().start()


# uvicorn's exit code when the application's startup fails (its STARTUP_FAILURE).
UVICORN_STARTUP_FAILURE = 3
STARTUP_RESTARTS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def startup_timeout() -> float:
    return float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))


def local_api_settings(api_url: str) -> dict:
    """Prefect settings for flows on a local server that lives only as long as the run: its
    API, and no flow-run heartbeats (they tell a crashed run to a server that outlives it; each
    costs a flow run's end up to 1 s, flows.phase.run_phase)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    return {PREFECT_API_URL: api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """Use the configured Prefect API, or start one local server for this run and stop it after."""
    from prefect.settings import get_current_settings, temporary_settings

    url = get_current_settings().api.url
    if url:
        yield str(url)
        return
    server = LocalServer().start()
    try:
        api = server.wait(startup_timeout())
        with temporary_settings(local_api_settings(api)):
            try:
                yield api
            finally:
                drain_prefect_workers()
    finally:
        server.stop()


def drain_prefect_workers() -> None:
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


def leave_dask_slot() -> bool:
    """Give the running task's thread slot back to its Dask worker (``secede``), so the worker starts its next task.

    For a task that from here on mostly waits (a shard whose last rows wait on slow servers or
    their timeouts): it runs on to its end on its own thread, beside the task that took its
    slot. False, and nothing done, outside a Dask worker's task thread (a test, a plain call).
    """
    try:
        from distributed import secede
        from distributed.worker import get_worker, thread_state
    except ImportError:
        return False
    try:
        get_worker()
        if getattr(thread_state, "key", None) is None:
            return False
        secede()
    except (ValueError, AttributeError):
        return False
    return True


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
    from distributed import LocalCluster

    # distributed registers its config defaults when first imported: imported inside the block
    # below, they would be recorded as new keys and removed with it, all of them.
    with dask.config.set(WORKER_CONFIG):
        if choice == "cuda":
            return _cuda_cluster(threads_per_worker, env)
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
