"""The run record (what one pipeline run records: phases, counts, gates, links, release) and its summary rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

# The keys of a phase's entry in run.json, and those written only when the phase records them.
_PHASE_KEYS: tuple[str, ...] = ("phase", "rows", "ok", "rejected", "error", "by_reason", "by_source", "by_license")
_PHASE_KEYS += ("seconds", "samples_per_s", "gate", "links")
_OPTIONAL_PHASE_KEYS = ("packing", "timings")
# The keys of run.json besides its phases and release.
_RUN_KEYS = ("dataset", "run", "recipe_hash", "storage", "started", "finished", "blocked", "flow_run_id")


@dataclass(frozen=True)
class PhaseRecord:
    """One phase's entry in the run record.

    Args:
        phase: the phase's name (``download``, ``validate`` ...).
        rows, ok, rejected, error: ledger rows in, and by status.
        by_reason: rows by reason, as the ledgers name them.
        by_source: per source, its rows and their statuses.
        by_license: accepted rows per license.
        seconds: wall seconds of the phase.
        samples_per_s: samples per second of the work done now (skipped shards not counted).
        gate: the gate's outcome (``GateResult.to_json`` less the full Great Expectations
            result, which is in ``gates/{phase}.json``), or None.
        links: the phase's report files by name, relative to the report's folder.
        shards: the phase's output shards (default None: not known). Not written to run.json,
            whose format the releases made so far hold.
        packing: fine-tuning's packing statistics (default None: not recorded).
        timings: precache's seconds per step (default None: not recorded).
        skipped: every shard of the phase was done by an earlier run, so it did nothing now and
            its rate says nothing (default False; run.json holds it only when True).
    """

    phase: str
    rows: int = 0
    ok: int = 0
    rejected: int = 0
    error: int = 0
    by_reason: Mapping[str, int] = field(default_factory=dict)
    by_source: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    by_license: Mapping[str, int] = field(default_factory=dict)
    seconds: float | None = None
    samples_per_s: float | None = None
    gate: Mapping[str, Any] | None = None
    links: Mapping[str, str] = field(default_factory=dict)
    shards: int | None = None
    packing: Mapping[str, Any] | None = None
    timings: Mapping[str, float] | None = None
    skipped: bool = False

    def to_json(self) -> dict[str, Any]:
        """The entry as run.json holds it (``shards`` is not in it)."""
        out = {key: getattr(self, key) for key in _PHASE_KEYS}
        out.update({key: getattr(self, key) for key in _OPTIONAL_PHASE_KEYS if getattr(self, key) is not None})
        if self.skipped:
            out["skipped"] = True
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PhaseRecord:
        """An entry read back from run.json; what is missing or of the wrong type reads as empty."""
        return cls(
            phase=str(data.get("phase", "")),
            rows=_int(data.get("rows")),
            ok=_int(data.get("ok")),
            rejected=_int(data.get("rejected")),
            error=_int(data.get("error")),
            by_reason=_mapping(data.get("by_reason")),
            by_source=_mapping(data.get("by_source")),
            by_license=_mapping(data.get("by_license")),
            seconds=_number(data.get("seconds")),
            samples_per_s=_number(data.get("samples_per_s")),
            gate=data["gate"] if isinstance(data.get("gate"), Mapping) else None,
            links=_mapping(data.get("links")),
            packing=data["packing"] if isinstance(data.get("packing"), Mapping) else None,
            timings=data["timings"] if isinstance(data.get("timings"), Mapping) else None,
            skipped=data.get("skipped") is True,
        )


@dataclass(frozen=True)
class ReleaseRecord:
    """The release a run made or found.

    Args:
        version: ``vNNNN``.
        created: False when the latest release already had the run's content.
        path: where a new release is (default None: an unchanged one records no path).
    """

    version: str
    created: bool
    path: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "created": self.created}
        if self.path is not None:
            out["path"] = self.path
        return out


@dataclass(frozen=True)
class RunRecord:
    """What one pipeline run records; each step makes a new record (the flows pass it on).

    Args:
        dataset, run: the dataset and the run's id (names the report folder).
        recipe_hash: the recipe's hash.
        storage: the storage root.
        started: when the run started (ISO 8601, UTC).
        finished: when its report was last published (default None: not yet).
        phases: each phase's entry, in the order they ran (default none).
        blocked: why the run stopped before a release (default None: it did not).
        flow_run_id: the flow run a user started, which carries the run's artifacts (default None).
        release: the release it made or found (default None: not that far).
        changes: what its release changes since the one before
            (``tasks.audit.changes.Changes.to_json``; default None: none compared).
    """

    dataset: str
    run: str
    recipe_hash: str
    storage: str
    started: str
    finished: str | None = None
    phases: tuple[PhaseRecord, ...] = ()
    blocked: str | None = None
    flow_run_id: str | None = None
    release: ReleaseRecord | None = None
    changes: Mapping[str, Any] | None = None

    def with_phase(self, phase: PhaseRecord) -> RunRecord:
        return replace(self, phases=(*self.phases, phase))

    def finished_at(self, when: str) -> RunRecord:
        return replace(self, finished=when)

    def blocked_by(self, why: str) -> RunRecord:
        return replace(self, blocked=why)

    def with_release(self, release: ReleaseRecord) -> RunRecord:
        return replace(self, release=release)

    def with_changes(self, changes: Mapping[str, Any]) -> RunRecord:
        return replace(self, changes=changes)

    def to_json(self) -> dict[str, Any]:
        """The record as run.json holds it (``release`` and ``changes`` only once there are some)."""
        out = {key: getattr(self, key) for key in _RUN_KEYS}
        out["phases"] = [p.to_json() for p in self.phases]
        if self.release is not None:
            out["release"] = self.release.to_json()
        if self.changes is not None:
            out["changes"] = dict(self.changes)
        return out


# What renderers take: the record itself, or run.json read back (possibly old or hand-edited).
RunView: TypeAlias = RunRecord | Mapping[str, Any]


def run_json(run: RunView) -> Mapping[str, Any]:
    """The record as run.json holds it, whichever form ``run`` is in."""
    return run.to_json() if isinstance(run, RunRecord) else run


def phase_records(run: RunView) -> list[PhaseRecord]:
    """The run's phases, typed (entries of run.json that are not objects are left out)."""
    if isinstance(run, RunRecord):
        return list(run.phases)
    return [PhaseRecord.from_json(p) for p in run.get("phases") or [] if isinstance(p, Mapping)]


