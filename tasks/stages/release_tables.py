"""The tables of a pretraining release: where each released sample is, and every manifest row's final fate."""

from __future__ import annotations

import pyarrow as pa

from tasks.formats.ledger import read_parquet
from tasks.formats.storage import Storage

LEDGER_COLUMNS = ["key", "source", "row", "status", "reason"]


def release_tables(
    storage: Storage,
    download_ledgers: list[str],
    validate_ledgers: list[str],
    outputs: list[tuple[str, str]],
    incomplete: list[pa.Table],
    curate_ledgers: list[str] | None = None,
) -> tuple[pa.Table, pa.Table]:
    """(samples, ledger): where each released sample is, and every manifest row's final fate."""
    samples = []
    for name, ledger in outputs:
        t = read_parquet(storage, ledger, ["key", "source", "row", "offset", "length"])
        samples.append(t.append_column("shard", pa.array([name] * t.num_rows, pa.string())))
    samples_t = pa.concat_tables(samples) if samples else pa.table({"key": pa.array([], pa.string())})
    parts = []
    for phase, ledgers in (
        ("download", download_ledgers),
        ("validate", validate_ledgers),
        ("curate", curate_ledgers or []),
    ):
        for rel in ledgers:
            t = read_parquet(storage, rel, LEDGER_COLUMNS)
            t = t.filter(pa.compute.not_equal(t.column("status"), "ok"))
            parts.append(t.append_column("phase", pa.array([phase] * t.num_rows, pa.string())))
    for t in incomplete:
        t = t.select(LEDGER_COLUMNS)
        parts.append(t.append_column("phase", pa.array(["reshard"] * t.num_rows, pa.string())))
    ok = samples_t.select(["key", "source", "row"])
    ok = ok.append_column("status", pa.array(["ok"] * ok.num_rows, pa.string()))
    ok = ok.append_column("reason", pa.array([None] * ok.num_rows, pa.string()))
    parts.append(ok.append_column("phase", pa.array(["release"] * ok.num_rows, pa.string())))
    return samples_t, pa.concat_tables(parts)
