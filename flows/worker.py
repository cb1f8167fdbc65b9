"""Dask worker preload: import the stage modules while the cluster and the Prefect server start.

A worker that imports Prefect's task engine and the stage code only when its first task
arrives spends seconds of the run's critical path on it; importing them in a thread at
worker start moves that off it. A task that arrives first simply waits for the import lock.
"""

from __future__ import annotations

import importlib
import threading

MODULES = (
    "prefect.task_engine",
    "prefect_dask",
    "tasks.download",
    "tasks.validate",
    "tasks.manifests",
    "tasks.reshard",
)


def _import_all() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a failing import shows itself again where it is used
            pass


def dask_setup(worker) -> None:  # noqa: ARG001 - Dask's preload hook
    threading.Thread(target=_import_all, name="shardsmith-preload", daemon=True).start()
