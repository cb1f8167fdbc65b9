"""Fine-tuning samples: one per conversation record, with its images' tiles and token counts, and the names of outputs."""

from __future__ import annotations

import json
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
from tasks.formats.ledger import SAMPLE_SCHEMA, read_ledger_with, read_parquet
from tasks.formats.names import digest_of
from tasks.formats.reasons import OK, is_curation_reason, original_of, status_of
from tasks.formats.recipe_finetune import FinetuneConfig, TilingConfig, TokensConfig
from tasks.formats.storage import Storage
from tasks.stages.runner import ShardResult, Verdict, run_shard

STAGE_VERSION = 5  # bump when ingest or sample building changes, so outputs get new names


def image_source_name(source: str) -> str:
    """The derived image manifest's source name; its keys are ``{name}-{row:09d}``."""
    return f"{source}-img"


def image_key(source: str, image_row: int) -> str:
    return f"{image_source_name(source)}-{image_row:09d}"


# --- build samples ---------------------------------------------------------------------------


# One record chunk turned into unpacked samples: an intermediate tar and its table (its
# ``rows`` and ``ok`` come from the counts).
BuildResult = ShardResult


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


def _image_fates(tables: list[pa.Table], keys: set[str]) -> dict[str, dict[str, Any]]:
    """Final fate of each image key in ``tables`` (the image ledgers, ``_fate_tables``, in
    phase order): the last phase's row (curation's, else validation's, else the download's)
    decides status, reason and where the bytes are; the facts it lacks (``pixel_sha256``: a
    curation ledger has no such column) stay those of the phase before."""
    fates: dict[str, dict[str, Any]] = {}
    for t in tables:  # download ledgers first, then validate ones, then curate ones overwrite them
        t = t.filter(pc.is_in(t.column("key"), value_set=pa.array(sorted(keys), pa.string())))
        for r in t.to_pylist():
            before = fates.get(r["key"])
            if before is not None and r["pixel_sha256"] is None:
                r["pixel_sha256"] = before["pixel_sha256"]
            fates[r["key"]] = r
    return fates


def _fate_tables(storage: Storage, ledgers: list[str]) -> list[pa.Table]:
    """The columns of each image ledger a fate needs, read once for every key looked up in them."""
    cols = ["key", "status", "reason", "detail", "shard", "members"]
    return [read_ledger_with(storage, rel, cols, ["pixel_sha256"]) for rel in ledgers]


def shared(fate: dict[str, Any] | None, fates: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """An image's fate, or, for an exact duplicate (the same pixels) of a kept image, that
    image's: records that show the same picture share its one validated copy (LLaVA's
    conversations reuse COCO's images; validation keeps the first and refuses the others as
    ``duplicate_of``). A near duplicate keeps its own fate; so does an exact one of an image
    refused since (by curation), with that refusal in its detail."""
    original = original_of((fate or {}).get("reason"))
    if fate is None or original is None:
        return fate
    kept = fates.get(original)
    if kept is None or not kept["pixel_sha256"] or kept["pixel_sha256"] != fate["pixel_sha256"]:
        return fate
    if kept["status"] == OK:
        return kept
    why = kept["reason"] + (f" ({kept['detail']})" if kept.get("detail") else "")
    return dict(fate, detail=f"the same pixels as {original}, which was not kept: {why}")


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
    handles: dict[str, Any] = {}
    fates: dict[str, dict[str, Any]] = {}

    def records() -> list[dict[str, Any]]:
        chunk_records = read_parquet(storage, chunk).to_pylist()
        for rec in chunk_records:
            rec["image_rows"] = [first_image + r for r in rec["image_rows"] or []]
        want = {image_key(source, r) for rec in chunk_records for r in (rec["image_rows"] or [])}
        if want:
            tables = _fate_tables(storage, image_ledgers)
            fates.update(_image_fates(tables, want))
            # the originals of exact duplicates: in these ledgers too (the flow adds theirs)
            originals = {o for f in fates.values() if (o := original_of(f["reason"])) is not None} - fates.keys()
            fates.update(_image_fates(tables, originals) if originals else {})
        return chunk_records

    def decide(rec: dict[str, Any]) -> Verdict:
        row = {k: rec[k] for k in ("key", "source", "row", "status", "reason", "detail", "id")}
        row.update({k: rec.get(k) for k in ("personal_data", "privacy")})  # absent from older runs' records
        counter = _counter(cfg.tokens, cfg.tiling)  # loaded once per worker, and not for a committed shard
        row["tokenizer"] = counter.name
        members = _build_one(storage, rec, fates, cfg, counter, handles, row) if rec["status"] == OK else None
        row["status"] = status_of(row["reason"])
        return Verdict(row, members)

    try:
        return run_shard(
            storage, tar_rel, table_rel, records, decide, source=source, index=index, schema=SAMPLE_SCHEMA, order=None
        )
    finally:
        for fh in handles.values():
            fh.close()


def _read_image(storage: Storage, fate: dict[str, Any], handles: dict[str, Any]) -> tuple[bytes, str]:
    member = next(m for m in fate["members"] if m["name"].rsplit(".", 1)[-1] in ("jpg", "png", "webp"))
    fh = handles.get(fate["shard"])
    if fh is None:
        fh = handles[fate["shard"]] = storage.open(fate["shard"], "rb")
    fh.seek(member["offset"])
    return fh.read(member["size"]), member["name"].rsplit(".", 1)[-1]


def _build_one(
    storage, rec, fates, cfg: FinetuneConfig, counter: TokenCounter, handles, row
) -> dict[str, bytes] | None:
    """One accepted record's sample members, its counts put in ``row``; ``None`` (and the reason in ``row``) when an image fails."""
    tiling = cfg.tiling
    key = rec["key"]
    members: dict[str, bytes] = {}
    image_meta = []
    for n, r in enumerate(rec["image_rows"] or []):
        ikey = image_key(rec["source"], r)
        fate = shared(fates.get(ikey), fates)
        if fate is None or fate["status"] != OK:
            reason = "image_failed" if fate is None else fate["reason"]
            row["reason"] = "image_failed" if fate is None or status_of(reason) == "error" else "image_rejected"
            if fate is not None and is_curation_reason(reason):
                row["reason"] = reason  # the record's own content was judged: say so, not "image_rejected"
            row["detail"] = f"image {n} ({ikey}): {reason or 'no ledger row'}"
            if fate is not None and fate.get("detail"):
                row["detail"] += f" ({fate['detail']})"  # the score and threshold, the duplicate's original
            return None
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
            return None
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
    row.update(
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
    return members
