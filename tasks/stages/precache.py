"""Precaching: outputs of frozen encoders (VAE latents, caption and vision embeddings) per shard.

One resharded shard in, one latent shard out, with the same keys in the same order: DALI reads
the shard through its ``.idx`` (decoding on the GPU with ``mixed`` where there is one), the
encoders run on whole batches, and every array is written as a ``.npy`` member under the
sample's key. Models load once per worker process and stay loaded for the next shard.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tasks.formats.ledger import PRECACHE_SCHEMA, read_parquet
from tasks.formats.names import digest_of
from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.formats.shards import MemberRecord, SampleRecord
from tasks.formats.storage import Storage
from tasks.models.batches import LocalShard, iter_batches
from tasks.models.frozen import compute_dtypes, load_encoders, precache_device
from tasks.models.placement import PrecacheError, dtype_of
from tasks.stages.runner import ShardResult, ShardRun, Verdict
from tasks.video.clip_latents import encode_clips


@dataclass(frozen=True)
class PrecacheInput:
    """One resharded shard to precache.

    Args:
        tar: the shard's path under the storage root.
        sha256: its checksum (part of the output name, so a changed shard is precached again).
        records: the writer's sample records, in order (keys, and the DALI index built from them).
        side_shards: curation's stored embeddings that hold this shard's samples, when they are
            of ``precache.image_embedding``'s model (read instead of encoding again).
    """

    tar: str
    sha256: str
    records: tuple[SampleRecord, ...]
    side_shards: tuple[str, ...] = ()


@dataclass
class ChannelStats:
    """Running per-channel sums of one encoding, for the gate's mean and std checks."""

    count: int = 0
    sum: list[float] = field(default_factory=list)
    sumsq: list[float] = field(default_factory=list)

    def add(self, values: np.ndarray) -> None:
        """``values``: (batch, channels, ...) in float; non-finite values are left out of the sums."""
        x = np.moveaxis(values.astype(np.float64), 1, 0).reshape(values.shape[1], -1)
        x = np.where(np.isfinite(x), x, 0.0)
        if not self.sum:
            self.sum = [0.0] * x.shape[0]
            self.sumsq = [0.0] * x.shape[0]
        self.sum = [a + b for a, b in zip(self.sum, x.sum(axis=1).tolist())]
        self.sumsq = [a + b for a, b in zip(self.sumsq, (x * x).sum(axis=1).tolist())]
        self.count += x.shape[1]

    def merge(self, other: ChannelStats) -> ChannelStats:
        if not self.sum:
            return ChannelStats(other.count, list(other.sum), list(other.sumsq))
        if not other.sum:
            return ChannelStats(self.count, list(self.sum), list(self.sumsq))
        return ChannelStats(
            self.count + other.count,
            [a + b for a, b in zip(self.sum, other.sum)],
            [a + b for a, b in zip(self.sumsq, other.sumsq)],
        )

    def mean_std(self) -> list[tuple[float, float]]:
        out = []
        for s, q in zip(self.sum, self.sumsq):
            mean = s / self.count if self.count else 0.0
            var = max(q / self.count - mean * mean, 0.0) if self.count else 0.0
            out.append((mean, math.sqrt(var)))
        return out


