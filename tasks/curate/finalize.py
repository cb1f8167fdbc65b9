"""Curated shards: each validated shard's kept samples, their scores in their json; a ledger row for every sample."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from typing import Any

from tasks.curate.decide import FATE_COLUMNS, ShardDecision
from tasks.curate.scores import ALIGNMENT
from tasks.formats.ledger import ledger_schema, read_ledger, read_parquet
from tasks.formats.manifests import chunk_name
from tasks.formats.reasons import OK, status_of
from tasks.formats.storage import Storage
from tasks.stages.runner import ShardResult, Verdict, run_shard

CURATE_SCHEMA = ledger_schema(
    *("shard", "bytes", "sha256", "offset", "length", "members", "detail"),
    *("alignment", "scores", "duplicate_of", "similarity", "embedded_by"),
    *("video", "start_s", "end_s"),
)
# The validated ledger's columns a curated row carries on (a clip's video and span: where there are clips).
CARRIED = ("key", "source", "row", "bytes", "sha256")
CLIP_COLUMNS = ("video", "start_s", "end_s")


def curated_paths(dataset: str, decision: ShardDecision) -> tuple[str, str]:
    """(tar, ledger) of a curated shard, named by its validated shard and every decision about it."""
    shard = decision.shard
    stem = f"{dataset}/curate/{shard.source}/{chunk_name(shard.index)}-{decision.digest[:16]}"
    return stem + ".tar", stem + ".ledger.parquet"


def _with_scores(data: bytes, scores: dict[str, float | None]) -> bytes:
    meta = json.loads(data)
    meta["scores"] = {k: (None if v is None else round(float(v), 6)) for k, v in scores.items()}
    return json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")


def curate_shard(storage: Storage, decision: ShardDecision, tar_rel: str, ledger_rel: str) -> ShardResult:
    """Write the curated shard: kept samples copied member by member (their json gains ``scores``),
    then the ledger, one row per ok sample of the validated shard. Committed shards are skipped."""
    shard = decision.shard
    fates: dict[str, dict[str, Any]] = {}

    def items() -> Iterator[tuple[dict[str, Any], Any]]:
        fates.update((r["key"], r) for r in read_parquet(storage, decision.fates).to_pylist())
        rows = [r for r in read_ledger(storage, shard.ledger).to_pylist() if r["status"] == OK]
        with storage.open(shard.tar, "rb") as src:
            # Read in tar order (sequential); the ledger keeps row order.
            yield from ((r, src) for r in sorted(rows, key=lambda r: r["offset"]))

    def decide(item: tuple[dict[str, Any], Any]) -> Verdict:
        old, src = item
        key = old["key"]
        f = fates.get(key)
        if f is None:
            raise ValueError(f"{decision.fates}: no fate for sample {key} of {shard.ledger}")
        scores = {k: v for k, v in f.items() if k not in FATE_COLUMNS}
        row: dict[str, Any] = {c: old[c] for c in CARRIED} | {c: old.get(c) for c in CLIP_COLUMNS}
        row.update(
            alignment=scores.get(ALIGNMENT),
            scores=[(k, v) for k, v in scores.items() if v is not None] or None,
            duplicate_of=f["duplicate_of"],
            similarity=f["similarity"],
            embedded_by=shard.embedded_by or None,
        )
        if f["reason"] is not None:
            row.update(status=status_of(f["reason"]), reason=f["reason"], detail=f["detail"])
            return Verdict(row)
        row.update(status=OK, reason=None, detail=None)
        members = {}
        for m in old["members"]:
            src.seek(m["offset"])
            ext = posixpath.basename(m["name"])[len(key) + 1 :]
            data = src.read(m["size"])
            members[ext] = _with_scores(data, scores) if ext == "json" else data
        return Verdict(row, members=members)

    return run_shard(
        storage, tar_rel, ledger_rel, items, decide, source=shard.source, index=shard.index, schema=CURATE_SCHEMA
    )
