"""Gates and the audit trail of a run: gate reports, the HTML report, and Prefect artifacts."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

import pyarrow as pa
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.audit.runrecord import PhaseRecord, RunRecord
from tasks.audit.tallies import by_family, by_license, by_source
from tasks.formats.ledger import Counts
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage

if TYPE_CHECKING:
    from tasks.audit.report_web import Link


class GateFailed(RuntimeError):
    """A phase's gate failed: nothing downstream runs; the report says why.

    Args:
        message: why, and where the report is.
        run: the run record as the report shows it, blocked (default None).
    """

    def __init__(self, message: str, run: RunRecord | None = None):
        super().__init__(message)
        self.run = run


def report_dir(recipe: Recipe, run: str) -> str:
    return f"{recipe.dataset}/reports/{run}"


def new_run(recipe: Recipe, run: str) -> RunRecord:
    """The record of a run starting now, inside the flow run a user started (its artifacts go there)."""
    return RunRecord(
        dataset=recipe.dataset,
        run=run,
        recipe_hash=recipe.recipe_hash(),
        storage=recipe.storage,
        started=_now(),
        flow_run_id=_current_flow_run_id(),
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _current_flow_run_id() -> str | None:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx is not None and ctx.flow_run is not None else None


def phase_record(
    phase: str,
    counts: Counts,
    ledger: pa.Table,
    seconds: float,
    samples_per_s: float,
    gate: Any | None,
    links: dict[str, str],
    shards: int | None = None,
    packing: dict[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    skipped: bool = False,
) -> PhaseRecord:
    """A phase's entry in the run record, from its counts, ledger and gate (``skipped``: every
    shard was done by an earlier run)."""
    return PhaseRecord(
        phase=phase,
        rows=counts.rows,
        ok=counts.ok,
        rejected=counts.rejected,
        error=counts.error,
        by_reason=counts.by_reason,
        by_source=by_source(ledger),
        by_license=by_license(ledger),
        seconds=round(seconds, 3),
        samples_per_s=samples_per_s,
        # The full Great Expectations result is in gates/{phase}.json; run.json keeps the outcomes.
        gate={k: v for k, v in gate.to_json().items() if k != "ge_result"} if gate is not None else None,
        links=links,
        shards=shards,
        packing=packing,
        timings=timings,
        skipped=skipped,
    )


def run_gate(
    storage: Storage, recipe: Recipe, run: RunRecord, gate: Any, reused_from: str | None = None
) -> dict[str, str]:
    """Save a gate's JSON and Data Docs under the run's report folder; return relative links.

    A gate reused from run ``reused_from`` keeps its Data Docs there; the link points at them.
    """
    from tasks.audit.data_docs import save_gate_report

    base = report_dir(recipe, run.run)
    written = save_gate_report(gate, storage, f"{base}/gates", docs=reused_from is None)
    if reused_from is not None:
        written["data_docs"] = f"{report_dir(recipe, reused_from)}/gates/data_docs/index.html"
    # Links in the HTML report are relative to the report's folder.
    return {
        name: path[len(base) + 1 :] if path.startswith(base + "/") else _relative(path, base)
        for name, path in written.items()
    }


def _relative(path: str, base: str) -> str:
    import posixpath

    return posixpath.relpath(path, base) if not path.startswith(("/", "s3://", "http")) else path


def judge_phase(
    storage: Storage,
    recipe: Recipe,
    run: RunRecord,
    phase: str,
    files: list[str],
    settings: tuple[Any, ...],
    evaluate: Callable[[], Any],
) -> tuple[Any, dict[str, str]]:
    """A phase's gate verdict and its report links; a verdict that passed on exactly these
    files and settings in an earlier run is reused instead of evaluated again (tasks/audit/gate_cache.py)."""
    from tasks.audit.gate_cache import gate_key, recall, remember, stamps

    try:
        key = gate_key(phase, stamps(storage, files), *settings)
    except FileNotFoundError:
        key = None
    hit = recall(storage, recipe.dataset, phase, key) if key else None
    if hit is not None:
        gate, origin = hit
        gate.statistics["reused_from"] = origin
        return gate, run_gate(storage, recipe, run, gate, reused_from=origin)
    gate = evaluate()
    links = run_gate(storage, recipe, run, gate)
    if key:
        remember(storage, recipe.dataset, phase, key, gate, run.run)
    return gate, links


# Set while a phase runs that is not the run's last (flows/pretraining.py): its gate passing,
# it writes run.json and its own artifacts, and leaves the report page and the run's
# artifacts to the phases after it. A small run's phases take a fraction of a second each; the
# page and the run's artifacts took about 0.3 s per phase. A failed gate, the run's last phase
# and a run that stops on an error (``publish_unfinished``) publish everything.
_INTERMEDIATE: ContextVar[bool] = ContextVar("shardsmith_intermediate_phase", default=False)


@contextlib.contextmanager
def intermediate_phase(on: bool) -> Iterator[None]:
    token = _INTERMEDIATE.set(on)
    try:
        yield
    finally:
        _INTERMEDIATE.reset(token)


def publish_unfinished(storage: Storage, recipe: Recipe, run: RunRecord) -> None:
    """The report and the run's artifacts as far as a run got that stopped on an error after an
    intermediate phase (best effort: the error that stopped it is what the caller raises)."""
    from tasks.audit.report import write_report
    from tasks.audit.report_web import report_link

    with contextlib.suppress(Exception):
        written = write_report(storage, report_dir(recipe, run.run), run, None)
        _post_run(storage, recipe, run, written, report_link(storage, written["html"]), None)


def publish(storage: Storage, recipe: Recipe, run: RunRecord, samples: pa.Table | None = None) -> tuple[RunRecord, str]:
    """Write run.json and report.html for the run so far, and post its artifacts: the phase's
    summary and reasons on the phase's own flow run, and the run's summary, reasons, gates,
    plots and links on the run a user started (see ``post_run_artifacts``).

    Returns the record as published (finished now) and the report's link (a URL a browser
    opens, or its path when nothing serves it).
    """
    from tasks.audit.phase_markdown import phase_markdown
    from tasks.audit.report import write_report
    from tasks.audit.report_web import report_link

    base = report_dir(recipe, run.run)
    run = run.finished_at(_now())
    intermediate = _INTERMEDIATE.get() and not run.blocked  # a failed gate is published whole
    written = write_report(storage, base, run, samples, html=not intermediate)
    report = report_link(storage, written["html"])
    phase = run.phases[-1] if run.phases else None
    key = recipe.dataset
    if phase is not None:
        name = phase.phase
        create_markdown_artifact(
            phase_markdown(run, phase, report), key=f"{key}-{name}-summary", description=f"{key}: {name} summary"
        )
        table = [
            {"reason": r, "rows": n, "share": round(n / max(phase.rows, 1), 4)}
            for r, n in by_family(dict(phase.by_reason)).items()
        ]
        create_table_artifact(
            table or [{"reason": "(none)", "rows": 0, "share": 0.0}],
            key=f"{key}-{name}-reasons",
            description=f"{key}: {name} rows by reason",
        )
    if not intermediate:
        _post_run(storage, recipe, run, written, report, samples)
    return run, report.url


def _post_run(
    storage: Storage, recipe: Recipe, run: RunRecord, written: dict[str, str], report: Link, samples: pa.Table | None
) -> None:
    """The run's artifacts, with the samples table its report folder holds when none is given."""
    from tasks.audit.report import read_samples

    if samples is None and "samples" in written:
        samples = read_samples(storage, written["samples"])
    post_run_artifacts(storage, recipe, run, report, samples)


