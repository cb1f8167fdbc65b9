"""Every sample's fate from the stored scores: the filters' cuts over the whole dataset, then each shard's fates table.

Memory stays flat with the size of the dataset: the cuts read only the score columns that keep
a fraction, shard by shard, in passes (``scores.cuts_over``); then each shard's table is read,
decided, written and let go before the next ones (a few at once, in threads). Semantic dedup's
decisions are taken among the samples the filters keep: where a filter removes a sample that
led a group, one more pass over the score columns marks the removed rows (a bit per row) and
that group's cluster is compared again from the stored embeddings (``semdedup.among_survivors``).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.curate.scores import ALIGNMENT, Cut, cuts_over, duplicated, filtered_many, score_names, undecodable
from tasks.formats.ledger import write_parquet
from tasks.formats.names import short_digest
from tasks.formats.recipe_curate import CurateConfig
from tasks.formats.storage import Storage

T = TypeVar("T")
R = TypeVar("R")

FATE_COLUMNS = ["key", "reason", "detail", "duplicate_of", "similarity"]


@dataclass(frozen=True)
class ShardInput:
    """One validated shard on its way through curation.

    Args:
        tar, ledger: the validated shard and its ledger.
        source, index: its source and chunk.
        embeddings: its side shard.
        scores: its scores table.
        embedded_by: the run that computed its embeddings.
    """

    tar: str
    ledger: str
    source: str
    index: int
    embeddings: str
    scores: str
    embedded_by: str = ""


@dataclass(frozen=True)
class ShardDecision:
    """What was decided for one shard: its fates table (named by its content) and its count of removals."""

    shard: ShardInput
    fates: str
    digest: str
    removed: int


def fates_path(dataset: str, digest: str) -> str:
    return f"{dataset}/curate/fates/{digest[:2]}/{digest}.parquet"


def decide(
    storage: Storage,
    dataset: str,
    cfg: CurateConfig,
    shards: list[ShardInput],
    duplicates: dict[str, tuple[str, float]],
    threads: int = 4,
    dedup: list[str] | None = None,
    source_order: dict[str, int] | None = None,
) -> tuple[list[Cut], list[ShardDecision]]:
    """The cuts over all scores, and per shard a fates table: one row per sample with its scores
    and, for a removed one, its reason and detail (``scores.fate``). ``duplicates``: key ->
    (kept key, similarity) from semantic dedup. A fates table already stored (same content,
    same name) is not written again. ``threads``: shards read (and decided) at once.

    The filters come first, then semantic dedup among the samples they keep. ``dedup``: the
    decision files ``duplicates`` were read from (``semdedup.semantic_duplicates``, over every
    row), with ``source_order`` the recipe's order of sources: where a filter removes a sample
    that led a group, that group's cluster is compared again among its survivors from the stored
    embeddings (``semdedup.among_survivors``), so its earliest surviving sample is kept. Without
    ``dedup``, ``duplicates`` are taken as decided among the survivors already."""
    names = list(dict.fromkeys(score_names(cfg)))
    if not shards:
        return [], []
    applied = dataset_cuts(storage, cfg, shards, threads)
    if duplicates and dedup and cfg.semdedup is not None:
        duplicates = _among_survivors(storage, cfg, shards, names, applied, duplicates, dedup, source_order, threads)

    def one(shard: ShardInput) -> ShardDecision:
        return _decide_shard(storage, dataset, shard, names, applied, duplicates)

    return applied, list(_ordered_map(one, shards, threads))


def dataset_cuts(storage: Storage, cfg: CurateConfig, shards: list[ShardInput], threads: int = 4) -> list[Cut]:
    """The filters' cuts over every shard's scores (``scores.cuts_over``): the columns of the
    kept fractions alone, a shard at a time (``threads`` read at once), in two passes."""
    return cuts_over(cfg, lambda wanted: _ordered_map(lambda s: _read(storage, s.scores, wanted), shards, threads))


def _read(storage: Storage, rel: str, columns: list[str]) -> pa.Table:
    """Those of ``columns`` that the parquet file ``rel`` has (only their column chunks are read)."""
    with storage.open(rel, "rb") as fh:
        pf = pq.ParquetFile(fh, pre_buffer=False)
        have = set(pf.schema_arrow.names)
        return pf.read(columns=[c for c in dict.fromkeys(columns) if c in have], use_threads=False)


class RemovedRows:
    """The rows the filters remove, as one bit per row of each source: memory of a byte per row
    of the dataset at most, whatever the share removed."""

    def __init__(self) -> None:
        self._by_source: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def add(self, source: str, rows: np.ndarray) -> None:
        if not len(rows):
            return
        with self._lock:
            have = self._by_source.get(source, np.zeros(0, bool))
            top = int(rows.max()) + 1
            if top > len(have):
                have = np.concatenate([have, np.zeros(max(top, 2 * len(have)) - len(have), bool)])
            have[rows] = True
            self._by_source[source] = have

    def __call__(self, t: pa.Table) -> np.ndarray:
        """Which rows of ``t`` (``source``, ``row`` columns) the filters remove."""
        sources = t.column("source")
        rows = np.asarray(t.column("row").to_numpy(zero_copy_only=False), dtype=np.int64)
        out = np.zeros(len(rows), bool)
        for source in pc.unique(sources).to_pylist():
            have = self._by_source.get(source)
            if have is None:
                continue
            mine = np.flatnonzero(np.asarray(pc.equal(sources, source).to_numpy(zero_copy_only=False), dtype=bool))
            inside = rows[mine] < len(have)
            out[mine[inside]] = have[rows[mine[inside]]]
        return out


def _among_survivors(
    storage: Storage,
    cfg: CurateConfig,
    shards: list[ShardInput],
    names: list[str],
    applied: list[Cut],
    duplicates: dict[str, tuple[str, float]],
    dedup: list[str],
    source_order: dict[str, int] | None,
    threads: int,
) -> dict[str, tuple[str, float]]:
    """``duplicates`` decided among the samples the filters keep (``semdedup.among_survivors``):
    one pass over the score columns finds the samples the filters remove (a bit per row) and
    those of them that led a group; only when there are some are their clusters compared again."""
    from tasks.curate.semdedup import among_survivors

    assert cfg.semdedup is not None
    leaders = {kept for kept, _ in duplicates.values()}
    removed = RemovedRows()

    def one(shard: ShardInput) -> list[str]:
        t = _read(storage, shard.scores, ["key", "source", "row", "error", *names])
        gone = ~_filters(t, names, applied, explain=False)[3]
        if gone.any():
            at = np.flatnonzero(gone)
            sources = np.asarray(t.column("source").to_pylist(), dtype=object)[at]
            rows = np.asarray(t.column("row").to_numpy(zero_copy_only=False), dtype=np.int64)[at]
            for source in set(sources.tolist()):
                removed.add(source, rows[sources == source])
        keys = t.column("key").to_pylist()
        return [keys[i] for i in np.flatnonzero(gone).tolist() if keys[i] in leaders]

    fallen = {k for found in _ordered_map(one, shards, threads) for k in found}
    if not fallen:
        return duplicates

    def mapper(fn: Callable[..., Any], args: Any) -> list[Any]:
        return list(_ordered_map(lambda a: fn(*a), list(args), threads))

    files = [s.embeddings for s in shards]
    return among_survivors(
        storage, dedup, files, duplicates, fallen, removed, cfg.semdedup.threshold, source_order or {}, mapper
    )


def _filters(
    t: pa.Table, names: list[str], applied: list[Cut], explain: bool = True
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray, np.ndarray]:
    """What the filters say of a scores table's rows: (scores as ``_float32`` gives them, reason,
    detail, open): the reason of the first filter each row fails in recipe order (an
    undecodable image first), open where it fails none. ``explain``: reasons and details too
    (else left None)."""
    n = t.num_rows
    scored = {name: _float32(t.column(name)) for name in names if name in t.column_names}
    reason = np.full(n, None, dtype=object)
    detail = np.full(n, None, dtype=object)
    open_ = np.ones(n, bool)  # no reason yet
    if "error" in t.column_names and t.column("error").null_count < n:
        err = t.column("error")
        errors = err.to_pylist()
        failed = _valid(err)
        for i in np.flatnonzero(failed).tolist() if explain else []:
            reason[i], detail[i] = undecodable(errors[i])
        open_ &= ~failed
    for cut in applied:  # the first filter failed, in recipe order
        if cut.name not in scored:
            continue
        v, ok = scored[cut.name]
        low = ok & (v < cut.low) if cut.low is not None else np.zeros(n, bool)
        high = ok & ~low & (v > cut.high) if cut.high is not None else np.zeros(n, bool)
        for side, hit in (("low", low), ("high", high)):
            at = np.flatnonzero(hit & open_)
            if len(at) and explain:
                reason[at], detail[at] = filtered_many(cut, side, v[at].tolist())
        open_ &= ~(low | high)
    return scored, reason, detail, open_


def _decide_shard(
    storage: Storage,
    dataset: str,
    shard: ShardInput,
    names: list[str],
    applied: list[Cut],
    duplicates: dict[str, tuple[str, float]],
) -> ShardDecision:
    """One shard's fates table, written unless stored; the fates as ``scores.fate`` gives them
    row by row, found column by column."""
    t = _read(storage, shard.scores, ["key", "error", *names])
    n = t.num_rows
    keys = t.column("key").to_pylist()
    scored, reason, detail, open_ = _filters(t, names, applied)
    # A score as the fates table holds it: float32 (as float64), None where null or NaN.
    values = {name: pa.array(v, mask=~ok).to_pylist() for name, (v, ok) in scored.items()}
    dups = [duplicates.get(k) for k in keys] if duplicates else [None] * n
    if duplicates:
        for i, still in enumerate(open_.tolist()):
            dup = dups[i]
            if still and dup is not None:
                reason[i], detail[i] = duplicated(dup)
    columns: dict[str, list[Any]] = {
        "key": keys,
        "reason": reason.tolist(),
        "detail": detail.tolist(),
        "duplicate_of": [d[0] if d else None for d in dups],
        "similarity": [d[1] if d else None for d in dups],
        **values,
    }
    digest = rows_digest(shard.ledger, shard.embedded_by, columns, set(values), {"key", "reason", "detail"})
    path = fates_path(dataset, digest)
    if not storage.exists(path):
        schema = pa.schema(
            [
                ("key", pa.string()),
                ("reason", pa.string()),
                ("detail", pa.string()),
                ("duplicate_of", pa.string()),
                ("similarity", pa.float32()),
                *((name, pa.float32()) for name in scored),
            ]
        )
        arrays = [pa.array(columns[c], f.type) for c, f in zip(FATE_COLUMNS, schema)]
        arrays += [pa.array(v.astype(np.float32), pa.float32(), mask=~ok) for v, ok in scored.values()]
        write_parquet(storage, path, pa.Table.from_arrays(arrays, schema=schema))
    return ShardDecision(shard, path, digest, n - columns["reason"].count(None))


def rows_digest(
    ledger: str, embedded_by: str, columns: dict[str, list[Any]], floats: set[str], strings: set[str]
) -> str:
    """``digest_of(ledger, embedded_by, rows)`` of the rows that ``columns`` make (a dict per
    row, a key per column): the name a fates table always had, its JSON text written a column
    at a time (about twice as fast as encoding the dicts). ``floats``, ``strings``: the columns
    that hold only floats, only strings, and None."""
    encoded = []
    for name in sorted(columns):  # json.dumps(..., sort_keys=True): a row's keys in order
        col = columns[name]
        if col.count(None) == len(col):
            encoded.append(["null"] * len(col))
        elif name in floats:
            encoded.append(json.dumps(col)[1:-1].split(", "))
        elif name in strings:
            encoded.append([encode_basestring_ascii(x) if x is not None else "null" for x in col])
        else:
            encoded.append([_json(x) for x in col])
    template = "{" + ", ".join(f"{_json(name).replace('%', '%%')}: %s" for name in sorted(columns)) + "}"
    rows = ", ".join([template % row for row in zip(*encoded)])
    return short_digest(f"[{_json(ledger)}, {_json(embedded_by)}, [{rows}]]")


def _json(x: Any) -> str:
    """``x`` as ``digest_of``'s ``json.dumps`` writes it inside its parts."""
    if x is None:
        return "null"
    if type(x) is str:
        return encode_basestring_ascii(x)
    return json.dumps(x, sort_keys=True, default=str)


def _float32(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values as float32 in float64, valid): a score column as ``fate`` sees it, null and NaN not valid."""
    v = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64).astype(np.float32).astype(np.float64)
    return v, _valid(col) & ~np.isnan(v)


def _valid(col: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _ordered_map(fn: Callable[[T], R], items: list[T], threads: int) -> Iterator[R]:
    """``fn`` over ``items`` in threads, results in order, at most ``threads`` of them under way
    and one waiting: the memory of a few items, however many there are."""
    if threads <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="decide") as pool:
        pending: deque[Future[R]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def mean_alignment(scores: pa.Table) -> float | None:
    if ALIGNMENT not in scores.column_names:
        return None
    values = scores.column(ALIGNMENT).drop_null().to_numpy(zero_copy_only=False)
    return float(values.mean()) if len(values) else None
