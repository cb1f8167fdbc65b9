"""Fine-tuning packs: the plan (text-only mix, padding cut-off, packing into output shards) and the shards that hold the packs."""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tasks.finetune.packing import cu_seqlens, pack, pack_stats, pad_to_longest_ratio, padding_cutoff, truncate_at_turns
from tasks.finetune.samples import SAMPLE_SCHEMA, STAGE_VERSION
from tasks.formats.ledger import MEMBER_TYPE, read_parquet, write_parquet
from tasks.formats.names import digest_of
from tasks.formats.reasons import OK, status_of
from tasks.formats.recipe_finetune import FinetuneConfig
from tasks.formats.shards import HashingWriter, SampleRecord, ShardWriter, iter_samples
from tasks.formats.storage import Storage

# --- plan ------------------------------------------------------------------------------------

PLAN_COLUMNS = [
    "key",
    "source",
    "row",
    "status",
    "reason",
    "detail",
    "shard",
    "offset",
    "length",
    "text_only",
    "images",
    "tiles",
    "tokens_total",
    "turn_tokens",
    "turn_images",
    "turn_tiles",
]


@dataclass
class SampleRef:
    """One accepted sample as a pack writer needs it: where its bytes are, and how much to keep."""

    key: str
    tar: str
    offset: int
    length: int
    tokens: int
    images: int
    tiles: int
    turns: int | None = None  # turns kept when truncated at a turn boundary


@dataclass
class OutputSpec:
    """One output shard: its packs (each a list of samples), numbered from ``first_pack``."""

    index: int
    first_pack: int
    packs: list[list[SampleRef]]


@dataclass
class PackPlan:
    """The padding cut-off, the packs in output shards, and every record's final verdict."""

    cutoff: int
    outputs: list[OutputSpec]
    verdicts: pa.Table  # key, status, reason, detail, truncated, pack, tokens_total after the cut-off
    stats: dict[str, Any]


def _keep_text_only(keys: list[str], n_with_images: int, ratio: float | None) -> set[str]:
    """Which text-only samples stay: at most ``ratio`` of the accepted, chosen by a hash of the key."""
    if ratio is None:
        return set(keys)
    allowed = int(np.floor(ratio / (1 - ratio) * n_with_images + 1e-9)) if ratio > 0 else 0
    ranked = sorted(keys, key=lambda k: hashlib.sha256(k.encode()).hexdigest())
    return set(ranked[:allowed])


