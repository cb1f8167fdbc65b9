"""What a gate returns: one outcome per expectation and the gate's result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Not a GE expectation type: the license review is a fact about the recipe, not about the data.
LICENSE_REVIEW = "shardsmith_license_review_recorded"


def fmt_number(x: float) -> str:
    return f"{x:g}"


def observed_text(observed: Any) -> str:
    """An outcome's observed value for people: ``0.31``, ``2 of 10 rows unexpected, e.g. web-000000002``."""
    if observed is None:
        return "n/a, no rows"
    if isinstance(observed, dict) and "unexpected_count" in observed:
        text = f"{observed['unexpected_count']:,} of {observed['element_count']:,} rows unexpected"
        if observed.get("examples"):
            text += ", e.g. " + ", ".join(str(v) for v in observed["examples"])
        return text
    if isinstance(observed, dict) and "error" in observed:
        return f"error: {observed['error']}"
    if isinstance(observed, float):
        return fmt_number(observed)
    return str(observed)


@dataclass
class ExpectationOutcome:
    """One checked expectation of a gate.

    Args:
        name: readable name, e.g. ``success rate >= 0.5``; unique within a gate.
        expectation: GE expectation type (``expect_column_values_to_be_in_set``), or
            ``shardsmith_license_review_recorded`` for the one check that is not on data.
        column: the column checked; ``None`` for table-level checks.
        threshold: the bound, for people (``>= 0.5``, ``== 100 rows``).
        observed: what was seen, JSON-able: a rate, a row count, or for per-row checks
            ``{"unexpected_count", "element_count", "examples"}``; ``None`` when there are no
            rows to measure.
        success: whether the expectation held.
    """

    name: str
    expectation: str
    column: str | None
    threshold: str
    observed: Any
    success: bool

    def describe(self) -> str:
        """``name (observed X)``, with the threshold added when the name does not carry it."""
        head = self.name if self.threshold in self.name else f"{self.name}, expected {self.threshold}"
        return f"{head} (observed {observed_text(self.observed)})"


@dataclass
class GateResult:
    """The verdict of one phase's gate.

    Args:
        phase: ``download``, ``validate``, ...
        success: every outcome succeeded.
        outcomes: one per check, in the gate's fixed order.
        statistics: ledger counts (rows, ok, rejected, error, by_reason, ...) and the number
            of expectations evaluated / successful / unsuccessful.
        ge_result: ``{"validations": [...]}``, the GE ``ExpectationSuiteValidationResult`` JSON
            of every table the gate validated (one suite per table).
    """

    phase: str
    success: bool
    outcomes: list[ExpectationOutcome]
    statistics: dict[str, Any]
    ge_result: dict[str, Any] = field(repr=False)

    @classmethod
    def of_suites(
        cls,
        phase: str,
        outcomes: list[ExpectationOutcome],
        validations: list[dict[str, Any]],
        statistics: dict[str, Any],
    ) -> GateResult:
        """The result of a gate whose checks ran as GE suites: it passes when every outcome did."""
        return cls(
            phase=phase,
            success=all(o.success for o in outcomes),
            outcomes=outcomes,
            statistics=statistics,
            ge_result={"validations": validations},
        )

    @property
    def failed(self) -> list[ExpectationOutcome]:
        return [o for o in self.outcomes if not o.success]

    def failure_message(self) -> str:
        """Every failed check with its threshold and observed value; empty when the gate passed."""
        if self.success:
            return ""
        return f"{self.phase} gate failed: " + "; ".join(o.describe() for o in self.failed)

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "success": self.success,
            "message": self.failure_message(),
            "outcomes": [asdict(o) for o in self.outcomes],
            "statistics": self.statistics,
            "ge_result": self.ge_result,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GateResult:
        return cls(
            phase=data["phase"],
            success=bool(data["success"]),
            outcomes=[ExpectationOutcome(**o) for o in data["outcomes"]],
            statistics=dict(data["statistics"]),
            ge_result=dict(data["ge_result"]),
        )