# What one precache task reports: the latent shard (``tar``), its ledger (written last, commits
# it) and its records; ``image_shard``, the input; ``encodings``, per encoding ``{"members",
# "shape", "dtype", ...}`` as index.json records it; ``stats``, channel sums of the scaled image
# latents (``{"image_latents": ...}``) for the gate; ``timings``, seconds spent loading models,
# decoding (waiting for DALI), encoding and writing.
@dataclass(frozen=True)
class PrecacheResult(ShardResult):
    """A latent shard: the shared fields, and

    Args:
        image_shard: the resharded shard it encodes.
        encodings: per encoding its members, shape and dtype.
        stats: channel sums for the gate.
        timings: seconds per step.
        nonfinite, misaligned: rows with non-finite values, or keys out of line with the input.
    """

    image_shard: str = ""
    encodings: dict[str, dict[str, Any]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    nonfinite: int = 0
    misaligned: int = 0


# The result's fields in the JSON record beside the ledger (what a rerun returns).
SUMMARY_FIELDS = (
    *("image_shard", "tar", "ledger", "samples", "bytes", "sha256", "records"),
    *("encodings", "stats", "timings", "nonfinite", "misaligned", "skipped"),
)


# ---------------------------------------------------------------------------------------------
# One shard
# ---------------------------------------------------------------------------------------------


def placement(cfg: PrecacheConfig) -> dict[str, str]:
    """Per model block, the compute dtype it runs in on this worker (``auto`` resolved)."""
    return compute_dtypes(cfg, precache_device(cfg))


def output_names(
    cfg: PrecacheConfig, prefix: str, shard: PrecacheInput, dtypes: dict[str, str] | None = None
) -> tuple[str, str]:
    """The latent shard and its ledger, named by the input's checksum, the config and the
    compute dtypes (``placement``: outputs computed in another dtype are another shard)."""
    digest = digest_of(shard.sha256, cfg.model_dump(mode="json"), dtypes if dtypes is not None else placement(cfg))
    stem = Path(shard.tar).name.removesuffix(".tar")
    return f"{prefix}/{digest}/{stem}.tar", f"{prefix}/{digest}/{stem}.ledger.parquet"


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def _stored(t: Any, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(array to save, its float32 values as read back): bf16 is saved as its raw 16 bits."""
    import torch

    if t.dtype in (torch.uint8, torch.bool):
        a = t.to(torch.uint8).cpu().numpy()
        return a, a.astype(np.float32)
    stored = t.to(dtype_of(dtype))
    back = stored.float().cpu().numpy()
    if dtype == "bf16":
        return stored.view(torch.int16).cpu().numpy().view("<u2"), back
    return stored.cpu().numpy(), back


def precache_shard(
    storage: Storage, cfg: PrecacheConfig, shard: PrecacheInput, prefix: str, dtypes: dict[str, str] | None = None
) -> PrecacheResult:
    """Encode one shard into its latent shard; a rerun whose ledger exists returns the record.

    Per sample, a ledger row: ``ok``, or ``error`` with ``nonfinite_encoding`` when any stored
    value is NaN or infinite (the gate then blocks the release). A key DALI read that is not
    the key at that position of the image shard is recorded (``aligned`` false) for the gate.
    """
    tar, ledger = output_names(cfg, prefix, shard, dtypes)
    summary = summary_name(ledger)
    if storage.exists(ledger) and storage.exists(summary) and storage.exists(tar):
        return recorded(storage, summary, shard.tar)
    timings = {"load_s": 0.0, "decode_s": 0.0, "encode_s": 0.0, "write_s": 0.0, "total_s": 0.0}
    start = time.perf_counter()
    enc, timings["load_s"] = load_encoders(cfg)
    encodings = enc.describe()
    stats = {"image_latents": ChannelStats()} if "image_latents" in encodings else {}
    expected = [r.key for r in shard.records]
    by_key = {r.key: r for r in shard.records}
    run = ShardRun(storage, tar, ledger, PRECACHE_SCHEMA, order=None)
    local = LocalShard(storage, shard.tar, shard.records)
    vectors = None
    try:
        if cfg.image_embedding is not None:
            from tasks.stages.precache_embed import image_embeddings

            t = time.perf_counter()
            vectors, reused = image_embeddings(storage, cfg, shard, local)
            timings["embed_s"] = time.perf_counter() - t
            encodings["image_embedding"]["reused_from_curation"] = reused
        with run.writing():
            batches = iter_batches(
                local.tar,
                local.idx,
                len(expected),
                cfg,
                enc.vision_size,
                (enc.vision_mean, enc.vision_std) if enc.vision is not None else None,
            )
            t = time.perf_counter()
            for batch in batches:
                timings["decode_s"] += time.perf_counter() - t
                t = time.perf_counter()
                arrays: dict[str, Any] = {}
                if enc.vae is not None:
                    arrays.update(enc.encode_images(batch.vae_pixels, batch.keys))
                if cfg.clip_latents is not None:
                    arrays.update(encode_clips(enc, local.tar, by_key, batch.keys, cfg))
                if enc.text is not None:
                    arrays.update(enc.encode_text(batch.captions))
                if enc.vision is not None:
                    arrays.update(enc.encode_vision(batch.vision_pixels))
                if vectors is not None:
                    import torch

                    arrays["image_emb.npy"] = torch.from_numpy(np.stack([vectors[k] for k in batch.keys]))
                stored = {m: _stored(a, cfg.dtype) for m, a in arrays.items()}
                timings["encode_s"] += time.perf_counter() - t
                t = time.perf_counter()
                _record_shapes(encodings, stored)
                _add_stats(stats, encodings, stored)
                finite = np.ones(len(batch.keys), dtype=bool)
                for _, back in stored.values():
                    finite &= np.isfinite(back.reshape(len(batch.keys), -1)).all(axis=1)
                for i, key in enumerate(batch.keys):
                    pos = len(run.rows)
                    members = {m: _npy(a[i]) for m, (a, _) in stored.items()}
                    run.add(Verdict(_latent_row(key, members, bool(finite[i]), expected, pos), members))
                timings["write_s"] += time.perf_counter() - t
                t = time.perf_counter()
    finally:
        local.close()
    rows = run.rows
    if len(rows) != len(expected):
        raise PrecacheError(f"{storage.url(shard.tar)}: DALI read {len(rows)} samples, the shard holds {len(expected)}")
    timings["total_s"] = time.perf_counter() - start
    result = PrecacheResult(
        image_shard=shard.tar,
        tar=tar,
        ledger=ledger,
        samples=len(rows),
        bytes=run.bytes_written,
        sha256=run.sha256,
        sample_records=run.records,
        encodings=encodings,
        stats=stats,
        timings={k: round(v, 4) for k, v in timings.items()},
        nonfinite=sum(not r["finite"] for r in rows),
        misaligned=sum(not r["aligned"] for r in rows),
    )
    storage.write_bytes(summary, json.dumps(_summary_json(result), sort_keys=True).encode())
    run.commit()
    return result


def _latent_row(key: str, members: dict[str, bytes], finite: bool, expected: list[str], pos: int) -> dict[str, Any]:
    """A latent sample's ledger row; ``bytes`` and ``sha256`` are of its first member (in tar order)."""
    source, _, row = key.rpartition("-")
    first = members[min(members)]
    return {
        "key": key,
        "source": source,
        "row": int(row) if row.isdigit() else None,  # keys are {source}-{row:09d}; a folder source's row in its file
        "status": "ok" if finite else "error",
        "reason": None if finite else "nonfinite_encoding",
        "bytes": len(first),
        "sha256": hashlib.sha256(first).hexdigest(),
        "position": pos,
        "aligned": pos < len(expected) and expected[pos] == key,
        "finite": finite,
    }


def _record_shapes(encodings: dict[str, dict[str, Any]], stored: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Per encoding, the per-sample shape of its first member; a later batch that differs raises."""
    first = {
        "image_latents": ("latent_mean.npy", "latent.npy"),
        "clip_latents": ("clip_latent_mean.npy", "clip_latent.npy"),
        "text": ("text_emb.npy",),
        "vision": ("vision_emb.npy",),
        "image_embedding": ("image_emb.npy",),
    }
    for name, info in encodings.items():
        member = next(m for m in first[name] if m in stored)
        shape = list(stored[member][0].shape[1:])
        if "shape" in info and info["shape"] != shape:
            raise PrecacheError(f"{name}: per-sample shape changed within a shard ({info['shape']} -> {shape})")
        info["shape"] = shape


def _add_stats(
    stats: dict[str, ChannelStats],
    encodings: dict[str, dict[str, Any]],
    stored: dict[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    """Channel sums of what training sees: image latents shifted and scaled as diffusers does."""
    if "image_latents" in stats:
        info = encodings["image_latents"]
        values = stored.get("latent_mean.npy", stored.get("latent.npy"))[1]
        shift = info["shift_factor"] or 0.0
        stats["image_latents"].add((values - shift) * info["scaling_factor"])


def _summary_json(r: ShardResult) -> dict[str, Any]:
    d = {name: getattr(r, name) for name in SUMMARY_FIELDS}
    d["stats"] = {name: asdict(s) for name, s in r.stats.items()}
    d["records"] = [
        {"key": s.key, "offset": s.offset, "length": s.length, "members": s.members_as_dicts()} for s in r.records
    ]
    return d


def summary_name(ledger: str) -> str:
    """The JSON record written beside a latent shard's ledger (what a rerun returns)."""
    return ledger.removesuffix(".ledger.parquet") + ".json"


def recorded(storage: Storage, summary: str, image_shard: str) -> PrecacheResult:
    """The result of a committed latent shard, from its JSON record, for the input
    ``image_shard``. Latent shards are named by their input's content, so the record may come
    from a run whose reshard folder differed (another plan of the same samples): the result
    names this run's input, not the one recorded."""
    d = json.loads(storage.read_bytes(summary))
    d["image_shard"] = image_shard
    d["sample_records"] = [
        SampleRecord(
            s["key"],
            s["offset"],
            s["length"],
            tuple(MemberRecord(m["name"], m["offset"], m["size"]) for m in s["members"]),
        )
        for s in d.pop("records")
    ]
    d["stats"] = {k: ChannelStats(**v) for k, v in d["stats"].items()}
    d["skipped"] = True
    return PrecacheResult(**d)


# The gate's tables: per (encoding, channel) over all shards, and per latent shard.
CHANNEL_SCHEMA = pa.schema(
    dict(encoding=pa.string(), channel=pa.int64(), mean=pa.float64(), std=pa.float64(), values=pa.int64())
)
SHARD_CHECK_SCHEMA = pa.schema(
    dict(
        shard=pa.string(),
        samples=pa.int64(),
        image_samples=pa.int64(),
        counts_match=pa.bool_(),
        layout_match=pa.bool_(),
    )
)


def channel_table(results: list[PrecacheResult]) -> pa.Table:
    """One row per (encoding, channel) over all shards: mean and std, for the gate."""
    merged: dict[str, ChannelStats] = {}
    for r in results:
        for name, s in r.stats.items():
            merged[name] = merged.get(name, ChannelStats()).merge(s)
    rows = []
    for name, s in sorted(merged.items()):
        for ch, (mean, std) in enumerate(s.mean_std()):
            rows.append({"encoding": name, "channel": ch, "mean": mean, "std": std, "values": s.count})
    return pa.Table.from_pylist(rows, schema=CHANNEL_SCHEMA)


def shard_table(results: list[PrecacheResult], image_samples: dict[str, int]) -> pa.Table:
    """One row per latent shard: samples against its image shard's, and whether its shapes and
    dtypes agree with the first shard's (what index.json will record)."""
    reference = results[0].encodings if results else {}
    rows = []
    for r in results:
        same = all(
            r.encodings.get(k, {}).get("shape") == v.get("shape")
            and r.encodings.get(k, {}).get("dtype") == v.get("dtype")
            for k, v in reference.items()
        )
        rows.append(
            {
                "shard": r.tar,
                "samples": r.samples,
                "image_samples": image_samples.get(r.image_shard, -1),
                "counts_match": r.samples == image_samples.get(r.image_shard, -1),
                "layout_match": same,
            }
        )
    return pa.Table.from_pylist(rows, schema=SHARD_CHECK_SCHEMA)


def read_ledgers(storage: Storage, results: list[PrecacheResult]) -> pa.Table:
    tables = [read_parquet(storage, r.ledger) for r in results]
    return pa.concat_tables(tables) if tables else PRECACHE_SCHEMA.empty_table()
