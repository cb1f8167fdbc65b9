"""One CLI run's Prefect API and Dask cluster, started side by side, and how a signal stops them."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from prefect_dask import DaskTaskRunner

from flows.runtime import (
    LocalServer,
    close_cluster,
    default_workers,
    drain_prefect_workers,
    local_api_settings,
    log,
    start_cluster,
    startup_timeout,
    worker_env,
)
from flows.warm_cluster import API_ENV, CLUSTER_ENV, scheduler_address


class Session:
    """What one CLI run needs, started side by side: the Prefect API and the Dask cluster.

    Args:
        cluster: ``local``, ``cuda`` or a scheduler address (the recipe's ``execution.cluster``).
        workers, threads_per_worker: of a cluster we start.

    Without a configured ``PREFECT_API_URL`` a :class:`LocalServer` starts (or ``server``, one
    the caller started earlier, is used and from then on stopped by the session); the cluster starts
    in a thread at the same time, its workers importing the stage modules meanwhile, and the
    caller goes on reading the recipe and planning. ``api()`` and ``address()`` wait for
    their part. On exit the cluster closes and the server stops, side by side.
    """

    def __init__(
        self, cluster: str, workers: int | None = None, threads_per_worker: int = 1, server: LocalServer | None = None
    ):
        from prefect.settings import get_current_settings

        self.choice = cluster
        self.server: LocalServer | None = None
        configured = get_current_settings().api.url
        warm_api = os.environ.get(API_ENV)
        if configured or warm_api:
            if server is not None:  # started early (runtime.early_server); a profile names an API
                server.stop()
        if configured:
            self.api_url = str(configured)
        elif warm_api:  # the warm service's server (cli/warm_service.py): waited for, never stopped here
            self.server = LocalServer.at(warm_api)
            self.api_url = warm_api
        else:
            self.server = server or LocalServer().start()
            self.api_url = self.server.api_url
        self._cluster = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._spec = (cluster, workers, threads_per_worker)
        # The warm service's cluster, when it is the one the recipe asks for (one single-threaded
        # worker per core); a cluster shared with other commands, so never ours to stop.
        warm = os.environ.get(CLUSTER_ENV)
        fits = cluster == "local" and workers in (None, default_workers()) and threads_per_worker == 1
        self.warm_cluster: str | None = warm if warm and fits else None

    def start_cluster(self, workers: int | None = None) -> None:
        """Start our cluster in the background now (idempotent); a run that turns out to have
        nothing to compute never starts one. ``workers`` caps the worker processes (a run with
        one chunk to fetch starts one worker, not one per core)."""
        choice, configured, threads = self._spec
        workers = min(configured or default_workers(), workers) if workers else configured
        if choice not in ("local", "cuda") or self.warm_cluster:
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
        from prefect.settings import temporary_settings

        if self.server is None:
            yield self.api_url
            return
        self.server.wait(startup_timeout())
        with temporary_settings(local_api_settings(self.api_url)):
            try:
                yield self.api_url
            finally:
                drain_prefect_workers()

    def address(self) -> str:
        """The scheduler address, once the cluster we start is up (or the configured one)."""
        if self.choice not in ("local", "cuda"):
            return self.choice
        if self.warm_cluster:
            return scheduler_address(self.warm_cluster, startup_timeout())
        self.start_cluster()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._cluster.scheduler_address

    def stop_own_tasks(self, timeout: float = 30.0) -> list[str]:
        """Restart the warm cluster's workers that still run this process's tasks; their addresses.

        Dask cannot interrupt a running task, and a stopped run's tasks would go on fetching
        (or writing) on the shared workers after the run let go of the dataset. Other commands'
        tasks on those workers are run again elsewhere by Dask. Only the warm service's cluster:
        a cluster the recipe names is someone else's to restart.
        """
        if not self.warm_cluster or not submitted:
            return []
        from distributed import Client

        with Client(self.address(), timeout=timeout) as client:
            # Asked of the workers: a task whose flow closed its client is forgotten by the
            # scheduler at once, but its thread runs on (the worker holds it as cancelled).
            running = client.run(_running_keys)
            stuck = [w for w, keys in running.items() if submitted.intersection(keys)]
            if stuck:
                client.restart_workers(stuck, timeout=timeout, raise_for_error=False)
        return stuck

    @property
    def owns_cluster(self) -> bool:
        return self.choice in ("local", "cuda") and not self.warm_cluster

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
        """Close the cluster, then stop the server: what the workers logged still has an API."""
        if self._thread is not None:
            self._thread.join()
            if self._cluster is not None:
                self.end_workers()
                close_cluster(self._cluster)
        if self.server is not None:
            self.server.stop()

    def end_workers(self, timeout: float = 10.0) -> None:
        """Have our workers send what they logged to the Prefect API, then kill them.

        Called once the flows are done, so the workers hold nothing uncommitted. A worker's
        orderly exit (Dask's close, then Python's shutdown of a process holding Prefect, Dask,
        pyarrow and the stage modules) took 0.9-1.5 s of every run's end; this takes 0.1 s.
        A worker that does not answer within ``timeout`` is killed all the same.
        """
        from distributed import Client

        def drain() -> None:
            with contextlib.suppress(Exception), Client(self._cluster, timeout=timeout) as client:
                client.run(drain_prefect_workers)

        sender = threading.Thread(target=drain, name="drain-workers", daemon=True)
        sender.start()
        sender.join(timeout)
        self.stop_workers()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The Dask keys of the tasks this process submitted (one run per process), for a stopping run
# on a cluster it shares to find the workers still running its tasks (Session.stop_own_tasks).
submitted: set[str] = set()


def _running_keys(dask_worker) -> list[str]:
    """On a worker: the keys of the tasks its threads run now, cancelled ones included."""
    return [
        str(ts.key) for ts in dask_worker.state.tasks.values() if ts.state in ("executing", "long-running", "cancelled")
    ]


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

    def submit(self, task, parameters, wait_for=None, dependencies=None):
        future = super().submit(task, parameters, wait_for=wait_for, dependencies=dependencies)
        submitted.add(future.wrapped_future.key)
        return future

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
        from tasks.formats.locks import release_held

        session.stop_workers()
        release_held()  # the main thread never reached the lock's release: free the dataset now
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
    before our own handler has run. On the warm service's shared cluster only the workers that
    run our tasks are restarted; a cluster the recipe names is left alone (its workers may still
    write, and the next run's sweep removes what they leave).
    """
    from prefect.exceptions import ExternalSignal

    try:
        yield
    except (KeyboardInterrupt, ExternalSignal):
        if session is not None and session.owns_cluster:
            session.stop_workers()
            with contextlib.suppress(Exception):
                lock.sweep()
        elif session is not None and session.warm_cluster:
            with contextlib.suppress(Exception):
                stopped = session.stop_own_tasks()
                log.info("restarted the warm workers %s, which ran this run's tasks", stopped)
                lock.sweep()
        raise


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
