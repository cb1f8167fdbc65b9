"""What changed between two releases: rows recovered, newly failed, dead, changed, opted out, taken down, added, removed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.formats.reasons import FAMILIES, OK, UPKEEP_REASONS
from tasks.formats.storage import Storage

# The categories in the order every view shows them, with what each means for people.
CATEGORIES: dict[str, str] = {
    "recovered": "not released before, released now (a retried fetch that succeeded, a relaxed policy)",
    "newly_failed": "released before, failed or rejected now for a reason other than upkeep",
    "dead": "released before, newly link_dead (dropped, or kept and reported)",
    "changed": "released before, newly content_changed (dropped, or kept and reported)",
    "opted_out": "released before, newly opted_out (dropped, or kept and reported)",
    "taken_down": "released before, newly taken_down by a takedown list",
    "added": "rows the earlier release's ledger did not have, released now",
    "removed": "released before, not released now, for any reason",
}
# The categories that are one upkeep reason: a row counts when the reason is new to it.
UPKEEP_CATEGORIES = {
    "dead": "link_dead",
    "changed": "content_changed",
    "opted_out": "opted_out",
    "taken_down": "taken_down",
}
# gates.upkeep's bounds (tasks/formats/recipe_upkeep.UpkeepGate), by the category each bounds.
BOUNDS = {
    "max_dead_rate": "dead",
    "max_changed_rate": "changed",
    "max_opted_out_rate": "opted_out",
    "max_taken_down_rate": "taken_down",
    "max_removed_rate": "removed",
}
NOT_IN_MANIFEST = "not_in_manifest"  # a removed row the new ledger does not have at all
EXAMPLES = 10
_DETAIL_CHARS = 300  # a takedown entry or what a recheck saw; run.json keeps them short
# Reasons with a payload after the colon (duplicate_of:<key>) are counted under their family.
_FAMILY = "^(" + "|".join(p[:-1] for p in FAMILIES if p.endswith(":")) + "):.*$"
_COLUMNS = ("key", "source", "row", "status", "reason")
_OPTIONAL = ("upkeep", "detail")


@dataclass(frozen=True)
class Category:
    """The rows of one kind of change.

    Args:
        count: rows in it.
        rate: ``count`` as a share of the earlier release's released rows (None without one).
        by_reason: rows per reason family, largest first: the reason they had before for
            ``recovered``, the one they have now for the others (``not_in_manifest`` for a
            removed row the new ledger lacks); empty for ``added``.
        examples: up to ``EXAMPLES`` rows, the first keys in key order: ``{"key", "reason", "detail"}``,
            plus ``"kept": true`` for an upkeep row that stays released.
        kept: of an upkeep category, the rows that stay released (the recipe's action is
            ``keep``); None for the other categories.
    """

    count: int = 0
    rate: float | None = None
    by_reason: dict[str, int] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    kept: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"count": self.count, "rate": self.rate, "by_reason": self.by_reason}
        out["examples"] = self.examples
        if self.kept is not None:
            out["kept"] = self.kept
        return out


@dataclass(frozen=True)
class Changes:
    """What changed from one release's ledger to the next, row by row (matched by source and row).

    Args:
        since: the earlier release's version (None: a first release, nothing to compare with).
        released_before: rows the earlier release released (the base of every rate).
        released_now: rows the new ledger releases.
        categories: one ``Category`` per name of ``CATEGORIES``, in that order.
    """

    since: str | None
    released_before: int
    released_now: int
    categories: dict[str, Category]

    @property
    def counts(self) -> dict[str, int]:
        return {name: c.count for name, c in self.categories.items()}

    @property
    def any(self) -> bool:
        """Whether a row changed at all."""
        return any(self.counts.values())

    def rate(self, name: str) -> float | None:
        return self.categories[name].rate

    def summary(self) -> dict[str, Any]:
        """The counts, as index.json and the gate's statistics record them."""
        return {"since": self.since, "released_before": self.released_before, **self.counts}

    def to_json(self) -> dict[str, Any]:
        """Everything, as run.json holds it (the report's section is drawn from it)."""
        return {
            "since": self.since,
            "released_before": self.released_before,
            "released_now": self.released_now,
            "categories": {name: c.to_json() for name, c in self.categories.items()},
        }

    def text(self) -> str:
        """One line for logs, failure messages and alerts: ``changes since v0003: 2 recovered, 5 dead (3 kept)``."""
        return changes_text(self.to_json())


