"""A ledger's rows tallied for a run record: by source, by license, reasons by family."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from tasks.formats.reasons import family

if TYPE_CHECKING:
    import pyarrow as pa


def by_source(ledger: pa.Table) -> dict[str, dict[str, int]]:
    """Rows and their statuses per source, sources in name order."""
    out: dict[str, Counter[str]] = {}
    for source, status in zip(ledger.column("source").to_pylist(), ledger.column("status").to_pylist()):
        c = out.setdefault(source, Counter())
        c["rows"] += 1
        c[status] += 1
    return {s: {k: c.get(k, 0) for k in ("rows", "ok", "rejected", "error")} for s, c in sorted(out.items())}


def by_license(ledger: pa.Table) -> dict[str, int]:
    """Accepted rows per license (``(none)`` without one), most first; empty without the column."""
    if "license" not in ledger.column_names:
        return {}
    c = Counter(
        lic or "(none)"
        for lic, st in zip(ledger.column("license").to_pylist(), ledger.column("status").to_pylist())
        if st == "ok"
    )
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def by_family(by_reason: dict[str, int] | None) -> dict[str, int]:
    """Rows by reason family (``duplicate_of:<key>`` counts once as ``duplicate_of``), largest
    first; families of equal size in the order they first appear."""
    c: Counter[str] = Counter()
    for reason, n in (by_reason or {}).items():
        c[family(reason)] += n
    return dict(c.most_common())
