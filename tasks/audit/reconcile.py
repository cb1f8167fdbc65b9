"""Reconciliation before a release: streaming tallies of ledgers and outputs, and the release gate."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from tasks.audit.changes import BOUNDS, Changes
from tasks.audit.gate_checks import Check
from tasks.audit.gate_results import GateResult, fmt_number
from tasks.audit.ge_runner import expectation_stats, import_gx, run_suites
from tasks.formats.reasons import OK, STATUSES

if TYPE_CHECKING:
    from tasks.formats.recipe_upkeep import UpkeepGate

# --- reconciliation before a release ----------------------------------------------------------


class Reconciliation:
    """Streaming tallies that reconcile ledgers with the manifest and the released outputs.

    Args:
        rows_in: manifest rows (every input row must end as exactly one ledger row).

    Feed it ledgers (``add_ledger``: key, source, row, status) and the released samples
    (``add_outputs``: source, row), one table at a time. Memory is one bit-sized flag per
    row and source (a byte, in numpy), not a set of keys: a million rows take about 2 MB.
    Row ids are dense within blocks of 2**30 (a folder source's files each have one, see
    tasks.formats.manifests.sample_key), so the flags are kept per source and block.
    """

    _EXAMPLES = 5

    def __init__(self, rows_in: int):
        import numpy as np

        self._np = np
        self.rows_in = int(rows_in)
        self.ledger_rows = 0
        self.status = {s: 0 for s in STATUSES}
        self.unknown_status = 0
        self.duplicates = 0
        self.outputs = 0
        self.duplicate_outputs = 0
        self.orphan_outputs = 0
        self._seen: dict[
            tuple[str, int], Any
        ] = {}  # (source, block) -> uint8 per row: 0 none, 1 not ok, 2 ok, 3 ok and released
        self.examples: dict[str, list[str]] = {
            "duplicates": [],
            "unknown_status": [],
            "orphan_outputs": [],
            "unreleased_ok": [],
            "duplicate_outputs": [],
        }

    def _flags(self, source: tuple[str, int], upto: int) -> Any:
        np = self._np
        flags = self._seen.get(source)
        if flags is None or len(flags) <= upto:
            grown = np.zeros(max(upto + 1, 2 * len(flags) if flags is not None else 1024), np.uint8)
            if flags is not None:
                grown[: len(flags)] = flags
            self._seen[source] = flags = grown
        return flags

    def _note(self, what: str, source: tuple[str, int], rows: Any) -> None:
        from tasks.formats.manifests import sample_key

        room = self._EXAMPLES - len(self.examples[what])
        if room > 0:
            name, block = source
            self.examples[what].extend(sample_key(name, (block << _BLOCK_BITS) | int(r)) for r in rows[:room])

    def add_ledger(self, table: pa.Table) -> None:
        """Count one ledger's rows (columns source, row, status)."""
        import pyarrow.compute as pc

        np = self._np
        self.ledger_rows += table.num_rows
        for source in pc.unique(table.column("source")).to_pylist():
            part = (
                table.filter(pc.equal(table.column("source"), source))
                if source is not None
                else table.filter(pc.is_null(table.column("source")))
            )
            source = source or ""
            # A row without a row id cannot be placed: counted as unaccounted, never indexed.
            nulls = pc.is_null(part.column("row"))
            if pc.any(nulls).as_py():
                self.unknown_status += int(pc.sum(nulls).as_py())
                part = part.filter(pc.invert(nulls))
            all_rows = part.column("row").to_numpy(zero_copy_only=False).astype(np.int64)
            all_status = part.column("status").to_numpy(zero_copy_only=False)
            for block, rows, pick in _blocks(np, all_rows):
                status = all_status[pick]
                flags = self._flags((source, block), int(rows.max()) if len(rows) else 0)
                repeat = _repeats(np, rows) | (flags[rows] != 0)  # within this table, or seen before
                self.duplicates += int(repeat.sum())
                self._note("duplicates", (source, block), rows[repeat])
                first = ~repeat
                known = np.isin(status, list(STATUSES))
                self.unknown_status += int((first & ~known).sum())
                self._note("unknown_status", (source, block), rows[first & ~known])
                for s in STATUSES:
                    self.status[s] += int((first & (status == s)).sum())
                flags[rows[first & known]] = np.where(status[first & known] == OK, 2, 1)

    def add_outputs(self, table: pa.Table) -> None:
        """Count released samples (columns source, row); each needs an ok ledger row."""
        import pyarrow.compute as pc

        np = self._np
        self.outputs += table.num_rows
        for source in pc.unique(table.column("source")).to_pylist():
            part = table.filter(pc.equal(table.column("source"), source))
            all_rows = part.column("row").to_numpy(zero_copy_only=False).astype(np.int64)
            for block, rows, _ in _blocks(np, all_rows):
                flags = self._flags((source, block), int(rows.max()) if len(rows) else 0)
                orphan = flags[rows] < 2
                again = (flags[rows] == 3) | _repeats(np, rows)
                self.orphan_outputs += int(orphan.sum())
                self.duplicate_outputs += int(again.sum())
                self._note("orphan_outputs", (source, block), rows[orphan])
                self._note("duplicate_outputs", (source, block), rows[again])
                flags[rows[~orphan]] = 3

    def summary(self) -> dict[str, Any]:
        """The tallies: rows in and accounted for, problems with up to five example keys each."""
        np = self._np
        unreleased = 0
        for source, flags in self._seen.items():
            lost = np.flatnonzero(flags == 2)
            unreleased += len(lost)
            self._note("unreleased_ok", source, lost)
        accounted = sum(self.status.values())
        return {
            "rows_in": self.rows_in,
            "ledger_rows": self.ledger_rows,
            "accounted": accounted,
            **self.status,
            "duplicates": self.duplicates,
            "unknown_status": self.unknown_status,
            "outputs": self.outputs,
            "orphan_outputs": self.orphan_outputs,
            "duplicate_outputs": self.duplicate_outputs,
            "unreleased_ok": unreleased if self.outputs or self.status[OK] else 0,
            "examples": {k: v for k, v in self.examples.items() if v},
        }