def changes_text(data: dict[str, Any]) -> str:
    """``Changes.text`` of the JSON form (run.json's ``changes``)."""
    parts = []
    for name, c in (data.get("categories") or {}).items():
        n = _int(c.get("count")) if isinstance(c, dict) else 0
        if n:
            kept = f" ({c['kept']:,} kept)" if c.get("kept") else ""
            parts.append(f"{n:,} {name.replace('_', ' ')}{kept}")
    since = data.get("since")
    head = f"changes since {since}" if since else "changes"
    return f"{head}: {', '.join(parts) if parts else 'none'}"


def changes(
    previous: pa.Table | None, current: pa.Table, since: str | None = None, examples: int = EXAMPLES
) -> Changes:
    """What changed from the release ledger ``previous`` to ``current`` (columns key, source,
    row, status, reason; ``upkeep`` and ``detail`` where they are). ``since`` names the earlier
    release. Without ``previous`` (a first release) every released row is ``added`` and there
    are no rates.

    Rows are matched by (source, row) with one hash join, and every category is a boolean mask
    over the ledgers, so a release of millions of rows takes seconds, not a Python loop.
    """
    cur = _Ledger.of(current)
    prev = _Ledger.of(previous) if previous is not None else _Ledger.of(current.slice(0, 0))
    to_prev, to_cur = _match(cur, prev)
    matched = to_prev >= 0
    base = int(prev.ok.sum())

    was_ok = np.zeros(cur.n, bool)
    was_ok[matched] = prev.ok[to_prev[matched]]
    masks: dict[str, np.ndarray] = {
        "recovered": matched & ~was_ok & cur.ok,
        "newly_failed": was_ok & ~cur.ok & ~_is_in(cur.reason, UPKEEP_REASONS),
    }
    before_upkeep = prev.upkeep.take(pa.array(np.where(matched, to_prev, 0))) if prev.n else None
    kept: dict[str, int] = {}
    for name, reason in UPKEEP_CATEGORIES.items():
        dropped = ~cur.ok & _equal(cur.reason, reason)
        flagged = cur.ok & _equal(cur.upkeep, reason)
        already = _equal(before_upkeep, reason) & matched if before_upkeep is not None else np.zeros(cur.n, bool)
        masks[name] = was_ok & (dropped | flagged) & ~already
        kept[name] = int((masks[name] & cur.ok).sum())
    masks["added"] = ~matched & cur.ok
    ok_now = np.zeros(prev.n, bool)  # per previous row: released by the new ledger
    ok_now[to_cur >= 0] = cur.ok[to_cur[to_cur >= 0]]
    removed = prev.ok & ~ok_now

    def rate(n: int) -> float | None:
        return round(n / base, 6) if previous is not None and base else None

    out: dict[str, Category] = {}
    for name in CATEGORIES:
        if name == "removed":
            # Shown as the new ledger has them (its reason and detail), keyed as they were released.
            at = pa.array(np.maximum(to_cur, 0))
            present = pa.array(to_cur >= 0)
            details = pc.if_else(present, cur.detail.take(at), None) if cur.n else pa.nulls(prev.n, pa.string())
            why = _removed_reasons(cur, prev, to_cur)
            out[name] = _category(removed, prev.key, why, details, None, None, examples, rate)
            continue
        if name == "recovered":
            why = prev.reason.take(pa.array(np.where(matched, to_prev, 0))) if prev.n else cur.reason
        else:
            why = pc.if_else(pa.array(cur.ok), cur.upkeep, cur.reason)  # a kept row's reason is its upkeep
        out[name] = _category(masks[name], cur.key, why, cur.detail, cur.ok, kept.get(name), examples, rate)
    return Changes(since, base if previous is not None else 0, int(cur.ok.sum()), out)


