"""The check DSL of the gates: one expectation, how to read its result, shared key checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.formats.reasons import STATUSES

_EXAMPLES = 5  # unexpected values kept per outcome

# --- checks -----------------------------------------------------------------------------------


@dataclass
class Check:
    """A GE expectation with our readable name, threshold text and how to read its result."""

    name: str
    threshold: str
    expectation: str  # class name in gx.expectations
    kwargs: dict[str, Any]
    observe: Callable[[dict[str, Any]], Any]

    def build(self, gx: Any) -> Any:
        meta = {"gate_check": self.name, "threshold": self.threshold}
        # GE renders the description in Data Docs in place of its own sentence.
        return getattr(gx.expectations, self.expectation)(**self.kwargs, description=self.name, meta=meta)


def check_count(result: dict[str, Any]) -> Any:
    return result.get("observed_value")


def check_rows(result: dict[str, Any]) -> Any:
    if not result.get("element_count"):
        return None
    examples: list[Any] = []
    for value in result.get("partial_unexpected_list") or []:
        if value is not None and value not in examples and len(examples) < _EXAMPLES:
            examples.append(value)
    return {
        "unexpected_count": result.get("unexpected_count", 0),
        "element_count": result["element_count"],
        "examples": examples,
    }


def share_unexpected(result: dict[str, Any]) -> Any:
    # unexpected_percent is over non-null values (GE skips nulls in map expectations).
    pct = result.get("unexpected_percent")
    return None if pct is None else round(pct / 100.0, 6)


def share_expected(result: dict[str, Any]) -> Any:
    pct = result.get("unexpected_percent")
    return None if pct is None else round(1.0 - pct / 100.0, 6)


def mostly_of(share: float) -> float:
    # 1 - 0.7 is 0.30000000000000004, which a rate of exactly 0.3 would miss.
    return min(1.0, max(0.0, round(share, 9)))


def all_true(name: str, column: str, observe: Callable[[dict[str, Any]], Any]) -> Check:
    """A check that every value of the boolean ``column`` is True (threshold "all")."""
    return Check(name, "all", "ExpectColumnValuesToBeInSet", {"column": column, "value_set": [True]}, observe)


def key_checks(prefix: str = "") -> list[Check]:
    """The core ledger columns: at least one row, keys present and unique, statuses known."""
    statuses = ", ".join(STATUSES)
    return [
        Check(f"{prefix}row count >= 1", ">= 1", "ExpectTableRowCountToBeBetween", {"min_value": 1}, check_count),
        Check(f"{prefix}key not null", "no nulls", "ExpectColumnValuesToNotBeNull", {"column": "key"}, check_rows),
        Check(f"{prefix}key unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, check_rows),
        Check(
            f"{prefix}status not null", "no nulls", "ExpectColumnValuesToNotBeNull", {"column": "status"}, check_rows
        ),
        Check(
            f"{prefix}status in {statuses}",
            f"in {statuses}",
            "ExpectColumnValuesToBeInSet",
            {"column": "status", "value_set": list(STATUSES)},
            check_rows,
        ),
    ]


def shown_check(what: str, column: str, limit: float) -> Check:
    """Released samples with what the privacy checks found left in (``column`` True), share <= ``limit``."""
    from tasks.audit.gate_results import fmt_number

    rate = fmt_number(limit)
    return Check(
        f"{what} rate <= {rate}",
        f"<= {rate}",
        "ExpectColumnValuesToBeInSet",
        {"column": column, "value_set": [False], "mostly": mostly_of(1.0 - limit)},
        share_unexpected,
    )


def reason_share_check(reason: str, limit: float, word: str = "share") -> Check:
    """A check that rows of the reason family ``reason`` are at most ``limit`` of all rows
    (named ``{reason} {word} <= {limit}``)."""
    from tasks.audit.gate_results import fmt_number

    return Check(
        f"{reason} {word} <= {fmt_number(limit)}",
        f"<= {fmt_number(limit)}",
        "ExpectColumnValuesToNotBeInSet",
        {"column": "reason", "value_set": [reason], "mostly": mostly_of(1.0 - limit)},
        share_unexpected,
    )