def plan_packs(tables: list[pa.Table], cfg: FinetuneConfig, per_shard: int, seed: int | None) -> PackPlan:
    """Text-only mix, the padding cut-off (drop or truncate), then packing into output shards."""
    table = (
        pa.concat_tables([t.select(PLAN_COLUMNS) for t in tables])
        if tables
        else pa.Table.from_pylist([], schema=SAMPLE_SCHEMA).select(PLAN_COLUMNS)
    )
    rows = table.to_pylist()
    ok = [r for r in rows if r["status"] == OK]
    keep_text = _keep_text_only(
        [r["key"] for r in ok if r["text_only"]], sum(not r["text_only"] for r in ok), cfg.text_only_ratio
    )
    pk = cfg.packing
    verdict: dict[str, dict[str, Any]] = {}
    for r in ok:
        if r["text_only"] and r["key"] not in keep_text:
            verdict[r["key"]] = {"reason": "text_only_over_ratio", "detail": f"text_only_ratio {cfg.text_only_ratio}"}
    mixed = [r for r in ok if r["key"] not in verdict]
    cutoff = padding_cutoff([r["tokens_total"] for r in mixed], cfg.padding, pk.budget if pk.packed else None)
    refs: list[SampleRef] = []
    truncated = 0
    for r in mixed:
        ref = SampleRef(r["key"], r["shard"], r["offset"], r["length"], r["tokens_total"], r["images"], r["tiles"])
        if r["tokens_total"] > cutoff:
            kept = truncate_at_turns(r["turn_tokens"], cutoff) if cfg.padding.policy == "truncate" else 0
            if not kept:
                verdict[r["key"]] = {
                    "reason": "sample_too_long",
                    "detail": f"{r['tokens_total']} tokens over the cut-off {cutoff}",
                }
                continue
            ref.turns = kept
            ref.tokens = sum(r["turn_tokens"][:kept])
            ref.images = sum(r["turn_images"][:kept])
            ref.tiles = sum(r["turn_tiles"][:kept])
            truncated += 1
        if pk.packed and (ref.images > pk.max_images or (pk.max_tiles is not None and ref.tiles > pk.max_tiles)):
            verdict[r["key"]] = {
                "reason": "too_many_images",
                "detail": f"{ref.images} images / {ref.tiles} tiles over the pack caps",
            }
            continue
        refs.append(ref)
    if pk.packed:
        groups = pack([s.tokens for s in refs], [s.images for s in refs], [s.tiles for s in refs], pk)
    else:
        groups = [[i] for i in range(len(refs))]
    if seed is not None:
        order = np.random.default_rng(seed).permutation(len(groups)).tolist()
        groups = [groups[i] for i in order]
    packs = [[refs[i] for i in g] for g in groups]
    outputs = [
        OutputSpec(j, j * per_shard, packs[j * per_shard : (j + 1) * per_shard])
        for j in range(-(-len(packs) // per_shard))
    ]
    where: dict[str, tuple[int, int]] = {}
    for p, members in enumerate(packs):
        for s in members:
            where[s.key] = (p, s.turns is not None)
    vrows = []
    for r in rows:
        v = verdict.get(r["key"])
        reason = r["reason"] if v is None else v["reason"]
        pack_i, trunc = where.get(r["key"], (None, False))
        vrows.append(
            {
                "key": r["key"],
                "reason": reason,
                "status": status_of(reason),
                "detail": r["detail"] if v is None else v["detail"],
                "truncated": trunc,
                "pack": pack_i,
            }
        )
    lengths = [s.tokens for s in refs]
    st = (
        pack_stats(groups, lengths, pk.budget, [s.images for s in refs], [s.tiles for s in refs]) if pk.packed else None
    )
    stats = {
        "cutoff": cutoff,
        "truncated": truncated,
        "samples": len(refs),
        "packs": len(packs),
        "fill_ratio": st.fill_ratio if st else None,
        "pad_to_longest_ratio": pad_to_longest_ratio(lengths, pk.compare_batch_size),
        "max_pack_tokens": st.max_tokens if st else None,
        "max_pack_images": st.max_images if st else None,
        "max_pack_tiles": st.max_tiles if st else None,
    }
    return PackPlan(cutoff=cutoff, outputs=outputs, verdicts=pa.Table.from_pylist(vrows), stats=stats)


# --- write packs -----------------------------------------------------------------------------


@dataclass
class PackShardResult:
    """One written output shard: enough for the release indexes without reading it again.

    Args:
        packs: one row per pack (or per sample when unpacked): key, tokens, images, tiles, samples.
    """

    index: int
    tar: str
    ledger: str
    samples: int
    bytes: int
    sha256: str
    records: list[SampleRecord]
    packs: list[dict[str, Any]]
    seconds: float
    skipped: bool = False


def output_paths(dataset: str, spec: OutputSpec, cfg: FinetuneConfig) -> tuple[str, str]:
    digest = digest_of(
        [[(s.key, s.tar, s.offset, s.turns) for s in p] for p in spec.packs],
        spec.first_pack,
        cfg.packing,
        STAGE_VERSION,
    )
    stem = f"{dataset}/finetune/packed/{digest}/shard-{spec.index:06d}"
    return stem + ".tar", stem + ".ledger.parquet"


def _load_sample(fh, ref: SampleRef) -> dict[str, bytes]:
    fh.seek(ref.offset)
    raw = fh.read(ref.length)
    # Read back through the hostile-tar reader: the intermediate shard is ours, but the same
    # code path keeps one way of reading tars.
    samples = list(iter_samples(io.BytesIO(raw + bytes(1024)), required=("json",)))
    if len(samples) != 1 or samples[0].key != ref.key:
        raise ValueError(f"{ref.tar}@{ref.offset}: expected sample {ref.key}, found {[s.key for s in samples]}")
    return samples[0].members


def write_pack_shard(
    storage: Storage, spec: OutputSpec, cfg: FinetuneConfig, tar_rel: str, ledger_rel: str
) -> PackShardResult:
    """Write one output shard of packs (or of single samples when unpacked), then its ledger."""
    start = time.perf_counter()
    if storage.exists(ledger_rel):
        t = read_parquet(storage, ledger_rel)
        data = json.loads(t.schema.metadata[b"shardsmith.finetune"])
        return PackShardResult(**{**data, "records": _records_of(t), "seconds": 0.0, "skipped": True})
    packed = cfg.packing.packed
    handles: dict[str, Any] = {}
    pack_rows = []
    try:
        with storage.atomic_writer(tar_rel) as out:
            hashing = HashingWriter(out)
            writer = ShardWriter(hashing)
            for p, members in enumerate(spec.packs):
                loaded = []
                for ref in members:
                    fh = handles.get(ref.tar)
                    if fh is None:
                        fh = handles[ref.tar] = storage.open(ref.tar, "rb")
                    m = _load_sample(fh, ref)
                    sample, m = cut_sample(json.loads(m.pop("json")), m, ref.turns, cfg.tiling.image_start)
                    loaded.append((ref, sample, m))
                if packed:
                    key = f"pack-{spec.first_pack + p:09d}"
                    out_members: dict[str, bytes] = {}
                    samples = []
                    for s, (_ref, sample, m) in enumerate(loaded):
                        prefix = f"s{s:03d}."
                        for img in sample["images"]:
                            img["member"] = prefix + img["member"]
                            if img["tile_members"]:
                                img["tile_members"] = [prefix + t for t in img["tile_members"]]
                        out_members.update({prefix + name: data for name, data in m.items()})
                        samples.append(sample)
                    lengths = [s["tokens"]["total"] for s in samples]
                    doc = {
                        "pack": key,
                        "budget": cfg.packing.budget,
                        "tokens": sum(lengths),
                        "images": sum(len(s["images"]) for s in samples),
                        "tiles": sum(i["tiles"] for s in samples for i in s["images"]),
                        "cu_seqlens": cu_seqlens(lengths),
                        "samples": samples,
                    }
                    out_members = {"json": json.dumps(doc, ensure_ascii=False, sort_keys=True).encode(), **out_members}
                else:
                    ((ref, sample, m),) = loaded
                    key = ref.key
                    doc = {
                        "tokens": sample["tokens"]["total"],
                        "images": len(sample["images"]),
                        "tiles": sum(i["tiles"] for i in sample["images"]),
                    }
                    out_members = {"json": json.dumps(sample, ensure_ascii=False, sort_keys=True).encode(), **m}
                writer.write_sample(key, out_members)
                pack_rows.append(
                    {
                        "key": key,
                        "tokens": doc["tokens"],
                        "images": doc["images"],
                        "tiles": doc["tiles"],
                        "samples": len(loaded),
                        "members": [r.key for r, _, _ in loaded],
                    }
                )
            writer.close()
    finally:
        for fh in handles.values():
            fh.close()
    records = writer.records
    result = PackShardResult(
        spec.index,
        tar_rel,
        ledger_rel,
        len(records),
        writer.bytes_written,
        hashing.sha.hexdigest(),
        records,
        pack_rows,
        0.0,
    )
    result.seconds = round(time.perf_counter() - start, 3)
    _write_pack_ledger(storage, result)
    return result


def cut_sample(
    sample: dict[str, Any], members: dict[str, bytes], turns: int | None, image_start: str
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The sample cut to its first ``turns`` turns (a turn boundary), without the later turns' images.

    Token counts after the cut are exact: the sample carries its per-turn and per-image counts.
    """
    if turns is None or turns >= len(sample["conversations"]):
        return sample, members
    conv = sample["conversations"][:turns]
    n = sum(t["value"].count(image_start) for t in conv)
    kept, dropped = sample["images"][:n], sample["images"][n:]
    gone = {img["member"] for img in dropped} | {t for img in dropped for t in (img["tile_members"] or [])}
    total = sum(sample["turn_tokens"][:turns])
    image = sum(img["tokens"] for img in kept)
    out = dict(sample, conversations=conv, images=kept, text_only=not kept, turn_tokens=sample["turn_tokens"][:turns])
    out["tokens"] = {"text": total - image, "image": image, "total": total}
    out["truncated_from_turns"] = len(sample["conversations"])
    return out, {k: v for k, v in members.items() if k not in gone}


def _records_of(table: pa.Table) -> list[SampleRecord]:
    from tasks.formats.shards import MemberRecord

    out = []
    for r in table.select(["key", "offset", "length", "members"]).to_pylist():
        out.append(
            SampleRecord(
                r["key"],
                r["offset"],
                r["length"],
                tuple(MemberRecord(m["name"], m["offset"], m["size"]) for m in r["members"]),
            )
        )
    return out


def _write_pack_ledger(storage: Storage, result: PackShardResult) -> None:
    rows = []
    for rec, p in zip(result.records, result.packs):
        rows.append(
            {
                "key": rec.key,
                "source": "packs",
                "row": None,
                "status": OK,
                "reason": None,
                "shard": result.tar,
                "offset": rec.offset,
                "length": rec.length,
                "members": rec.members_as_dicts(),
                "tokens": p["tokens"],
                "images": p["images"],
                "tiles": p["tiles"],
                "samples": p["samples"],
                "sample_keys": p["members"],
            }
        )
    schema = pa.schema(
        [
            ("key", pa.string()),
            ("source", pa.string()),
            ("row", pa.int64()),
            ("status", pa.string()),
            ("reason", pa.string()),
            ("shard", pa.string()),
            ("offset", pa.int64()),
            ("length", pa.int64()),
            ("members", pa.list_(MEMBER_TYPE)),
            ("tokens", pa.int64()),
            ("images", pa.int32()),
            ("tiles", pa.int32()),
            ("samples", pa.int32()),
            ("sample_keys", pa.list_(pa.string())),
        ]
    )
    meta = {k: v for k, v in result.__dict__.items() if k not in ("records", "seconds", "skipped")}
    table = pa.Table.from_pylist(rows, schema=schema).replace_schema_metadata(
        {b"shardsmith.finetune": json.dumps(meta).encode()}
    )
    write_parquet(storage, result.ledger, table)