@dataclass(frozen=True)
class _Ledger:
    """A release ledger's columns, each one contiguous array; ``ok`` as a numpy mask."""

    n: int
    key: pa.Array
    source: pa.Array
    row: pa.Array
    status: pa.Array
    ok: np.ndarray
    reason: pa.Array
    upkeep: pa.Array
    detail: pa.Array

    @classmethod
    def of(cls, table: pa.Table) -> _Ledger:
        def column(name: str) -> pa.Array:
            if name not in table.column_names:
                return pa.nulls(table.num_rows, pa.string())
            col = table.column(name).combine_chunks()
            return col.cast(pa.int64() if name == "row" else pa.string())

        status = column("status")
        ok = pc.fill_null(pc.equal(status, OK), False).to_numpy(zero_copy_only=False)
        return cls(
            table.num_rows,
            column("key"),
            column("source"),
            column("row"),
            status,
            np.asarray(ok, bool),
            column("reason"),
            column("upkeep"),
            column("detail"),
        )


def _match(cur: _Ledger, prev: _Ledger) -> tuple[np.ndarray, np.ndarray]:
    """(for each current row its previous row, for each previous row its current row); -1 for none."""
    to_prev = np.full(cur.n, -1, np.int64)
    to_cur = np.full(prev.n, -1, np.int64)
    if not cur.n or not prev.n:
        return to_prev, to_cur
    left = pa.table({"source": cur.source, "row": cur.row, "ci": pa.array(np.arange(cur.n, dtype=np.int64))})
    right = pa.table({"source": prev.source, "row": prev.row, "pi": pa.array(np.arange(prev.n, dtype=np.int64))})
    pairs = left.join(right, keys=["source", "row"], join_type="inner")  # nulls never match
    ci = pairs.column("ci").to_numpy()
    pi = pairs.column("pi").to_numpy()
    to_prev[ci] = pi
    to_cur[pi] = ci
    return to_prev, to_cur


def _equal(values: pa.Array, value: str) -> np.ndarray:
    return np.asarray(pc.fill_null(pc.equal(values, value), False).to_numpy(zero_copy_only=False), bool)


def _is_in(values: pa.Array, options: tuple[str, ...]) -> np.ndarray:
    mask = pc.is_in(values, value_set=pa.array(list(options), pa.string()))
    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), bool)


def _removed_reasons(cur: _Ledger, prev: _Ledger, to_cur: np.ndarray) -> pa.Array:
    """Per previous row: the reason it has now (its status where it has none), or ``not_in_manifest``."""
    if not cur.n:
        return pa.array([NOT_IN_MANIFEST] * prev.n, pa.string())
    at = pa.array(np.maximum(to_cur, 0))
    now = pc.coalesce(cur.reason.take(at), cur.status.take(at))
    return pc.if_else(pa.array(to_cur >= 0), now, NOT_IN_MANIFEST)


def _category(
    mask: np.ndarray,
    keys: pa.Array,
    reasons: pa.Array,
    details: pa.Array,
    ok: np.ndarray | None,
    kept: int | None,
    examples: int,
    rate: Any,
) -> Category:
    """The rows under ``mask``: count, rate, reasons by family, the first examples (an upkeep
    row marked kept where ``ok`` says it stays released)."""
    count = int(mask.sum())
    if not count:
        return Category(0, rate(0), {}, [], kept)
    families = pc.replace_substring_regex(reasons.filter(pa.array(mask)), pattern=_FAMILY, replacement=r"\1")
    tally = pc.value_counts(families.drop_null()).to_pylist()
    by_reason = dict(sorted(((t["values"], int(t["counts"])) for t in tally), key=lambda kv: (-kv[1], kv[0])))
    picked = np.flatnonzero(mask)  # the examples: the first keys in key order, so a diff reads in order
    first = picked[pc.sort_indices(keys.take(pa.array(picked))).to_numpy()[:examples]]
    at = pa.array(first)
    shown = []
    for i, key, reason, detail in zip(
        first, keys.take(at).to_pylist(), reasons.take(at).to_pylist(), details.take(at).to_pylist()
    ):
        example: dict[str, Any] = {"key": key, "reason": reason, "detail": _short(detail)}
        if kept is not None and ok is not None and ok[i]:
            example["kept"] = True
        shown.append(example)
    return Category(count, rate(count), by_reason, shown, kept)


