"""Embeddings of one validated shard: images decoded by DALI, both towers in batches, one side shard out.

A side shard is a parquet file keyed like the samples (``key``, ``source``, ``row``) with the
L2-normalised ``image`` and ``text`` embeddings (float16), named by the dual encoder's digest
and the validated shard it describes: computed once, reused by every later run that reads the
same shard with the same model, whatever the thresholds.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.formats.ledger import read_parquet, write_parquet
from tasks.formats.names import digest_of
from tasks.formats.reasons import OK
from tasks.formats.recipe_curate import CurateConfig
from tasks.formats.storage import Storage
from tasks.models.batches import LocalShard, iter_pillow, iter_pixels
from tasks.models.dual_encoder import DualEncoder, load_encoder
from tasks.models.placement import CurateError, compute_dtype, resolve_device
from tasks.stages.runner import records_of_layout

CAPTION_EXT = ".txt"
LEDGER_COLUMNS = ["key", "source", "row", "status", "offset", "length", "members"]


@dataclass(frozen=True)
class EmbedResult:
    """One side shard: where it is, how many samples it holds, and what making it cost.

    Args:
        path: the side shard under the storage root.
        samples: rows (the validated shard's ok samples).
        embedded: samples embedded now (0 when an earlier run's side shard was reused).
        run: the run that embedded them.
        timings: seconds spent loading the model, decoding (waiting for DALI), encoding, writing.
    """

    path: str
    samples: int
    embedded: int
    run: str
    timings: dict[str, float] = field(default_factory=dict)


def embeddings_path(dataset: str, model_digest: str, ledger: str, dtype: str = "fp32") -> str:
    """The side shard of a validated shard (named by its ledger) for a model (by its digest)
    computing in ``dtype``: embeddings of another compute dtype are another set, never mixed."""
    stem = posixpath.basename(ledger).removesuffix(".ledger.parquet")
    return f"{dataset}/curate/embeddings/{model_digest[:16]}-{dtype}/{stem}-{digest_of(ledger)[:8]}.parquet"


def curate_placement(cfg: CurateConfig) -> tuple[str, str]:
    """(device, compute dtype) of the dual encoder on this worker, as ``curate.device`` and
    ``curate.compute_dtype`` say."""
    device = resolve_device(cfg.device, "curate.device", CurateError)
    return device, compute_dtype(cfg.compute_dtype, device)


def embedding_schema(dim: int, metadata: dict[str, str] | None = None) -> pa.Schema:
    vector = pa.list_(pa.float16(), dim)
    schema = pa.schema(
        [
            ("key", pa.string()),
            ("source", pa.string()),
            ("row", pa.int64()),
            ("image", vector),
            ("text", vector),
            ("error", pa.string()),  # why a sample has no image embedding (undecodable), else null
        ]
    )
    return schema.with_metadata(metadata) if metadata else schema


def stored_side_shard(storage: Storage, path: str, samples: int) -> EmbedResult | None:
    """The side shard an earlier run wrote, when it is there with one row per sample (read from
    its footer); ``None`` when it must be made (missing, or not what the shard holds)."""
    try:
        with storage.open(path, "rb") as fh:
            meta = pq.ParquetFile(fh).metadata
    except (FileNotFoundError, OSError, pa.ArrowInvalid):
        return None
    if meta.num_rows != samples:
        return None
    kv = {k.decode(): v.decode() for k, v in (meta.metadata or {}).items()}
    return EmbedResult(path, samples, 0, kv.get("shardsmith.run", ""))


def _vectors(values: np.ndarray, dim: int, valid: list[bool] | None = None) -> pa.Array:
    """Rows of ``values`` (N, dim) as float16 vectors; null where ``valid`` is False."""
    flat = pa.array(values.astype(np.float16).reshape(-1), pa.float16())
    mask = None if valid is None or all(valid) else pa.array([not v for v in valid])
    return pa.FixedSizeListArray.from_arrays(flat, dim, mask=mask)


def _captions(tar_path: str, rows: list[dict[str, Any]]) -> dict[str, str | None]:
    """Each sample's caption, read from its ``.txt`` member's byte range (``None`` without one)."""
    out: dict[str, str | None] = {}
    with open(tar_path, "rb") as fh:
        for r in rows:
            member = next((m for m in r["members"] if m["name"].endswith(CAPTION_EXT)), None)
            if member is None:
                out[r["key"]] = None
                continue
            fh.seek(member["offset"])
            out[r["key"]] = fh.read(member["size"]).decode("utf-8", "replace")
    return out


def embed_shard(storage: Storage, cfg: CurateConfig, tar: str, ledger: str, out: str, run: str) -> EmbedResult:
    """Embed the ok samples of one validated shard into the side shard ``out``; a side shard
    already there with one row per sample is returned as it is (``embedded`` 0)."""
    table = read_parquet(storage, ledger, LEDGER_COLUMNS)
    ok = table.filter(pc.equal(table.column("status"), OK))
    done = stored_side_shard(storage, out, ok.num_rows)
    if done is not None:
        return done
    timings = {"load_s": 0.0, "decode_s": 0.0, "encode_s": 0.0, "write_s": 0.0}
    start = time.perf_counter()
    device, dtype = curate_placement(cfg)
    enc, _ = load_encoder(cfg.model or "", cfg.tokenizer, cfg.max_length, device, dtype)
    timings["load_s"] = time.perf_counter() - start
    rows = sorted(ok.to_pylist(), key=lambda r: r["offset"])
    images: dict[str, np.ndarray] = {}
    texts: dict[str, np.ndarray] = {}
    failed: dict[str, str] = {}
    if rows:
        _embed_rows(storage, cfg, enc, tar, rows, images, texts, failed, timings)
    t = time.perf_counter()
    dim = next(iter(images.values())).shape[0] if images else enc.dim
    keys = ok.column("key").to_pylist()
    missing = [k for k in keys if k not in images and k not in failed]
    if missing:
        raise CurateError(f"{storage.url(tar)}: no image was read for {len(missing)} samples, e.g. {missing[:3]}")
    zero = np.zeros(dim, np.float32)
    image = np.stack([images.get(k, zero) for k in keys]) if keys else np.zeros((0, dim), np.float32)
    text = np.stack([texts.get(k, zero) for k in keys]) if keys else image
    meta = {
        "shardsmith.model": cfg.model or "",
        "shardsmith.run": run,
        "shardsmith.shard": tar,
        "shardsmith.compute_dtype": dtype,
    }
    side = pa.table(
        {
            "key": ok.column("key"),
            "source": ok.column("source"),
            "row": ok.column("row"),
            "image": _vectors(image, dim, [k in images for k in keys]),
            "text": _vectors(text, dim, [k in texts for k in keys]),
            "error": pa.array([failed.get(k) for k in keys], pa.string()),
        },
        schema=embedding_schema(dim, meta),
    )
    write_parquet(storage, out, side)
    timings["write_s"] = time.perf_counter() - t
    return EmbedResult(out, len(keys), len(keys), run, {k: round(v, 4) for k, v in timings.items()})


def _embed_rows(
    storage: Storage,
    cfg: CurateConfig,
    enc: DualEncoder,
    tar: str,
    rows: list[dict[str, Any]],
    images: dict[str, np.ndarray],
    texts: dict[str, np.ndarray],
    failed: dict[str, str],
    timings: dict[str, float],
) -> None:
    """Fill ``images`` and ``texts`` (key -> embedding) for the shard's ok ``rows``.

    DALI decodes the shard; when it fails on an image (a format or variant its decoder does not
    take, bytes kept as fetched by ``image.skip_reencode``), the shard is read again with Pillow
    one sample at a time, and a sample neither decodes is named in ``failed`` (its ledger row then
    says ``undecodable_image``): one bad image never takes its shard down.
    """
    layout = pa.Table.from_pylist(
        [{k: r[k] for k in ("key", "offset", "length", "members")} for r in rows],
        schema=pa.schema(
            [
                ("key", pa.string()),
                ("offset", pa.int64()),
                ("length", pa.int64()),
                ("members", pa.list_(pa.struct([("name", pa.string()), ("offset", pa.int64()), ("size", pa.int64())]))),
            ]
        ),
    )
    local = LocalShard(storage, tar, records_of_layout(layout))
    try:
        captions = _captions(local.tar, rows)
        try:
            _encode_images(enc, iter_pixels(local.tar, local.idx, len(rows), enc.preprocess, cfg), images, timings)
        except RuntimeError:
            images.clear()
            _encode_images(enc, iter_pillow(local.tar, rows, enc.preprocess, cfg.batch_size, failed), images, timings)
    finally:
        local.close()
    # The text tower once over the shard's captions, in batches formed by length (DualEncoder.texts).
    t = time.perf_counter()
    with_text = [r["key"] for r in rows if captions.get(r["key"]) and r["key"] in images]
    if with_text:
        texts.update(zip(with_text, enc.texts([captions[k] or "" for k in with_text], cfg.batch_size)))
    timings["encode_s"] += time.perf_counter() - t


def _encode_images(
    enc: DualEncoder, batches: Iterator[tuple[list[str], Any]], images: dict[str, np.ndarray], timings: dict[str, float]
) -> None:
    """The image tower over ``batches`` of (keys, pixels); the decode wait and the encoding timed apart."""
    t = time.perf_counter()
    for keys, pixels in batches:
        timings["decode_s"] += time.perf_counter() - t
        t = time.perf_counter()
        if keys:
            images.update(zip(keys, enc.images(pixels)))
        timings["encode_s"] += time.perf_counter() - t
        t = time.perf_counter()
