"""The skeleton every phase flow shares: tasks with retries, a progress artifact, gather, gate, record."""

from __future__ import annotations

import copy as _copy
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
from prefect import Flow, flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from flows.audit import check_gate, judge_phase, phase_record, run_gate
from tasks.audit.runrecord import PhaseRecord, RunRecord
from tasks.formats.ledger import Counts
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage

_warming = threading.Lock()
_warmed = False


def warm_gates() -> None:
    """Import Great Expectations (about 4 s) in the background once this process has shard work
    ahead (the CLI calls this while the Prefect server starts, ``gather_all`` otherwise), so the
    gate after it does not wait for it; a rerun with nothing to do (every verdict reused,
    tasks/audit/gate_cache.py) never imports it."""
    global _warmed
    with _warming:
        if _warmed:
            return
        _warmed = True
    from tasks.audit.ge_runner import preload

    threading.Thread(target=preload, name="preload-great-expectations", daemon=True).start()


def gather_all(
    futures: dict,
    progress,
    what: str,
    rows: int | None = None,
    offset: float = 0.0,
    share: float = 100.0,
    logger=None,
    shards: int | None = None,
) -> tuple[list, list[str]]:
    """(results, failures) in completion order; a failure is ``"{label}: {Type}: {message}"``.

    ``futures`` maps each future to a label for people (its shard). ``progress`` is the phase's
    Prefect progress artifact (``offset`` + ``share`` percent of it is this step), updated at
    most once a second; the terminal of a CLI run shows ``what`` with shards and rows done, out
    of ``shards`` (default: one per future; more where a task returns a list of shards).
    """
    from prefect.futures import as_completed

    from flows import progress as terminal

    if logger is None:
        logger = get_run_logger()
    out, failed = [], []
    if futures:
        warm_gates()
        terminal.start(what, shards or len(futures), rows)
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
    futures: dict,
    progress,
    offset: float,
    share: float,
    logger,
    what: str = "shard",
    rows: int | None = None,
    shards: int | None = None,
) -> list:
    """Results in completion order; a shard that failed after its retries raises after all finish.

    ``progress`` is the phase's Prefect progress artifact (``offset`` + ``share`` percent of it
    is this step); the terminal of a CLI run shows ``what`` with shards and rows done.
    """
    out, failed = gather_all(futures, progress, what, rows, offset, share, logger, shards)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(futures)} {what} shards failed:\n" + "\n".join(failed[:20]))
    return out


def run_phase(flow: Flow[Any, Any], runner: Any, **params: Any) -> Any:
    """Run a phase's flow as a subflow of the run's flow, its tasks on ``runner``.

    The flow runs as a copy with that task runner, not ``Flow.with_options``: that builds a
    new Flow, and Prefect computes the JSON schema of the flow's parameters again each time
    (the phase flows take a Recipe and typed summaries: 0.3-1.5 s of CPU per phase per run,
    measured with py-spy on a 20-row run).

    The phase sends no Prefect heartbeats of its own: the run's flow sends them (they are how a
    Prefect automation tells a crashed run). A flow run's end waits for its heartbeat thread,
    which sleeps a second at a time: up to 1 s per phase, 0.9 s on average for the short
    phases of a rerun (six subflows: 7.6 s with heartbeats, 2.0 s without, on a running server).
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    copy = _copy.copy(flow)
    copy.task_runner = runner
    if PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None:
        # Off for the whole run already (a run's own local server, flows.runtime): Prefect
        # builds its settings again for every temporary change, ~40 ms a phase.
        return copy(**params)
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        return copy(**params)


def phase_flow(**options: Any) -> Callable[[Callable[..., Any]], Flow[Any, Any]]:
    """``prefect.flow`` for a phase's flow, less the parameter schema Prefect builds with it.

    A phase flow runs only as a subflow of the run's flow (``run_phase``); it is never deployed,
    and a deployment builds its own form from the function anyway (``RunnerDeployment``
    calls ``parameter_schema(flow)``). ``Flow.__init__`` still builds one for every flow, for
    its ``parameters`` attribute, which nothing reads: the JSON schema of a Recipe and the
    phases' typed summaries, 0.04-0.26 s of CPU per flow at import (0.5 s for the pretraining
    phases, on the critical path of every run's first seconds). Here it is an empty schema.
    """
    import prefect.flows
    from prefect.utilities.callables import ParameterSchema

    def decorate(fn: Callable[..., Any]) -> Flow[Any, Any]:
        with _schema_lock:
            build = getattr(prefect.flows, "parameter_schema", None)
            if build is None:  # Prefect moved it: build the flow as it would
                return flow(**options)(fn)
            prefect.flows.parameter_schema = lambda _fn: ParameterSchema()
            try:
                return flow(**options)(fn)
            finally:
                prefect.flows.parameter_schema = build

    return decorate


_schema_lock = threading.Lock()


def task_options(recipe: Recipe) -> dict[str, Any]:
    """Prefect options of every shard task: the recipe's retries and their delay."""
    ex = recipe.execution
    return {"retries": ex.task_retries, "retry_delay_seconds": ex.task_retry_delay_s}


