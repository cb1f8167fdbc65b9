"""Tiny releases for the loader tests, written with the Prefect-free release helpers (no tests here)."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from typing import Any

from tasks.formats.indexes import ShardIndexInput, all_indexes, dali_indexes
from tasks.formats.shards import ShardWriter
from tasks.formats.storage import Storage
from tasks.stages.release import commit_index, set_latest

LATENT_SHAPE = (4, 8, 8)
TEXT_SHAPE = (7, 5)
TILE = 32


def color_of(i: int) -> tuple[int, int, int]:
    """A colour per sample index, far enough apart to survive JPEG and resizing."""
    return (40 + (i * 37) % 180, 40 + (i * 71) % 180, 40 + (i * 13) % 180)


def jpeg(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def npy(array) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _write_shards(storage: Storage, base: str, shards: list[list[tuple[str, dict[str, bytes]]]], prefix: str = ""):
    """Write tars ``{prefix}shard-NNNNNN.tar``; returns (index.json entries, ShardIndexInputs)."""
    entries, inputs = [], []
    for j, samples in enumerate(shards):
        name = f"{prefix}shard-{j:06d}.tar"
        buf = io.BytesIO()
        with ShardWriter(buf) as writer:
            for key, members in samples:
                writer.write_sample(key, members)
        data = buf.getvalue()
        storage.write_bytes(f"{base}/{name}", data)
        entries.append(
            {"name": name, "samples": len(samples), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        )
        inputs.append(ShardIndexInput(name=name, size=len(data), samples=writer.records))
    return entries, inputs


def _commit(storage: Storage, dataset: str, version: str, index: dict[str, Any]) -> str:
    base = f"{dataset}/releases/{version}"
    commit_index(storage, f"{base}/index.json", index)
    set_latest(storage, dataset, version)
    return storage.url(dataset)


def pretraining_release(
    root: str,
    counts: list[int],
    *,
    dataset: str = "tiny",
    version: str = "v0001",
    latents: bool = False,
    storage_options: dict[str, Any] | None = None,
    image: Callable[[int], bytes] | None = None,
    logvar: float = -30,
) -> str:
    """A pretraining release with ``counts[j]`` samples in shard j; returns the dataset URL.

    Sample i (over the whole release) has key ``s-{i:06d}``, a JPEG of ``color_of(i)`` whose
    size varies with i, caption ``"caption {i}"``, and with ``latents`` a latent shard whose
    mean is filled with i (logvar ``logvar``: at -30 any draw is the mean) and text embeddings filled
    with i; the mask has i % 7 + 1 leading ones. ``image`` replaces the JPEG of sample i
    (the benchmark passes photo-like ones).
    """
    import numpy as np

    storage = Storage(root, storage_options)
    base = f"{dataset}/releases/{version}"
    shards, latent_shards = [], []
    i = 0
    for count in counts:
        samples, latent_samples = [], []
        for _ in range(count):
            key = f"s-{i:06d}"
            size = (48 + (i * 7) % 40, 40 + (i * 11) % 50)
            meta = {"key": key, "caption": f"caption {i}", "width": size[0], "height": size[1]}
            jpg = image(i) if image is not None else jpeg(size, color_of(i))
            samples.append((key, {"jpg": jpg, "txt": f"caption {i}".encode(), "json": json.dumps(meta).encode()}))
            mask = np.zeros(TEXT_SHAPE[0], np.uint8)
            mask[: i % 7 + 1] = 1
            latent_samples.append(
                (
                    key,
                    {
                        "latent_mean.npy": npy(np.full(LATENT_SHAPE, i, np.float16)),
                        "latent_logvar.npy": npy(np.full(LATENT_SHAPE, logvar, np.float16)),
                        "text_emb.npy": npy(np.full(TEXT_SHAPE, i, np.float16)),
                        "text_mask.npy": npy(mask),
                    },
                )
            )
            i += 1
        shards.append(samples)
        latent_shards.append(latent_samples)
    entries, inputs = _write_shards(storage, base, shards)
    for rel, data in all_indexes(inputs, name=dataset).items():
        storage.write_bytes(f"{base}/{rel}", data)
    index: dict[str, Any] = {
        "dataset": dataset,
        "kind": "pretraining",
        "version": version,
        "parent": None,
        "shards": entries,
        "totals": {"samples": sum(counts), "shards": len(counts), "bytes": sum(e["bytes"] for e in entries)},
        "schema": {"members": ["jpg", "json", "txt"], "image_format": "jpeg"},
        "indexes": {"dali": "*.idx", "energon": ".nv-meta/", "wids": "wids-index.json"},
    }
    if latents:
        lentries, linputs = _write_shards(storage, base, latent_shards, prefix="latents/")
        for rel, data in dali_indexes(linputs).items():
            storage.write_bytes(f"{base}/{rel}", data)
        for le, e in zip(lentries, entries):
            le["image_shard"] = e["name"]
        index["precache"] = {
            "shards": lentries,
            "encodings": {
                "image_latents": {
                    "members": ["latent_mean.npy", "latent_logvar.npy"],
                    "shape": list(LATENT_SHAPE),
                    "dtype": "float16",
                    "scaling_factor": 0.5,
                    "shift_factor": None,
                    "resolution": 64,
                    "store": "mean_logvar",
                    "model": "tiny-vae",
                },
                "text": {
                    "members": ["text_emb.npy", "text_mask.npy"],
                    "shape": list(TEXT_SHAPE),
                    "dtype": "float16",
                    "max_length": TEXT_SHAPE[0],
                    "model": "tiny-clip",
                },
            },
        }
    return _commit(storage, dataset, version, index)


def conversation_sample(i: int, rng) -> tuple[dict[str, Any], dict[str, bytes]]:
    """One fine-tuning record as the contract stores it: json and image members."""
    n_images = int(rng.integers(0, 4)) if i % 5 else 0
    images, members = [], {}
    image_tokens = 0
    for k in range(n_images):
        tiles = int(rng.integers(1, 4))
        tile_members = [f"i{k}.t{t:02d}.jpg" for t in range(tiles)]
        for t, m in enumerate(tile_members):
            members[m] = jpeg((TILE, TILE), color_of(i + t))
        members[f"i{k}.jpg"] = jpeg((TILE * 2, TILE), color_of(i))
        images.append(
            {
                "member": f"i{k}.jpg",
                "width": TILE * 2,
                "height": TILE,
                "grid": [1, tiles],
                "tiles": tiles,
                "thumbnail": False,
                "tile_members": tile_members,
            }
        )
        image_tokens += tiles * 16
    text = int(rng.integers(5, 120))
    record = {
        "key": f"c-{i:06d}",
        "id": f"rec{i}",
        "conversations": [
            {"from": "human", "value": "<tile_1> what is this? " * (1 + i % 3)},
            {"from": "gpt", "value": f"answer {i}"},
        ],
        "images": images,
        "tokens": {"text": text, "image": image_tokens, "total": text + image_tokens},
        "text_only": n_images == 0,
    }
    members["json"] = json.dumps(record).encode()
    return record, members


def finetuning_release(
    root: str,
    counts: list[int],
    *,
    packed_budget: int | None = None,
    max_images: int = 4,
    dataset: str = "chat",
    version: str = "v0001",
    pack: Callable[[list[dict[str, Any]], int, int], list[list[int]]] | None = None,
) -> tuple[str, list[dict[str, Any]]]:
    """A fine-tuning release; unpacked, or packed offline with ``packed_budget``.

    Returns (dataset URL, every record in release order). Packs are made by ``pack`` (record
    list, budget, max images -> lists of record positions), by default in arrival order.
    """
    import numpy as np

    rng = np.random.default_rng(7)
    storage = Storage(root)
    base = f"{dataset}/releases/{version}"
    records, shards = [], []
    i = 0
    for count in counts:
        samples = []
        for _ in range(count):
            record, members = conversation_sample(i, rng)
            records.append(record)
            samples.append((record["key"], members))
            i += 1
        shards.append(samples)
    if packed_budget is not None:
        flat = [s for shard in shards for s in shard]
        groups = (pack or _pack_in_order)(records, packed_budget, max_images)
        packs = []
        for p, group in enumerate(groups):
            members: dict[str, bytes] = {}
            cu = [0]
            samples_json = []
            for pos, r in enumerate(group):
                record = json.loads(json.dumps(records[r]))
                for ext, data in flat[r][1].items():
                    if ext != "json":
                        members[f"s{pos:03d}.{ext}"] = data
                for img in record["images"]:
                    img["member"] = f"s{pos:03d}.{img['member']}"
                    img["tile_members"] = [f"s{pos:03d}.{m}" for m in img["tile_members"] or []] or None
                samples_json.append(record)
                cu.append(cu[-1] + record["tokens"]["total"])
            key = f"pack-{p:09d}"
            members["json"] = json.dumps(
                {
                    "pack": key,
                    "budget": packed_budget,
                    "tokens": cu[-1],
                    "images": sum(len(s["images"]) for s in samples_json),
                    "tiles": 0,
                    "cu_seqlens": cu,
                    "samples": samples_json,
                }
            ).encode()
            packs.append((key, members))
        shards = [packs[k : k + 4] for k in range(0, len(packs), 4)]
    entries, inputs = _write_shards(storage, base, shards)
    for rel, data in all_indexes(inputs, sample_type="CrudeWebdataset").items():
        storage.write_bytes(f"{base}/{rel}", data)
    index = {
        "dataset": dataset,
        "kind": "finetuning",
        "version": version,
        "parent": None,
        "shards": entries,
        "totals": {"samples": sum(e["samples"] for e in entries), "shards": len(entries)},
        "schema": {
            "packed": packed_budget is not None,
            "budget": packed_budget or 512,
            "max_images": max_images,
            "max_tiles": 3,
            "tile_size": TILE,
            "tokens_per_tile": 16,
            "tags": {},
        },
    }
    return _commit(storage, dataset, version, index), records


def _pack_in_order(records: list[dict[str, Any]], budget: int, max_images: int) -> list[list[int]]:
    groups: list[list[int]] = [[]]
    tokens = images = 0
    for r, record in enumerate(records):
        t, n = record["tokens"]["total"], len(record["images"])
        if groups[-1] and (tokens + t > budget or images + n > max_images):
            groups.append([])
            tokens = images = 0
        groups[-1].append(r)
        tokens += t
        images += n
    return groups
