"""Where a run executes: one Prefect API for the flow and its workers, and the Dask cluster."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Iterator

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


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """Use the configured Prefect API, or start one local server for this run and stop it after."""
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    url = get_current_settings().api.url
    if url:
        yield str(url)
        return
    from prefect.server.api.server import SubprocessASGIServer

    timeout = int(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    server = SubprocessASGIServer()
    server.start(timeout=timeout)
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            try:
                yield server.api_url
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
        raise NoGPU(f"--cluster cuda needs a CUDA GPU and its driver, and none is visible here ({type(err).__name__}: {err}); use --cluster local") from err
    if count == 0:
        raise NoGPU("--cluster cuda: the NVIDIA driver sees no GPU; use --cluster local")


def _cuda_cluster(threads_per_worker: int, env: dict[str, str]):
    from dask_cuda import LocalCUDACluster

    try:
        # One worker per GPU; the GPU resource keeps CPU-only stages off them.
        return LocalCUDACluster(threads_per_worker=threads_per_worker, resources={"GPU": 1}, env=env, dashboard_address=None)
    except Exception as err:
        if "NVML" in type(err).__name__ or "nvml" in str(err).lower() or "cuda" in str(err).lower():
            raise NoGPU(f"--cluster cuda needs a CUDA GPU and its driver, and none is visible here ({type(err).__name__}: {err}); use --cluster local") from err
        raise


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
    env = worker_env()
    if choice == "local":
        from distributed import LocalCluster

        cluster = LocalCluster(
            n_workers=workers or default_workers(),
            threads_per_worker=threads_per_worker,
            processes=True,
            dashboard_address=None,
            env=env,
        )
    else:
        cluster = _cuda_cluster(threads_per_worker, env)
    try:
        log.info("dask cluster %s at %s", choice, cluster.scheduler_address)
        yield cluster.scheduler_address
    finally:
        # A worker that takes long to exit (DALI and torch thread pools, a loaded machine) is
        # killed by its nanny; the run's work is committed by then, so a slow close is not a
        # failed run.
        try:
            cluster.close(timeout=60)
        except (TimeoutError, asyncio.TimeoutError) as err:
            log.warning("dask cluster did not close within 60 s (%r); its workers were killed", err)


def gather(futures: dict, progress, offset: float, share: float, logger, what: str = "shard") -> list:
    """Results in completion order; a shard that failed after its retries raises after all finish."""
    from prefect.artifacts import update_progress_artifact
    from prefect.futures import as_completed

    out, failed = [], []
    for done, fut in enumerate(as_completed(list(futures)), start=1):
        try:
            out.append(fut.result())
        except Exception as err:
            failed.append(f"{futures[fut]}: {type(err).__name__}: {err}")
            logger.error("shard %s failed: %s", futures[fut], err)
        update_progress_artifact(progress, offset + share * done / max(len(futures), 1))
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(futures)} {what} shards failed:\n" + "\n".join(failed[:20]))
    return out
