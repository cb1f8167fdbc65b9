"""Where rechecks of released rows are kept: per download chunk, a new immutable version holding every rechecked row's latest state."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats.ledger import read_parquet, write_parquet
from tasks.formats.names import split_version
from tasks.formats.storage import Storage

# One row per rechecked sample (its latest check): a version is the previous one's rows with
# this run's checks merged in, so the latest version of a chunk is all there is to read.
RECHECK_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("source", pa.string()),
        ("row", pa.int64()),
        ("url", pa.string()),
        ("checked_at", pa.timestamp("us", tz="UTC")),
        # tasks.formats.reasons.RECHECK_OUTCOMES: unchanged, unreachable, link_dead,
        # content_changed, opted_out
        ("outcome", pa.string()),
        ("http_status", pa.int32()),
        ("detail", pa.string()),  # what was seen: the status, the directive, the TDM policy
        ("misses", pa.int32()),  # checks in a row the host could not be reached
        ("etag", pa.string()),  # the validators the server sent at this check
        ("last_modified", pa.string()),
        ("sha256", pa.string()),  # of the body this check read, where it read one
    ]
)
_VERSION = re.compile(r"^(?P<chunk>.+)\.(?P<gen>\d{6})\.parquet$")


def recheck_dir(dataset: str, source: str) -> str:
    return f"{dataset}/recheck/{source}"


def chunk_stem(download_ledger: str) -> str:
    """The chunk a download ledger belongs to, as recheck versions name it: the ledger's file
    name without ``.ledger.parquet`` and without a retry version's suffix (``.rNNN-xxxxxxxx``),
    so rechecks of a chunk carry over its retry versions."""
    return split_version(download_ledger.rsplit("/", 1)[-1].removesuffix(".ledger.parquet"))[0]


def version_path(dataset: str, source: str, chunk: str, gen: int) -> str:
    return f"{recheck_dir(dataset, source)}/{chunk}.{gen:06d}.parquet"


def latest_versions(storage: Storage, dataset: str, source: str) -> dict[str, tuple[int, str]]:
    """chunk -> (generation, path) of its latest recheck version, from one listing of the source's folder."""
    found: dict[str, tuple[int, str]] = {}
    folder = recheck_dir(dataset, source)
    for name in storage.listdir(folder):
        m = _VERSION.match(name)
        if m is None or name.startswith(".tmp-"):  # a temp name is a write in progress (or killed)
            continue
        gen = int(m["gen"])
        if gen > found.get(m["chunk"], (-1, ""))[0]:
            found[m["chunk"]] = (gen, f"{folder}/{name}")
    return found


def read_state(storage: Storage, path: str) -> pa.Table:
    return read_parquet(storage, path).select(RECHECK_SCHEMA.names).cast(RECHECK_SCHEMA)


def write_version(storage: Storage, dataset: str, source: str, chunk: str, gen: int, table: pa.Table) -> str:
    """Write generation ``gen`` of a chunk's recheck state (atomically); returns its path."""
    path = version_path(dataset, source, chunk, gen)
    write_parquet(storage, path, table.select(RECHECK_SCHEMA.names).cast(RECHECK_SCHEMA))
    return path


def read_current(storage: Storage, dataset: str, ledgers: list[str]) -> pa.Table:
    """The latest recheck state of each row of the download chunks these ``ledgers`` are the
    current versions of (``{dataset}/download/{source}/{name}``); an empty table where none
    was rechecked.

    Only those chunks': a chunk is named by its manifest rows, so once the manifest changes
    under it (a row inserted above, a caption edited) its rows are fetched again as another
    chunk, and what was seen of the old one (an opt-out, a changed file) must not follow its row
    numbers to other URLs or to the bytes fetched since. A key in several versions read (a store
    written before this rule) keeps its latest check."""
    wanted: dict[str, set[str]] = {}
    for rel in ledgers:
        wanted.setdefault(rel.split("/")[-2], set()).add(chunk_stem(rel))
    parts = [
        read_state(storage, path)
        for source, chunks in sorted(wanted.items())
        for chunk, (_, path) in sorted(latest_versions(storage, dataset, source).items())
        if chunk in chunks
    ]
    if not parts:
        return RECHECK_SCHEMA.empty_table()
    table = pa.concat_tables(parts)
    order = pc.sort_indices(table, [("key", "ascending"), ("checked_at", "descending")])
    table = table.take(order)
    keys = table.column("key").to_numpy(zero_copy_only=False)
    first = np.ones(len(keys), bool)
    first[1:] = keys[1:] != keys[:-1]
    return table.filter(pa.array(first))