@dataclass(frozen=True)
class SummaryRow:
    """One phase of a run as every summary shows it (terminal, text report, markdown, nightly).

    Args:
        phase: the phase's name.
        shards: its output shards, or None where the record does not say (run.json read back).
        rows, ok, rejected, error: ledger rows in, and by status.
        samples_per_s: samples per second of the work done now, or None.
        gate: ``PASS``, ``FAIL``, ``none`` (no gate recorded), or ``not yet`` where a summary
            is written before its gate is judged.
        seconds: wall seconds, or None.
        skipped: the phase did nothing now (every shard done before): no rate to show
            (default False).
    """

    phase: str
    shards: int | None
    rows: int
    ok: int
    rejected: int
    error: int
    samples_per_s: float | None
    gate: str
    seconds: float | None
    skipped: bool = False


def summary_rows(run: RunView) -> list[SummaryRow]:
    """One row per phase of the run, in the order they ran."""
    return [summary_row(p) for p in phase_records(run)]


def summary_row(p: PhaseRecord) -> SummaryRow:
    """A phase's summary row."""
    counts = (p.rows, p.ok, p.rejected, p.error)
    return SummaryRow(p.phase, p.shards, *counts, p.samples_per_s, gate_word(p.gate), p.seconds, p.skipped)


def gate_word(gate: Mapping[str, Any] | None) -> str:
    """``PASS``, ``FAIL``, or ``none`` where the phase recorded no gate."""
    if not isinstance(gate, Mapping):
        return "none"
    return "PASS" if gate.get("success") else "FAIL"


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _number(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


# The columns of a summary row in a table, and the cells of one row (numbers for people;
# "-" where the record does not say; "skipped" for the rate of a phase that did nothing now).
# Markdown tables escape the cells themselves.
SUMMARY_COLUMNS = ("phase", "rows", "ok", "rejected", "error", "shards", "seconds", "samples/s", "gate")
SKIPPED = "skipped"


def row_cells(row: SummaryRow) -> list[str]:
    """A summary row's cells, in ``SUMMARY_COLUMNS`` order."""
    from tasks.audit.report_views import fmt_int, fmt_num

    def maybe(x: float | None) -> str:
        return "-" if x is None else fmt_num(x)

    counts = [fmt_int(n) for n in (row.rows, row.ok, row.rejected, row.error)]
    rate = SKIPPED if row.skipped else maybe(row.samples_per_s)
    return [row.phase, *counts, maybe(row.shards), maybe(row.seconds), rate, row.gate]


def row_text(row: SummaryRow) -> str:
    """A summary row as one line of text (the terminal, `shardsmith report`)."""
    from tasks.audit.report_views import fmt_int, fmt_num

    detail = [f"{fmt_int(row.shards)} shards"] if row.shards is not None else []
    if row.seconds is not None:
        detail.append(f"{fmt_num(row.seconds)} s")
    if row.skipped:
        detail.append(SKIPPED)
    elif row.samples_per_s is not None:
        detail.append(f"{fmt_num(row.samples_per_s)} samples/s")
    detail.append(f"gate {row.gate}")
    return (
        f"{row.phase}: {fmt_int(row.rows)} rows, {fmt_int(row.ok)} ok, {fmt_int(row.rejected)} rejected, "
        f"{fmt_int(row.error)} error ({', '.join(detail)})"
    )
