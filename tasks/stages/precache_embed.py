"""Precache's pooled image embeddings: read from curation's side shards when they hold them, encoded otherwise."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.compute as pc

from tasks.formats.ledger import read_parquet
from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.formats.storage import Storage
from tasks.models.batches import iter_pixels
from tasks.models.dual_encoder import load_encoder
from tasks.models.frozen import compute_dtypes, precache_device


def image_embeddings(
    storage: Storage, cfg: PrecacheConfig, shard: Any, local: Any
) -> tuple[dict[str, np.ndarray], bool]:
    """key -> L2-normalised image embedding for every sample of ``shard`` (a ``PrecacheInput``),
    and whether all of them came from curation's side shards (``shard.side_shards``).

    Samples the side shards do not hold (no curation with this model, a side shard gone, or one
    computed in another dtype than ``image_embedding``'s) are encoded from ``local`` (the shard
    and its DALI index on local disk), the whole shard at once.
    """
    device = precache_device(cfg)
    dtype = compute_dtypes(cfg, device)["image_embedding"]
    keys = [r.key for r in shard.records]
    wanted = set(keys)
    found: dict[str, np.ndarray] = {}
    for side in shard.side_shards:
        try:
            table = read_parquet(storage, side, ["key", "image"])
        except FileNotFoundError:
            continue
        if (table.schema.metadata or {}).get(b"shardsmith.compute_dtype", b"fp32").decode() != dtype:
            continue
        table = table.filter(pc.is_valid(table.column("image")))
        for key, vec in zip(table.column("key").to_pylist(), _rows(table.column("image"))):
            if key in wanted:
                found[key] = vec
    if all(k in found for k in keys):
        return found, True
    if cfg.image_embedding is None:
        raise ValueError("image_embeddings: precache.image_embedding is not configured")
    model = cfg.image_embedding.model
    enc, _ = load_encoder(model, None, None, device, dtype)
    for batch_keys, pixels in iter_pixels(local.tar, local.idx, len(keys), enc.preprocess, cfg, "precache.decode"):
        for key, vec in zip(batch_keys, enc.images(pixels)):
            found[key] = vec
    return found, False


def _rows(col: Any) -> np.ndarray:
    arr = col.combine_chunks()
    if len(arr) == 0:
        return np.zeros((0, 0), np.float32)
    return arr.values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(arr), arr.type.list_size)
