"""Fine-tuning stage drivers the flow maps over shards: ingest, build samples, plan packs, write packs."""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.conversations import render_turns
from tasks.images import OUTPUT_EXT
from tasks.ledger import MEMBER_TYPE, read_parquet, write_parquet
from tasks.packing import cu_seqlens, pack, pack_stats, pad_to_longest_ratio, padding_cutoff, truncate_at_turns
from tasks.reasons import OK, status_of
from tasks.recipe import FinetuneConfig, TilingConfig, TokensConfig
from tasks.shards import HashingWriter, SampleRecord, ShardWriter, iter_samples
from tasks.storage import Storage
from tasks.tiling import TilingError, all_tags, choose_grid, image_size, open_capped, tag_text, tile_count, tile_image, tile_members
from tasks.tokens import TokenCounter, load_counter

STAGE_VERSION = 2  # bump when ingest or sample building changes, so outputs get new names

# Every table of records, from ingest to the release ledger, starts with these columns.
RECORD_CORE = [
    ("key", pa.string()),
    ("source", pa.string()),
    ("row", pa.int64()),
    ("status", pa.string()),
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("id", pa.string()),
]
# One row per input record after sample building.
SAMPLE_SCHEMA = pa.schema(
    [
        *RECORD_CORE,
        ("shard", pa.string()),  # the intermediate sample tar (build) or the released pack shard
        ("offset", pa.int64()),
        ("length", pa.int64()),
        ("members", pa.list_(MEMBER_TYPE)),
        ("text_only", pa.bool_()),
        ("images", pa.int32()),
        ("tiles", pa.int32()),
        ("tokens_text", pa.int32()),
        ("tokens_image", pa.int32()),
        ("tokens_total", pa.int32()),
        ("turn_tokens", pa.list_(pa.int32())),  # text + image tokens per turn, for truncation
        ("turn_images", pa.list_(pa.int32())),
        ("turn_tiles", pa.list_(pa.int32())),
        ("tags_ok", pa.bool_()),  # tag groups in the text == images
        ("tokenizer", pa.string()),
    ]
)
def digest_of(*parts: Any) -> str:
    """A short stable hash of JSON-able parts: names outputs by their inputs and settings."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def image_source_name(source: str) -> str:
    """The derived image manifest's source name; its keys are ``{name}-{row:09d}``."""
    return f"{source}-img"


def image_key(source: str, image_row: int) -> str:
    return f"{image_source_name(source)}-{image_row:09d}"


# --- build samples ---------------------------------------------------------------------------


@dataclass
class BuildResult:
    """One record chunk turned into unpacked samples: an intermediate tar and its table."""

    source: str
    index: int
    tar: str
    table: str
    rows: int
    ok: int
    seconds: float
    skipped: bool = False


@lru_cache(maxsize=8)
def _counter(tokens: TokensConfig, tiling: TilingConfig) -> TokenCounter:
    # Once per worker process: loading a tokenizer costs far more than counting a shard.
    return load_counter(tokens, all_tags(tiling))


def build_paths(dataset: str, source: str, index: int, chunk: str, cfg: FinetuneConfig, image_ledgers: list[str]) -> tuple[str, str]:
    digest = digest_of(chunk, cfg.tiling, cfg.tokens, cfg.conversation.placeholder, sorted(image_ledgers), STAGE_VERSION)
    stem = f"{dataset}/finetune/samples/{source}/{index:06d}-{digest}"
    return stem + ".tar", stem + ".parquet"


def _image_fates(storage: Storage, ledgers: list[str], keys: set[str]) -> dict[str, dict[str, Any]]:
    """Final fate of each image key: the validate ledger's row where there is one, else the download's."""
    fates: dict[str, dict[str, Any]] = {}
    cols = ["key", "status", "reason", "shard", "members"]
    for rel in ledgers:  # download ledgers first, then validate ones overwrite them
        t = read_parquet(storage, rel, cols)
        t = t.filter(pc.is_in(t.column("key"), value_set=pa.array(sorted(keys), pa.string())))
        for r in t.to_pylist():
            fates[r["key"]] = r
    return fates


