"""Every fine-tuning record's fate after packing: the ledger, the gate's samples, the report's and the release's rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tasks.finetune.packs import PLAN_COLUMNS, PackPlan, PackShardResult, plan_packs
from tasks.formats.ledger import Counts, read_parquet
from tasks.formats.recipe_finetune import FinetuneConfig
from tasks.formats.storage import Storage

REPORT_COLUMNS = [
    "key",
    "source",
    "status",
    "reason",
    "text_only",
    "images",
    "tiles",
    "tokens_text",
    "tokens_image",
    "tokens_total",
    "faces",  # null: a record's images are looked at by validation, whose report counts them
    "personal_data",
    "privacy",
]
PRIVACY_COLUMNS = ("personal_data", "privacy")  # of the sample tables; older runs' lack them


@dataclass
class FinetuneSummary:
    """What the fine-tuning phases made: counts, the padding cut-off, packs and their fill."""

    dataset: str
    run: str
    counts: Counts
    stats: dict[str, Any]
    outputs: list[PackShardResult] = field(default_factory=list)
    seconds: float = 0.0
    privacy: dict[str, int] = field(default_factory=dict)  # turn_privacy of its ledger


def turn_privacy(ledger: pa.Table) -> dict[str, int]:
    """Records with personal data found in their turns, those released redacted, those refused
    for it (the run summary's line); empty where the ledger has no privacy columns."""
    if not {"personal_data", "privacy"} <= set(ledger.column_names):
        return {}
    rows = ledger.select(["status", "reason", "personal_data", "privacy"]).to_pylist()
    return {
        "with_personal_data": sum(1 for r in rows if r["personal_data"]),
        "redacted": sum(1 for r in rows if r["status"] == "ok" and r["privacy"] == "redacted"),
        "refused": sum(1 for r in rows if r["reason"] == "personal_data"),
    }


def plan_with_rows(
    storage: Storage, tables: list[str], cfg: FinetuneConfig, per_shard: int, seed: int | None
) -> tuple[PackPlan, pa.Table]:
    """The pack plan (its stats name the tokenizer the samples were counted with), and the
    sample rows (report and gate columns) of every record, from the sample tables."""
    loaded = [_with_privacy(read_parquet(storage, t)) for t in tables]
    plan = plan_packs([t.select(PLAN_COLUMNS) for t in loaded], cfg, per_shard, seed)
    rows = pa.concat_tables(loaded)
    names = [n for n in rows.column("tokenizer").to_pylist() if n]
    plan.stats["tokenizer"] = names[0] if names else None
    return plan, rows


def _with_privacy(table: pa.Table) -> pa.Table:
    """A sample table with the privacy columns (null in an older run's table) and a null ``faces``."""
    for name in PRIVACY_COLUMNS:
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(len(table), pa.string()))
    return table.append_column("faces", pa.nulls(len(table), pa.int32()))


def records_in(outputs: list[PackShardResult]) -> int:
    """The records (conversation samples) the packs of ``outputs`` hold."""
    return sum(p["samples"] for o in outputs for p in o.packs)


def shard_names(outputs: list[PackShardResult]) -> dict[str, str]:
    """The name of each packed output shard (by its work path) in its release (``release_shard_names``)."""
    from tasks.stages.release import release_shard_names

    ordered = sorted(outputs, key=lambda o: o.index)
    return dict(zip([o.tar for o in ordered], release_shard_names([o.sha256 for o in ordered])))


def final_tables(rows: pa.Table, plan: PackPlan, outputs: list[PackShardResult]) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(ledger: every record's fate; samples: one row per accepted sample, for the gate; report rows)."""
    verdict = {v["key"]: v for v in plan.verdicts.to_pylist()}
    where = {}
    names = shard_names(outputs)
    for o in outputs:
        for p in o.packs:
            for k in p["members"]:
                where[k] = (p["key"], names[o.tar])
    led, smp = [], []
    columns = ["key", "source", "row", "id", "tags_ok", "text_only", "images", "tokens_total", *PRIVACY_COLUMNS]
    for r in rows.select(columns).to_pylist():
        v = verdict[r["key"]]
        pack, shard = where.get(r["key"], (None, None))
        status = v["status"] if v["status"] != "ok" or pack is not None else "error"
        reason = v["reason"] if status == v["status"] else "image_failed"
        led.append(
            {
                "key": r["key"],
                "source": r["source"],
                "row": r["row"],
                "id": r["id"],
                "status": status,
                "reason": reason,
                "detail": v["detail"],
                "pack": pack,
                "shard": shard,
                "truncated": v["truncated"],
                "personal_data": r["personal_data"],
                "privacy": r["privacy"],
            }
        )
        if status == "ok":
            smp.append(
                {
                    "key": r["key"],
                    "pack": pack,
                    "shard": shard,
                    "tags_ok": r["tags_ok"],
                    "schema_ok": r["images"] is not None and r["tokens_total"] is not None,
                    "text_only": r["text_only"],
                    "tokens": r["tokens_total"],
                    # released with personal data in a turn that was not redacted (``record``)
                    "personal_data_shown": bool(r["personal_data"]) and r["privacy"] != "redacted",
                }
            )
    ledger = pa.Table.from_pylist(led)
    samples = pa.Table.from_pylist(smp) if smp else pa.table({"key": pa.array([], pa.string())})
    report = rows.select(REPORT_COLUMNS).drop_columns(["status", "reason"])
    report = report.append_column("status", ledger.column("status")).append_column("reason", ledger.column("reason"))
    return ledger, samples, report


def pack_ledger(outputs: list[PackShardResult]) -> pa.Table:
    """One ok row per written pack: the packing step's rows for its phase record."""
    keys = [p["key"] for o in outputs for p in o.packs]
    n = len(keys)
    return pa.table({"key": keys, "source": ["packs"] * n, "status": ["ok"] * n, "reason": pa.nulls(n, pa.string())})


def packs_table(outputs: list[PackShardResult]) -> pa.Table:
    """The packs the fine-tuning gate judges: key, tokens, images, tiles, samples."""
    rows = [{k: p[k] for k in ("key", "tokens", "images", "tiles", "samples")} for o in outputs for p in o.packs]
    return pa.Table.from_pylist(rows) if rows else pa.table({})


def release_packs(outputs: list[PackShardResult]) -> pa.Table:
    """The release's ``samples`` table of a fine-tuning release: where each pack is, what it holds."""
    names = shard_names(outputs)
    rows = [
        {
            "key": p["key"],
            "shard": names[o.tar],
            "offset": r.offset,
            "length": r.length,
            "tokens": p["tokens"],
            "images": p["images"],
            "tiles": p["tiles"],
            "samples": p["samples"],
            "sample_keys": p["members"],
        }
        for o in outputs
        for p, r in zip(o.packs, o.records)
    ]
    return pa.Table.from_pylist(rows) if rows else pa.table({"key": pa.array([], pa.string())})
