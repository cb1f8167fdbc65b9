"""The tables of a pretraining release: where each released sample is, and every manifest row's final fate."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats.ledger import read_ledger_with
from tasks.formats.storage import Storage

LEDGER_COLUMNS = ["key", "source", "row", "status", "reason"]
_EMPTY_SAMPLES = pa.schema(
    [("key", pa.string()), ("source", pa.string()), ("row", pa.int64()), ("offset", pa.int64())]
    + [("length", pa.int64()), ("video", pa.string()), ("shard", pa.string())]
)


def one_per_row(table: pa.Table) -> pa.Table:
    """One row per input row: a video's clips (rows with a ``video``, which share their video's
    row) become their video's one fate, under its key: ok when any clip is ok, else the first
    clip's reason (a table without ``status``, released samples, is all ok). Rows without a
    ``video`` are left as they are."""
    if "video" not in table.column_names:
        return table
    clips = pc.is_valid(table.column("video"))
    if not pc.any(clips).as_py():
        return table
    rest, part = table.filter(pc.invert(clips)), table.filter(clips)
    refused = (
        part.column("status").to_numpy(zero_copy_only=False) != "ok"
        if "status" in part.column_names
        else np.zeros(part.num_rows, bool)
    )
    order = np.lexsort(
        (
            np.arange(part.num_rows),
            refused,
            part.column("row").to_numpy(zero_copy_only=False),
            part.column("source").to_numpy(zero_copy_only=False).astype(str),
        )
    )
    part = part.take(pa.array(order))
    source = part.column("source").to_numpy(zero_copy_only=False).astype(str)
    row = part.column("row").to_numpy(zero_copy_only=False)
    first = np.ones(part.num_rows, bool)
    first[1:] = (source[1:] != source[:-1]) | (row[1:] != row[:-1])
    part = part.filter(pa.array(first))
    if "key" in part.column_names:  # the row stands for its video now, under the video's key
        part = part.set_column(part.column_names.index("key"), "key", part.column("video"))
    return pa.concat_tables([rest, part])


def release_tables(
    storage: Storage,
    download_ledgers: list[str],
    validate_ledgers: list[str],
    outputs: list[tuple[str, str]],
    incomplete: list[pa.Table],
    curate_ledgers: list[str] | None = None,
    upkeep_removed: pa.Table | None = None,
    upkeep_flagged: pa.Table | None = None,
) -> tuple[pa.Table, pa.Table]:
    """(samples, ledger): where each released sample is (every clip of a video), and every
    manifest row's final fate (one per row: a video's clips are one fate, see ``one_per_row``).

    ``upkeep_removed``: rows the reshard's upkeep rejected (tasks/stages/upkeep.py: taken down,
    or dropped for a recheck's outcome), ok in every phase's ledger before; they get phase
    ``upkeep`` and a ``detail`` column (the list and entry, or what the recheck saw).
    ``upkeep_flagged``: released rows a recheck flagged that the recipe keeps; their ``upkeep``
    column names the outcome. Each column is there only when some row needs it, so a release
    without upkeep has the ledger it had before upkeep came.
    """
    samples = []
    for name, ledger in outputs:
        t = read_ledger_with(storage, ledger, ["key", "source", "row", "offset", "length"], ["video"])
        samples.append(t.append_column("shard", pa.array([name] * t.num_rows, pa.string())))
    samples_t = pa.concat_tables(samples) if samples else _EMPTY_SAMPLES.empty_table()
    parts = []
    removed = upkeep_removed if upkeep_removed is not None and upkeep_removed.num_rows else None
    flagged = upkeep_flagged if upkeep_flagged is not None and upkeep_flagged.num_rows else None
    if removed is not None:
        # First: where a video's clips end in several refusals, its fate is the first one's.
        t = removed.select([*LEDGER_COLUMNS, "video"])
        parts.append(t.append_column("phase", pa.array(["upkeep"] * t.num_rows, pa.string())))
    for phase, ledgers in (
        ("download", download_ledgers),
        ("validate", validate_ledgers),
        ("curate", curate_ledgers or []),
    ):
        for rel in ledgers:
            t = read_ledger_with(storage, rel, LEDGER_COLUMNS, ["video"])
            t = t.filter(pc.not_equal(t.column("status"), "ok"))
            parts.append(t.append_column("phase", pa.array([phase] * t.num_rows, pa.string())))
    for t in incomplete:
        t = t.select(LEDGER_COLUMNS)
        t = t.append_column("video", pa.nulls(t.num_rows, pa.string()))
        parts.append(t.append_column("phase", pa.array(["reshard"] * t.num_rows, pa.string())))
    ok = samples_t.select(["key", "source", "row"])
    ok = ok.append_column("status", pa.array(["ok"] * ok.num_rows, pa.string()))
    ok = ok.append_column("reason", pa.array([None] * ok.num_rows, pa.string()))
    ok = ok.append_column("video", samples_t.column("video"))
    parts.append(ok.append_column("phase", pa.array(["release"] * ok.num_rows, pa.string())))
    if removed is not None or flagged is not None:
        details = [removed.column("detail") if removed is not None and i == 0 else None for i in range(len(parts))]
        parts = [_with_detail(p, d) for p, d in zip(parts, details)]
    ledger = one_per_row(pa.concat_tables(parts))
    if flagged is not None:
        ledger = _flag(ledger, flagged)
    if (
        not pc.any(pc.is_valid(samples_t.column("video"))).as_py()
        and not pc.any(pc.is_valid(ledger.column("video"))).as_py()
    ):
        # No clips: the tables of a release of images, as they were before videos came.
        return samples_t.drop_columns(["video"]), ledger.drop_columns(["video"])
    return samples_t, ledger


def _with_detail(part: pa.Table, detail: pa.ChunkedArray | None) -> pa.Table:
    """``part`` with a ``detail`` column: ``detail`` (the upkeep rows'), or nulls."""
    return part.append_column("detail", detail if detail is not None else pa.nulls(part.num_rows, pa.string()))


def _flag(ledger: pa.Table, flagged: pa.Table) -> pa.Table:
    """The ledger with an ``upkeep`` column naming the recheck outcome of each released row the
    recipe keeps though a recheck flagged it (its ``detail``: what the recheck saw)."""
    from tasks.stages.upkeep import RowIndex

    index = RowIndex()
    rows = flagged.column("row").to_numpy(zero_copy_only=False)
    index.add(flagged.column("source"), rows, np.arange(flagged.num_rows, dtype=np.int64))
    ok = pc.fill_null(pc.equal(ledger.column("status"), "ok"), False).to_numpy(zero_copy_only=False)
    rows_at = pc.fill_null(ledger.column("row"), -1).to_numpy(zero_copy_only=False)
    at = np.where(ok, index.lookup(ledger.column("source"), rows_at), -1)
    hit, pick = pa.array(at >= 0), pa.array(np.maximum(at, 0))
    none = pa.scalar(None, pa.string())
    upkeep = pc.if_else(hit, flagged.column("upkeep").take(pick), none)
    seen = pc.if_else(hit, flagged.column("detail").take(pick), none)
    ledger = ledger.set_column(
        ledger.column_names.index("detail"), "detail", pc.coalesce(ledger.column("detail"), seen)
    )
    return ledger.append_column("upkeep", upkeep)