def build_samples(
    storage: Storage, source: str, index: int, chunk: str, first_image: int, image_ledgers: list[str], cfg: FinetuneConfig, tar_rel: str, table_rel: str
) -> BuildResult:
    """Per record: join its images' fates, tile, tag, count tokens; write the sample and its row.

    ``first_image``: the image manifest row of the chunk's first image (its ``image_rows``
    count from there). ``image_ledgers``: the download then validate ledgers that hold them.
    """
    start = time.perf_counter()
    if storage.exists(table_rel):
        t = read_parquet(storage, table_rel, ["status"])
        return BuildResult(source, index, tar_rel, table_rel, t.num_rows, int(pc.sum(pc.equal(t.column("status"), OK)).as_py() or 0), 0.0, True)
    records = read_parquet(storage, chunk).to_pylist()
    for rec in records:
        rec["image_rows"] = [first_image + r for r in rec["image_rows"] or []]
    want = {image_key(source, r) for rec in records for r in (rec["image_rows"] or [])}
    fates = _image_fates(storage, image_ledgers, want) if want else {}
    counter = _counter(cfg.tokens, cfg.tiling)
    rows = []
    handles: dict[str, Any] = {}
    try:
        with storage.atomic_writer(tar_rel) as out:
            writer = ShardWriter(out)
            for rec in records:
                row = {k: rec[k] for k in ("key", "source", "row", "status", "reason", "detail", "id")}
                row["tokenizer"] = counter.name
                if rec["status"] == OK:
                    _build_one(storage, rec, fates, cfg, counter, writer, handles, row)
                    if row.get("offset") is not None:
                        row["shard"] = tar_rel
                row["status"] = status_of(row["reason"])
                rows.append(row)
            writer.close()
    finally:
        for fh in handles.values():
            fh.close()
    table = pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA)
    write_parquet(storage, table_rel, table)
    ok = sum(r["status"] == OK for r in rows)
    return BuildResult(source, index, tar_rel, table_rel, len(rows), ok, round(time.perf_counter() - start, 3))


def _read_image(storage: Storage, fate: dict[str, Any], handles: dict[str, Any]) -> tuple[bytes, str]:
    member = next(m for m in fate["members"] if m["name"].rsplit(".", 1)[-1] in ("jpg", "png", "webp"))
    fh = handles.get(fate["shard"])
    if fh is None:
        fh = handles[fate["shard"]] = storage.open(fate["shard"], "rb")
    fh.seek(member["offset"])
    return fh.read(member["size"]), member["name"].rsplit(".", 1)[-1]


