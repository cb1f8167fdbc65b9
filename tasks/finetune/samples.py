"""Fine-tuning samples: one per conversation record, with its images' tiles and token counts, and the names of outputs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tasks.finetune.conversations import render_turns
from tasks.finetune.tiling import (
    TilingError,
    all_tags,
    choose_grid,
    image_size,
    open_capped,
    tag_text,
    tile_count,
    tile_image,
    tile_members,
)
from tasks.finetune.tokens import TokenCounter, load_counter
from tasks.formats.ledger import MEMBER_TYPE, read_parquet, write_parquet
from tasks.formats.names import digest_of
from tasks.formats.reasons import OK, status_of
from tasks.formats.recipe_finetune import FinetuneConfig, TilingConfig, TokensConfig
from tasks.formats.shards import ShardWriter
from tasks.formats.storage import Storage

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


def build_paths(
    dataset: str, source: str, index: int, chunk: str, cfg: FinetuneConfig, image_ledgers: list[str]
) -> tuple[str, str]:
    digest = digest_of(
        chunk, cfg.tiling, cfg.tokens, cfg.conversation.placeholder, sorted(image_ledgers), STAGE_VERSION
    )
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
    storage: Storage,
    source: str,
    index: int,
    chunk: str,
    first_image: int,
    image_ledgers: list[str],
    cfg: FinetuneConfig,
    tar_rel: str,
    table_rel: str,
) -> BuildResult:
    """Per record: join its images' fates, tile, tag, count tokens; write the sample and its row.

    ``first_image``: the image manifest row of the chunk's first image (its ``image_rows``
    count from there). ``image_ledgers``: the download then validate ledgers that hold them.
    """
    start = time.perf_counter()
    if storage.exists(table_rel):
        t = read_parquet(storage, table_rel, ["status"])
        return BuildResult(
            source,
            index,
            tar_rel,
            table_rel,
            t.num_rows,
            int(pc.sum(pc.equal(t.column("status"), OK)).as_py() or 0),
            0.0,
            True,
        )
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


def _build_one(
    storage, rec, fates, cfg: FinetuneConfig, counter: TokenCounter, writer: ShardWriter, handles, row
) -> None:
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
        image_meta.append(
            {
                "member": f"i{n}.{ext}",
                "width": w,
                "height": h,
                "grid": list(grid),
                "tiles": tile_count(grid, tiling),
                "thumbnail": tile_count(grid, tiling) > grid[0] * grid[1],
                "tile_members": tile_names,
            }
        )
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
        offset=sr.offset,
        length=sr.length,
        members=sr.members_as_dicts(),
        text_only=not image_meta,
        images=len(image_meta),
        tiles=sum(m["tiles"] for m in image_meta),
        tokens_text=tokens_text,
        tokens_image=tokens_image,
        tokens_total=tokens_text + tokens_image,
        turn_tokens=turn_tokens,
        turn_images=turn_images,
        turn_tiles=turn_tiles,
        tags_ok=sum(t.count(tiling.image_start) for t in rendered) == len(image_meta),
    )