# Phase flows whose inputs are earlier phases' results (dataclasses, typed in their signatures)
# are declared with ``validate_parameters=False``: Prefect would only pass the same objects on,
# after walking every field of every shard result.


def all_skipped(*groups: Iterable[Any]) -> bool:
    """Whether a phase had shards and an earlier run had done every one (each result's
    ``skipped``): it did nothing now, so its summaries say ``skipped`` instead of a rate."""
    results = [r for group in groups for r in group]
    return bool(results) and all(r.skipped for r in results)


class Phase:
    """One run of a phase flow: what every phase does around its own tasks, written once.

    Args:
        recipe: the run's recipe (storage, retries, gates).
        run: the run record so far; ``record`` and ``close`` replace ``self.run`` with the
            record that follows (the flow returns it).
        name: the phase (``download``, ``validate`` ...); names its progress artifact and gate.
        description: the progress artifact's description, after the dataset's name.

    Starts the phase's clock and its Prefect progress artifact; ``submit`` sends a task with
    the recipe's retries, ``gather`` collects a step's results into a share of the progress,
    ``judge`` gives the gate's verdict (reused when the inputs are unchanged), ``record`` adds
    the phase to the run record and ``close`` publishes the report and stops on a failed gate.
    """

    def __init__(self, recipe: Recipe, run: RunRecord, name: str, description: str):
        self.started = time.perf_counter()
        self.recipe, self.run, self.name = recipe, run, name
        self.logger = get_run_logger()
        self.storage = Storage(recipe.storage, recipe.storage_options)
        self.options = task_options(recipe)
        self.progress = create_progress_artifact(
            0.0, key=f"{recipe.dataset}-{name}-progress", description=f"{recipe.dataset}: {description}"
        )

    @property
    def seconds(self) -> float:
        """Wall seconds since the phase started."""
        return time.perf_counter() - self.started

    def rate(self, fresh: int, seconds: float | None = None) -> float:
        """Samples per second of the work done now (``fresh``: skipped shards not counted)."""
        seconds = self.seconds if seconds is None else seconds
        return round(fresh / seconds, 1) if seconds else 0.0

    def submit(self, task: Any, *args: Any) -> Any:
        """Submit ``task`` with the recipe's retries."""
        return task.with_options(**self.options).submit(*args)

    def gather(self, futures: dict, offset: float, share: float, what: str, shards: int | None = None) -> list:
        """Results of a step (``offset`` + ``share`` percent of the progress); raises after all
        finish when a shard failed after its retries. ``shards``: as for ``gather_all``."""
        return gather(futures, self.progress, offset, share, self.logger, what, shards=shards)

    def judge(self, files: list[str], settings: tuple[Any, ...], evaluate: Callable[[], Any]) -> tuple[Any, dict]:
        """The gate's verdict and its report links (flows.audit.judge_phase)."""
        return judge_phase(self.storage, self.recipe, self.run, self.name, files, settings, evaluate)

    def links(self, gate: Any) -> dict[str, str]:
        """Save a gate judged here (never reused) under the run's report folder; its links."""
        return run_gate(self.storage, self.recipe, self.run, gate)

    def record(
        self,
        counts: Counts,
        ledger: pa.Table,
        samples_per_s: float,
        gate: Any,
        links: dict[str, str],
        name: str | None = None,
        seconds: float | None = None,
        shards: int | None = None,
        packing: dict[str, Any] | None = None,
        timings: dict[str, float] | None = None,
        skipped: bool = False,
    ) -> PhaseRecord:
        """Add the phase's entry (``name``: another than the phase's own) to the run record;
        ``shards``, ``packing``, ``timings`` and ``skipped`` (:func:`all_skipped`) as
        ``PhaseRecord`` takes them."""
        seconds = self.seconds if seconds is None else seconds
        entry = phase_record(
            name or self.name, counts, ledger, seconds, samples_per_s, gate, links, shards, packing, timings, skipped
        )
        self.run = self.run.with_phase(entry)
        return entry

    def close(self, gate: Any, samples: pa.Table | None = None, why: str = "", done: bool = True) -> str:
        """Publish the report (progress at 100 % when ``done``); raise ``GateFailed`` after it
        when the gate failed. Returns the report's link."""
        if done:
            update_progress_artifact(self.progress, 100.0)
        self.run, url = check_gate(self.storage, self.recipe, self.run, gate, samples, why)
        return url