def _build_one(storage, rec, fates, cfg: FinetuneConfig, counter: TokenCounter, writer: ShardWriter, handles, row) -> None:
    tiling = cfg.tiling
    key = rec["key"]
    members: dict[str, bytes] = {}
    image_meta = []
    for n, r in enumerate(rec["image_rows"] or []):
        ikey = image_key(rec["source"], r)
        fate = fates.get(ikey)
        if fate is None or fate["status"] != OK:
            reason = "image_failed" if fate is None else fate["reason"]
            row["reason"] = "image_failed" if fate is None or status_of(reason) == "error" else "image_rejected"
            row["detail"] = f"image {n} ({ikey}): {reason or 'no ledger row'}"
            return
        data, ext = _read_image(storage, fate, handles)
        try:
            if tiling.store == "tiles":
                tiled = tile_image(open_capped(data, tiling.max_pixels), tiling)
                grid, w, h = tiled.grid, tiled.width, tiled.height
                tiles = tile_members(n, tiled, tiling.quality)
                members.update(tiles)
                tile_names = list(tiles)
            else:
                w, h = image_size(data, tiling.max_pixels)
                grid, tile_names = choose_grid(w, h, tiling), None
        except TilingError as err:
            row["reason"], row["detail"] = "image_rejected", f"image {n} ({ikey}): {err.reason}: {err.detail}"
            return
        members[f"i{n}.{ext}"] = data
        image_meta.append({"member": f"i{n}.{ext}", "width": w, "height": h, "grid": list(grid), "tiles": tile_count(grid, tiling), "thumbnail": tile_count(grid, tiling) > grid[0] * grid[1], "tile_members": tile_names})
    turns = [tuple(t) for t in json.loads(rec["turns"])]
    tags = [tag_text(tuple(m["grid"]), tiling) for m in image_meta]
    rendered = render_turns(turns, tags, cfg.conversation.placeholder)
    text_only_turns = [t.replace(cfg.conversation.placeholder, "") for _, t in turns]
    text_tokens = [c + cfg.tokens.turn_overhead for c in counter.count_many(text_only_turns)]
    tag_tokens = counter.count_many(tags)
    per_image = [m["tiles"] * tiling.tokens_per_tile + t for m, t in zip(image_meta, tag_tokens)]
    turn_images = list(rec["turn_images"])
    turn_tokens, turn_tiles, n = [], [], 0
    for j, k in enumerate(turn_images):
        turn_tokens.append(text_tokens[j] + sum(per_image[n : n + k]))
        turn_tiles.append(sum(m["tiles"] for m in image_meta[n : n + k]))
        n += k
    for m, t in zip(image_meta, per_image):
        m["tokens"] = t
    tokens_image = sum(per_image)
    tokens_text = sum(text_tokens)
    sample = {
        "key": key,
        "id": rec["id"],
        "conversations": [{"from": role, "value": text} for (role, _), text in zip(turns, rendered)],
        "images": image_meta,
        "tokens": {"text": tokens_text, "image": tokens_image, "total": tokens_text + tokens_image},
        "turn_tokens": turn_tokens,
        "text_only": not image_meta,
    }
    members["json"] = json.dumps(sample, ensure_ascii=False, sort_keys=True).encode()
    sr = writer.write_sample(key, members)
    row.update(
        offset=sr.offset, length=sr.length, members=sr.members_as_dicts(), text_only=not image_meta,
        images=len(image_meta), tiles=sum(m["tiles"] for m in image_meta), tokens_text=tokens_text, tokens_image=tokens_image,
        tokens_total=tokens_text + tokens_image, turn_tokens=turn_tokens, turn_images=turn_images, turn_tiles=turn_tiles,
        tags_ok=sum(t.count(tiling.image_start) for t in rendered) == len(image_meta),
    )


# --- plan ------------------------------------------------------------------------------------