def _short(text: str | None) -> str | None:
    if text is None or len(text) <= _DETAIL_CHARS:
        return text
    return text[: _DETAIL_CHARS - 3] + "..."


# --- releases in storage -----------------------------------------------------------------------


def read_release_ledger(storage: Storage, dataset: str, version: str) -> pa.Table:
    """A release's ledger.parquet, the columns ``changes`` reads (``upkeep`` and ``detail`` only
    where the release has them: a release without upkeep has neither)."""
    from tasks.stages.release import releases_dir

    with storage.open(f"{releases_dir(dataset)}/{version}/ledger.parquet", "rb") as fh:
        pf = pq.ParquetFile(fh, pre_buffer=False)
        names = set(pf.schema_arrow.names)
        return pf.read(columns=[c for c in (*_COLUMNS, *_OPTIONAL) if c in names], use_threads=False)


def since_release(storage: Storage, dataset: str, previous: str | None, ledger: pa.Table) -> Changes | None:
    """What ``ledger`` (a new release's) changes since the release ``previous``; None for a first
    release, or where the earlier release's ledger is gone (nothing to compare with)."""
    if previous is None:
        return None
    try:
        before = read_release_ledger(storage, dataset, previous)
    except FileNotFoundError:
        return None
    return changes(before, ledger, since=previous)


def between(storage: Storage, dataset: str, a: str, b: str) -> Changes | None:
    """What changed from release ``a`` to release ``b`` (committed versions, as ``shardsmith
    diff`` names them after ``tasks.stages.release.read_index``); None where a ledger has no
    source and row to match rows by."""
    before, after = read_release_ledger(storage, dataset, a), read_release_ledger(storage, dataset, b)
    if not all({"source", "row", "status"} <= set(t.column_names) for t in (before, after)):
        return None
    return changes(before, after, since=a)


# --- the report's section ----------------------------------------------------------------------

LABELS = {
    "recovered": "recovered",
    "newly_failed": "newly failed",
    "dead": "dead links",
    "changed": "changed content",
    "opted_out": "opted out",
    "taken_down": "taken down",
    "added": "added",
    "removed": "removed",
}


def changes_view(data: Any) -> dict[str, Any] | None:
    """The report's "Changes since the last release" section, from run.json's ``changes``
    (``Changes.to_json``); None where the run compared no releases. Values are left as data:
    the template escapes them (keys and details come from manifests and takedown lists)."""
    if not isinstance(data, dict) or not isinstance(data.get("categories"), dict):
        return None
    before = _int(data.get("released_before"))
    rows = []
    for name, label in LABELS.items():
        c = data["categories"].get(name)
        if not isinstance(c, dict):
            continue
        count = _int(c.get("count"))
        rate = c.get("rate")
        by_reason = c["by_reason"] if isinstance(c.get("by_reason"), dict) else {}
        examples = [e for e in c.get("examples") or [] if isinstance(e, dict)]
        rows.append(
            {
                "name": name,
                "label": label,
                "desc": CATEGORIES[name],
                "count": count,
                "share": f"{100.0 * rate:.2f}%" if isinstance(rate, (int, float)) else "n/a",
                "kept": _int(c["kept"]) if c.get("kept") is not None else None,
                "reasons": [(str(r), _int(n)) for r, n in by_reason.items()],
                "examples": [
                    {
                        "key": str(e.get("key")),
                        "reason": e.get("reason") or "",
                        "detail": e.get("detail") or "",
                        "kept": bool(e.get("kept")),
                    }
                    for e in examples
                ],
            }
        )
    return {
        "since": data.get("since"),
        "released_before": before,
        "released_now": _int(data.get("released_now")),
        "rows": rows,
        "any": any(r["count"] for r in rows),
        "text": changes_text(data),
    }


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
