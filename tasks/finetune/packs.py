"""Fine-tuning packs: the plan (text-only mix, padding cut-off, packing into output shards) and the shards that hold the packs."""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from tasks.finetune.packing import cu_seqlens, pack, pack_stats, pad_to_longest_ratio, padding_cutoff, truncate_at_turns
from tasks.finetune.samples import STAGE_VERSION
from tasks.formats.ledger import PACK_SCHEMA, SAMPLE_SCHEMA, read_parquet
from tasks.formats.names import digest_of
from tasks.formats.reasons import OK, status_of
from tasks.formats.recipe_finetune import FinetuneConfig
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.stages.runner import ShardResult, ShardRun, Verdict, records_of_layout

# The pack ledger's metadata key: the result of the shard it commits.
META_KEY = b"shardsmith.finetune"

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
    """Text-only mix, the padding cut-off (drop or truncate), then packing into output shards.

    The text-only share holds on what is released: the mix is chosen once before the cut-off
    (which is taken over it), and again after the cut-off and the pack caps have dropped
    samples, over the image records left; text-only records beyond it are rejected as
    ``text_only_over_ratio``, the same ones (by a hash of the key) both times.
    """
    table = (
        pa.concat_tables([t.select(PLAN_COLUMNS) for t in tables])
        if tables
        else pa.Table.from_pylist([], schema=SAMPLE_SCHEMA).select(PLAN_COLUMNS)
    )
    rows = table.to_pylist()
    ok = [r for r in rows if r["status"] == OK]
    ratio = cfg.text_only_ratio
    over_ratio = {"reason": "text_only_over_ratio", "detail": f"text_only_ratio {ratio}"}
    keep_text = _keep_text_only([r["key"] for r in ok if r["text_only"]], sum(not r["text_only"] for r in ok), ratio)
    pk = cfg.packing
    verdict: dict[str, dict[str, Any]] = {}
    for r in ok:
        if r["text_only"] and r["key"] not in keep_text:
            verdict[r["key"]] = over_ratio
    mixed = [r for r in ok if r["key"] not in verdict]
    cutoff = padding_cutoff([r["tokens_total"] for r in mixed], cfg.padding, pk.budget if pk.packed else None)
    refs: list[SampleRef] = []
    text_only: set[str] = set()
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
        if pk.packed and (ref.images > pk.max_images or (pk.max_tiles is not None and ref.tiles > pk.max_tiles)):
            verdict[r["key"]] = {
                "reason": "too_many_images",
                "detail": f"{ref.images} images / {ref.tiles} tiles over the pack caps",
            }
            continue
        if r["text_only"]:
            text_only.add(r["key"])
        refs.append(ref)
    # the share on what is released: image records the cut-off or the caps dropped leave less room
    keep_text = _keep_text_only(sorted(text_only), len(refs) - len(text_only), ratio)
    for key in text_only - keep_text:
        verdict[key] = over_ratio
    refs = [ref for ref in refs if ref.key not in verdict]
    truncated = sum(ref.turns is not None for ref in refs)
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


# One written output shard of packs: enough for the release indexes without reading it again;
# ``packs`` has one row per pack (or per sample when unpacked): key, tokens, images, tiles, samples.
@dataclass(frozen=True)
class PackShardResult(ShardResult):
    """A shard of packs: the shared fields, and ``packs``: one row per pack (or sample when
    unpacked): key, tokens, images, tiles, samples, members."""

    packs: list[dict[str, Any]] = field(default_factory=list)


# Fields of the result kept in the pack ledger's metadata (what a rerun returns), in this order.
META_FIELDS = ("index", "tar", "ledger", "samples", "bytes", "sha256", "packs")


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
        data = json.loads(t.schema.metadata[META_KEY])
        return PackShardResult(**data, sample_records=records_of_layout(t), skipped=True)
    handles: dict[str, Any] = {}
    pack_rows = []
    run = ShardRun(storage, tar_rel, ledger_rel, PACK_SCHEMA, order=None)
    try:
        with run.writing():
            for p, members in enumerate(spec.packs):
                loaded = []
                for ref in members:
                    fh = handles.get(ref.tar)
                    if fh is None:
                        fh = handles[ref.tar] = storage.open(ref.tar, "rb")
                    m = _load_sample(fh, ref)
                    sample, m = cut_sample(json.loads(m.pop("json")), m, ref.turns, cfg.tiling.image_start)
                    loaded.append((ref, sample, m))
                key, doc, out_members = _pack(spec.first_pack + p, loaded, cfg)
                pack = {k: doc[k] for k in ("tokens", "images", "tiles")}
                pack_rows.append({"key": key, **pack, "samples": len(loaded), "members": [r.key for r, _, _ in loaded]})
                row = {"key": key, "source": "packs", "row": None, "status": OK, "reason": None, **pack}
                run.add(
                    Verdict({**row, "samples": len(loaded), "sample_keys": [r.key for r, _, _ in loaded]}, out_members)
                )
    finally:
        for fh in handles.values():
            fh.close()
    result = PackShardResult(
        index=spec.index,
        tar=tar_rel,
        ledger=ledger_rel,
        samples=len(run.records),
        bytes=run.bytes_written,
        sha256=run.sha256,
        sample_records=run.records,
        packs=pack_rows,
        seconds=round(time.perf_counter() - start, 3),
    )
    meta = {name: getattr(result, name) for name in META_FIELDS}
    run.commit({META_KEY: json.dumps(meta).encode()})
    return result


def _pack(
    number: int, loaded: list[tuple[SampleRef, dict[str, Any], dict[str, bytes]]], cfg: FinetuneConfig
) -> tuple[str, dict[str, Any], dict[str, bytes]]:
    """One pack's key, its json document's counts and its members (one sample's when unpacked)."""
    if not cfg.packing.packed:
        ((ref, sample, m),) = loaded
        doc = {
            "tokens": sample["tokens"]["total"],
            "images": len(sample["images"]),
            "tiles": sum(i["tiles"] for i in sample["images"]),
        }
        return ref.key, doc, {"json": json.dumps(sample, ensure_ascii=False, sort_keys=True).encode(), **m}
    key = f"pack-{number:09d}"
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
    return key, doc, {"json": json.dumps(doc, ensure_ascii=False, sort_keys=True).encode(), **out_members}


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