PLAN_COLUMNS = ["key", "source", "row", "status", "reason", "detail", "shard", "offset", "length", "text_only", "images", "tiles", "tokens_total", "turn_tokens", "turn_images", "turn_tiles"]


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
    table = pa.concat_tables([t.select(PLAN_COLUMNS) for t in tables]) if tables else pa.Table.from_pylist([], schema=SAMPLE_SCHEMA).select(PLAN_COLUMNS)
    rows = table.to_pylist()
    ok = [r for r in rows if r["status"] == OK]
    keep_text = _keep_text_only([r["key"] for r in ok if r["text_only"]], sum(not r["text_only"] for r in ok), cfg.text_only_ratio)
    pk = cfg.packing
    budget = pk.budget if pk.packed else (1 << 40)
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
                verdict[r["key"]] = {"reason": "sample_too_long", "detail": f"{r['tokens_total']} tokens over the cut-off {cutoff}"}
                continue
            ref.turns = kept
            ref.tokens = sum(r["turn_tokens"][:kept])
            ref.images = sum(r["turn_images"][:kept])
            ref.tiles = sum(r["turn_tiles"][:kept])
            truncated += 1
        if pk.packed and (ref.images > pk.max_images or (pk.max_tiles is not None and ref.tiles > pk.max_tiles)):
            verdict[r["key"]] = {"reason": "too_many_images", "detail": f"{ref.images} images / {ref.tiles} tiles over the pack caps"}
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
    outputs = [OutputSpec(j, j * per_shard, packs[j * per_shard : (j + 1) * per_shard]) for j in range(-(-len(packs) // per_shard))]
    where: dict[str, tuple[int, int]] = {}
    for p, members in enumerate(packs):
        for s in members:
            where[s.key] = (p, s.turns is not None)
    vrows = []
    for r in rows:
        v = verdict.get(r["key"])
        reason = r["reason"] if v is None else v["reason"]
        pack_i, trunc = where.get(r["key"], (None, False))
        vrows.append({"key": r["key"], "reason": reason, "status": status_of(reason), "detail": r["detail"] if v is None else v["detail"], "truncated": trunc, "pack": pack_i})
    lengths = [s.tokens for s in refs]
    st = pack_stats(groups, lengths, pk.budget, [s.images for s in refs], [s.tiles for s in refs]) if pk.packed else None
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
    digest = digest_of([[(s.key, s.tar, s.offset, s.turns) for s in p] for p in spec.packs], spec.first_pack, cfg.packing, STAGE_VERSION)
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


def write_pack_shard(storage: Storage, spec: OutputSpec, cfg: FinetuneConfig, tar_rel: str, ledger_rel: str) -> PackShardResult:
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
                    for s, (ref, sample, m) in enumerate(loaded):
                        prefix = f"s{s:03d}."
                        for img in sample["images"]:
                            img["member"] = prefix + img["member"]
                            if img["tile_members"]:
                                img["tile_members"] = [prefix + t for t in img["tile_members"]]
                        out_members.update({prefix + name: data for name, data in m.items()})
                        samples.append(sample)
                    lengths = [s["tokens"]["total"] for s in samples]
                    doc = {
                        "pack": key, "budget": cfg.packing.budget, "tokens": sum(lengths),
                        "images": sum(len(s["images"]) for s in samples), "tiles": sum(i["tiles"] for s in samples for i in s["images"]),
                        "cu_seqlens": cu_seqlens(lengths), "samples": samples,
                    }
                    out_members = {"json": json.dumps(doc, ensure_ascii=False, sort_keys=True).encode(), **out_members}
                else:
                    (ref, sample, m), = loaded
                    key = ref.key
                    doc = {"tokens": sample["tokens"]["total"], "images": len(sample["images"]), "tiles": sum(i["tiles"] for i in sample["images"])}
                    out_members = {"json": json.dumps(sample, ensure_ascii=False, sort_keys=True).encode(), **m}
                writer.write_sample(key, out_members)
                pack_rows.append({"key": key, "tokens": doc["tokens"], "images": doc["images"], "tiles": doc["tiles"], "samples": len(loaded), "members": [r.key for r, _, _ in loaded]})
            writer.close()
    finally:
        for fh in handles.values():
            fh.close()
    records = writer.records
    result = PackShardResult(spec.index, tar_rel, ledger_rel, len(records), writer.bytes_written, hashing.sha.hexdigest(), records, pack_rows, 0.0)
    result.seconds = round(time.perf_counter() - start, 3)
    _write_pack_ledger(storage, result)
    return result


def cut_sample(sample: dict[str, Any], members: dict[str, bytes], turns: int | None, image_start: str) -> tuple[dict[str, Any], dict[str, bytes]]:
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
    from tasks.shards import MemberRecord

    out = []
    for r in table.select(["key", "offset", "length", "members"]).to_pylist():
        out.append(SampleRecord(r["key"], r["offset"], r["length"], tuple(MemberRecord(m["name"], m["offset"], m["size"]) for m in r["members"])))
    return out


def _write_pack_ledger(storage: Storage, result: PackShardResult) -> None:
    rows = []
    for rec, p in zip(result.records, result.packs):
        rows.append({"key": rec.key, "source": "packs", "row": None, "status": OK, "reason": None, "shard": result.tar, "offset": rec.offset, "length": rec.length, "members": rec.members_as_dicts(), "tokens": p["tokens"], "images": p["images"], "tiles": p["tiles"], "samples": p["samples"], "sample_keys": p["members"]})
    schema = pa.schema([("key", pa.string()), ("source", pa.string()), ("row", pa.int64()), ("status", pa.string()), ("reason", pa.string()), ("shard", pa.string()), ("offset", pa.int64()), ("length", pa.int64()), ("members", pa.list_(MEMBER_TYPE)), ("tokens", pa.int64()), ("images", pa.int32()), ("tiles", pa.int32()), ("samples", pa.int32()), ("sample_keys", pa.list_(pa.string()))])
    meta = {k: v for k, v in result.__dict__.items() if k not in ("records", "seconds", "skipped")}
    table = pa.Table.from_pylist(rows, schema=schema).replace_schema_metadata({b"shardsmith.finetune": json.dumps(meta).encode()})
    write_parquet(storage, result.ledger, table)