def post_run_artifacts(
    storage: Storage, recipe: Recipe, run: RunRecord, report: Link, samples: pa.Table | None
) -> None:
    """Create, or update in place, the run's artifacts on the flow run a user started (the
    ``pretraining`` deployment's run, the CLI's ``shardsmith-{dataset}`` run): its summary
    with the key plots (``{dataset}-summary``), rows by reason (``-reasons``), every gate
    check (``-gates``), and links to the report (``-report``) and Data Docs (``-data-docs``).

    Prefect attaches an artifact to the run that creates it, which here is a phase's subflow;
    naming the top-level run and updating the same artifacts after each phase keeps one
    current set there, whichever phase wrote last.
    """
    from tasks.audit.curation_views import read_curation
    from tasks.audit.report_markdown import gate_rows, reason_rows, run_summary
    from tasks.audit.report_web import link_markdown, report_link

    flow_run_id = run.flow_run_id or _current_flow_run_id()
    if flow_run_id is None:
        return  # not inside a flow: nothing to attach to
    key = recipe.dataset
    links = {"audit report": link_markdown(report, "report.html")}
    docs = next((p.links["data_docs"] for p in reversed(run.phases) if p.links.get("data_docs")), None)
    docs_link = report_link(storage, f"{report_dir(recipe, run.run)}/{docs}") if docs else None
    if docs_link is not None:
        # One Data Docs site per run lists every gate so far, so the latest link is enough.
        links["gate results (Great Expectations Data Docs)"] = link_markdown(docs_link, "data_docs/index.html")
    label = f"{key} audit report ({run.run})"
    items = [
        (
            f"{key}-summary",
            "markdown",
            f"{key}: the run, every phase, reasons, gates, plots",
            run_summary(run, samples, links, read_curation(storage, report_dir(recipe, run.run))),
        ),
        (
            f"{key}-reasons",
            "table",
            f"{key}: rows by reason, every phase",
            json.dumps(reason_rows(run) or [{"phase": "", "reason": "(none)", "rows": 0}]),
        ),
        (
            f"{key}-gates",
            "table",
            f"{key}: every gate check",
            json.dumps(gate_rows(run) or [{"phase": "", "check": "(none)"}]),
        ),
        (f"{key}-report", "markdown", "HTML audit report", link_markdown(report, label)),
    ]
    if docs_link is not None:
        items.append(
            (
                f"{key}-data-docs",
                "markdown",
                "Great Expectations Data Docs",
                link_markdown(docs_link, f"{key} gate results, Data Docs ({run.run})"),
            )
        )
    _upsert_artifacts(UUID(str(flow_run_id)), items)


def _upsert_artifacts(flow_run_id: UUID, items: list[tuple[str, str, str, str]]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
                key=ArtifactFilterKey(any_=[k for k, *_ in items]),
            )
        )
        ids = {a.key: a.id for a in found}
        for key, kind, description, data in items:
            if key in ids:
                client.update_artifact(ids[key], ArtifactUpdate(data=data, description=description))
            else:
                client.create_artifact(
                    ArtifactCreate(key=key, type=kind, description=description, data=data, flow_run_id=flow_run_id)
                )


def check_gate(
    storage: Storage, recipe: Recipe, run: RunRecord, gate: Any, samples: pa.Table | None = None, why: str = ""
) -> tuple[RunRecord, str]:
    """Publish the report; raise ``GateFailed`` if the gate failed (after the report is written).

    ``why`` is said with a failure, for people: what the phase saw (e.g. a manifest with no rows).
    Returns the record as published and the report's link.
    """
    if not gate.success:
        run = run.blocked_by(gate.failure_message() + (f" ({why})" if why else ""))
    run, url = publish(storage, recipe, run, samples)
    if not gate.success:
        raise GateFailed(f"{run.blocked}\nreport: {url}", run)
    return run, url