_BLOCK_BITS = 30


def _blocks(np: Any, rows: Any) -> Any:
    """(block, rows within the block, selection) per block of 2**30 row ids; one block for plain rows."""
    high = rows >> _BLOCK_BITS
    if not len(rows) or int(high.min()) == int(high.max()):
        yield (int(high[0]) if len(rows) else 0), rows & ((1 << _BLOCK_BITS) - 1), slice(None)
        return
    for block in np.unique(high):
        pick = high == block
        yield int(block), rows[pick] & ((1 << _BLOCK_BITS) - 1), pick


def _repeats(np: Any, rows: Any) -> Any:
    """True for every occurrence of a value after its first."""
    order = np.argsort(rows, kind="stable")
    repeat = np.zeros(len(rows), bool)
    repeat[order[1:]] = rows[order[1:]] == rows[order[:-1]]
    return repeat


def _tally(summary: dict[str, Any], name: str, of: str = "ledger_rows") -> Callable[[dict[str, Any]], Any]:
    """Observed value of a reconciliation check: the count, its base, and example keys."""
    return lambda _result: {
        "unexpected_count": summary[name],
        "element_count": summary[of],
        "examples": summary["examples"].get(name, []),
    }


def _none_of(name: str, threshold: str, summary: dict[str, Any], column: str, of: str = "ledger_rows") -> Check:
    """A reconciliation check that tally ``column`` is zero."""
    return Check(
        name,
        threshold,
        "ExpectColumnValuesToBeBetween",
        {"column": column, "min_value": 0, "max_value": 0},
        _tally(summary, column, of),
    )


def upkeep_checks(changes: Changes | None, bounds: UpkeepGate | None) -> tuple[dict[str, Any], list[Check]]:
    """gates.upkeep's bounds that are set, as checks on a one-row table of the change rates
    (``{category}_rate``: the share of the earlier release's released rows; None, which
    passes, for a first release)."""
    row: dict[str, Any] = {}
    checks = []
    for bound, category in BOUNDS.items():
        limit = getattr(bounds, bound, None) if bounds is not None else None
        if limit is None:
            continue
        column = f"{category}_rate"
        rate = changes.rate(category) if changes is not None else None
        row[column] = rate
        checks.append(
            Check(
                f"{category.replace('_', ' ')} rate <= {fmt_number(limit)} (gates.upkeep.{bound})",
                f"<= {fmt_number(limit)}",
                "ExpectColumnValuesToBeBetween",
                {"column": column, "min_value": 0, "max_value": limit},
                _observed(rate),
            )
        )
    return row, checks


def _observed(rate: float | None) -> Callable[[dict[str, Any]], Any]:
    """The observed value of a bound's check: the rate itself (GE's result of one row says less)."""
    return lambda _result: rate


UPKEEP_SUITE = "changes"
# The columns of gates.upkeep's checks: a failed one is a bound exceeded, not a ledger that does not add up.
UPKEEP_COLUMNS = frozenset(f"{category}_rate" for category in BOUNDS.values())


def release_gate(
    rec: Reconciliation,
    check_outputs: bool = True,
    changes: Changes | None = None,
    bounds: UpkeepGate | None = None,
) -> GateResult:
    """Reconcile before a release: rows in = ok + rejected + error, no duplicate rows, no
    output without an ok ledger row (and, with ``check_outputs``, no ok row without its output);
    and, where gates.upkeep (``bounds``) sets them, bound what changed since the last release
    (``changes``): a rate over its bound blocks the release like any failed check.

    The checks run as Great Expectations expectations on a one-row table of the tallies, so
    the gate costs the same for a thousand rows as for a million.
    """
    gx = import_gx()
    s = rec.summary()
    import pandas as pd

    frame = pd.DataFrame([{k: v for k, v in s.items() if k != "examples"}])
    checks = [
        Check(
            "rows in = ok + rejected + error",
            f"== {s['rows_in']} rows",
            "ExpectColumnValuesToBeBetween",
            {"column": "accounted", "min_value": s["rows_in"], "max_value": s["rows_in"]},
            lambda _r: s["accounted"],
        ),
        _none_of("no duplicate ledger rows", "0", s, "duplicates"),
        _none_of("every status ok, rejected or error", "0 others", s, "unknown_status"),
        _none_of("no output without a ledger row", "0", s, "orphan_outputs", "outputs"),
        _none_of("no output twice", "0", s, "duplicate_outputs", "outputs"),
    ]
    if check_outputs:
        checks.append(_none_of("every ok row released", "0 missing", s, "unreleased_ok", "ok"))
    suites = [("reconciliation", frame, checks)]
    rates, bounded = upkeep_checks(changes, bounds)
    if bounded:
        # A column of Nones (no earlier release) is object-typed; GE's between needs numbers.
        suites.append((UPKEEP_SUITE, pd.DataFrame([rates], dtype="float64"), bounded))
    outcomes, validations = run_suites(gx, "release", suites)
    stats = {
        **{k: v for k, v in s.items() if k != "examples"},
        "examples": s["examples"],
        "expectations": expectation_stats(outcomes),
    }
    if changes is not None:
        stats["changes"] = changes.summary()
    return GateResult.of_suites("release", outcomes, validations, stats)
