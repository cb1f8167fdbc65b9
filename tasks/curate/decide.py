"""Every sample's fate in one pass over the stored scores: the filters' cuts over the whole dataset, then each shard's fates table."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tasks.curate.scores import ALIGNMENT, Cut, cuts, fate, score_names
from tasks.formats.ledger import read_tables, write_parquet
from tasks.formats.names import digest_of
from tasks.formats.recipe_curate import CurateConfig
from tasks.formats.storage import Storage

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
) -> tuple[list[Cut], list[ShardDecision]]:
    """The cuts over all scores, and per shard a fates table: one row per sample with its scores
    and, for a removed one, its reason and detail (``scores.fate``). ``duplicates``: key ->
    (kept key, similarity) from semantic dedup. A fates table already stored (same content,
    same name) is not written again."""
    names = score_names(cfg)
    tables = read_tables(storage, [s.scores for s in shards])
    all_scores = pa.concat_tables([tables[s.scores] for s in shards]) if shards else pa.table({})
    applied = cuts(cfg, all_scores) if shards else []
    out = []
    for s in shards:
        t = tables[s.scores]
        cols = {n: t.column(n).to_pylist() for n in names if n in t.column_names}
        errors = t.column("error").to_pylist() if "error" in t.column_names else [None] * t.num_rows
        rows = []
        for i, key in enumerate(t.column("key").to_pylist()):
            scored = {n: _finite(cols[n][i]) for n in cols}
            dup = duplicates.get(key)
            reason, detail = fate(scored, applied, dup, errors[i])
            rows.append(
                {
                    "key": key,
                    "reason": reason,
                    "detail": detail,
                    "duplicate_of": dup[0] if dup else None,
                    "similarity": dup[1] if dup else None,
                    **scored,
                }
            )
        schema = pa.schema(
            [
                ("key", pa.string()),
                ("reason", pa.string()),
                ("detail", pa.string()),
                ("duplicate_of", pa.string()),
                ("similarity", pa.float32()),
                *((n, pa.float32()) for n in cols),
            ]
        )
        table = pa.Table.from_pylist(rows, schema=schema)
        digest = digest_of(s.ledger, s.embedded_by, rows)
        path = fates_path(dataset, digest)
        if not storage.exists(path):
            write_parquet(storage, path, table)
        out.append(ShardDecision(s, path, digest, sum(r["reason"] is not None for r in rows)))
    return applied, out


def _finite(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(np.float32(value))


def mean_alignment(scores: pa.Table) -> float | None:
    if ALIGNMENT not in scores.column_names:
        return None
    values = scores.column(ALIGNMENT).drop_null().to_numpy(zero_copy_only=False)
    return float(values.mean()) if len(values) else None
