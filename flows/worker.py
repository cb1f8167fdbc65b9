"""Dask worker preload: import the stage modules as the worker starts, before its first task.

A worker that imports Prefect's task engine and the stage code only when its first task
arrives spends seconds of the run's critical path on it; the CLI starts the cluster beside
the Prefect server when it sees work coming, so these imports overlap the server's start.
They run before the worker registers (in a thread, they would race the first task's imports).
"""

from __future__ import annotations

import importlib

MODULES = (
    "prefect.task_engine",
    "prefect_dask",
    "tasks.stages.download",
    "tasks.stages.validate",
    "tasks.formats.manifests",
    "tasks.stages.reshard",
)


def _import_all() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a failing import shows itself again where it is used
            pass


def dask_setup(worker) -> None:  # noqa: ARG001 - Dask's preload hook
    _import_all()
