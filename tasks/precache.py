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
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from tasks.indexes import ShardIndexInput, dali_index_name, dali_indexes
from tasks.ledger import read_parquet, write_parquet
from tasks.recipe import PrecacheConfig
from tasks.shards import HashingWriter, MemberRecord, SampleRecord, ShardWriter
from tasks.storage import Storage

IMAGE_EXTS = "jpg;jpeg;png;webp"
STORAGE_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# Per-sample precache rows: the phase's ledger. ``aligned``: the key DALI read is the key the
# image shard holds at that position; ``finite``: every stored value of every encoding is finite.
LEDGER_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("source", pa.string()),
        ("shard", pa.string()),
        ("position", pa.int64()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("aligned", pa.bool_()),
        ("finite", pa.bool_()),
    ]
)


class PrecacheError(RuntimeError):
    """A precache that cannot run: a missing model, an unreadable shard, a model of a kind we do not know."""


@dataclass(frozen=True)
class PrecacheInput:
    """One resharded shard to precache.

    Args:
        tar: the shard's path under the storage root.
        sha256: its checksum (part of the output name, so a changed shard is precached again).
        records: the writer's sample records, in order (keys, and the DALI index built from them).
    """

    tar: str
    sha256: str
    records: tuple[SampleRecord, ...]


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

    def merge(self, other: "ChannelStats") -> "ChannelStats":
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


@dataclass
class PrecacheResult:
    """What one precache task reports: the latent shard, its records, and the gate's inputs.

    Args:
        image_shard: the input shard's path.
        tar: the latent shard's path; ``ledger``: its per-sample ledger (written last, commits it).
        encodings: per encoding, ``{"members", "shape", "dtype", ...}`` as index.json records it.
        stats: channel sums of the scaled image latents (``{"image_latents": ...}``), for the gate.
        timings: seconds spent loading models, decoding (waiting for DALI), encoding, writing.
    """

    image_shard: str
    tar: str
    ledger: str
    samples: int
    bytes: int
    sha256: str
    records: list[SampleRecord]
    encodings: dict[str, dict[str, Any]]
    stats: dict[str, ChannelStats]
    timings: dict[str, float]
    nonfinite: int = 0
    misaligned: int = 0
    skipped: bool = False


# ---------------------------------------------------------------------------------------------
# Models: loaded once per worker process
# ---------------------------------------------------------------------------------------------

_MODELS: dict[str, "Encoders"] = {}
_MODELS_LOCK = threading.Lock()


def _need_dir(path: str | None, what: str) -> Path:
    if not path or not Path(path).is_dir():
        raise PrecacheError(
            f"{what}: no model directory at {path!r}; models are never downloaded at run time, "
            "point the recipe at a local save_pretrained folder"
        )
    return Path(path)


def check_models(cfg: PrecacheConfig) -> None:
    """Fail before any work when a configured model or tokenizer folder is missing."""
    if cfg.image_latents:
        base = _need_dir(cfg.image_latents.model, "precache.image_latents.model")
        if cfg.image_latents.subfolder:
            _need_dir(str(base / cfg.image_latents.subfolder), "precache.image_latents.subfolder")
    if cfg.text:
        _need_dir(cfg.text.model, "precache.text.model")
        _need_dir(cfg.text.tokenizer or cfg.text.model, "precache.text.tokenizer")
    if cfg.vision:
        _need_dir(cfg.vision.model, "precache.vision.model")


def resolve_device(cfg: PrecacheConfig) -> str:
    """``cuda`` when asked for, or on ``auto`` when this worker sees a GPU; ``cpu`` otherwise."""
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise PrecacheError("precache.device is cuda but this worker sees no CUDA GPU")
    if cfg.device == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_dtype(name: str) -> Any:
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


class Encoders:
    """The frozen models a precache config names, on one device, in eval mode.

    Args:
        cfg: the recipe's precache config.
        device: ``cpu`` or ``cuda``. Models run in fp32 on the CPU (fp16 kernels there are slow
            or missing) and in the storage dtype on the GPU (bf16 -> bf16, fp16 -> fp16).
    """

    def __init__(self, cfg: PrecacheConfig, device: str) -> None:
        import torch

        check_models(cfg)
        self.cfg = cfg
        self.device = device
        self.compute_dtype = torch.float32 if device == "cpu" else _torch_dtype(cfg.dtype)
        self.vae = self.tokenizer = self.text = self.vision = None
        self.vision_mean = self.vision_std = None
        self.vision_size = None
        if cfg.image_latents:
            from diffusers import AutoencoderKL

            kw = {"subfolder": cfg.image_latents.subfolder} if cfg.image_latents.subfolder else {}
            # low_cpu_mem_usage needs accelerate, which we do not depend on for one load per worker.
            self.vae = AutoencoderKL.from_pretrained(
                cfg.image_latents.model, local_files_only=True, torch_dtype=self.compute_dtype, low_cpu_mem_usage=False, **kw
            )
            self.vae.to(device=device).eval().requires_grad_(False)
        if cfg.text:
            from transformers import AutoTokenizer

            kind = _model_type(cfg.text.model, "precache.text.model")
            model_class = _text_model_class(kind, cfg.text.model)
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.text.tokenizer or cfg.text.model, local_files_only=True)
            self.text = model_class.from_pretrained(cfg.text.model, local_files_only=True)
            self.text.to(device=device, dtype=self.compute_dtype).eval().requires_grad_(False)
        if cfg.vision:
            from transformers import AutoConfig

            model_class = _vision_model_class(_model_type(cfg.vision.model, "precache.vision.model"), cfg.vision.model)
            config = AutoConfig.from_pretrained(cfg.vision.model, local_files_only=True)
            self.vision = model_class.from_pretrained(cfg.vision.model, local_files_only=True)
            self.vision.to(device=device, dtype=self.compute_dtype).eval().requires_grad_(False)
            vcfg = getattr(config, "vision_config", config)
            self.vision_size = cfg.vision.resolution or int(vcfg.image_size)
            self.vision_mean, self.vision_std = _normalisation(Path(cfg.vision.model))

    # -- encoders on one batch; inputs are torch tensors on any device ----------------------

    def encode_images(self, pixels: Any, keys: list[str]) -> dict[str, Any]:
        """``pixels``: (B, 3, R, R) in [-1, 1]. Returns the stored arrays' tensors by member name."""
        import torch

        with torch.inference_mode():
            dist = self.vae.encode(pixels.to(self.device, self.compute_dtype)).latent_dist
            store = self.cfg.image_latents.store
            if store == "mean_logvar":
                return {"latent_mean.npy": dist.mean, "latent_logvar.npy": dist.logvar}
            if store == "mean":
                return {"latent.npy": dist.mean}
            # One draw per sample, seeded by its key, so a rerun stores the same sample.
            noise = torch.stack([torch.randn(dist.mean.shape[1:], generator=_key_generator(k)) for k in keys])
            return {"latent.npy": dist.mean + dist.std * noise.to(dist.mean.device, dist.mean.dtype)}

    def encode_text(self, captions: list[str]) -> dict[str, Any]:
        import torch

        tok = self.tokenizer(
            captions, padding="max_length", truncation=True, max_length=self.cfg.text.max_length, return_tensors="pt"
        )
        with torch.inference_mode():
            out = self.text(input_ids=tok["input_ids"].to(self.device), attention_mask=tok["attention_mask"].to(self.device))
        return {"text_emb.npy": out.last_hidden_state, "text_mask.npy": tok["attention_mask"].to(torch.uint8)}

    def encode_vision(self, pixels: Any) -> dict[str, Any]:
        import torch

        with torch.inference_mode():
            out = self.vision(pixel_values=pixels.to(self.device, self.compute_dtype))
        return {"vision_emb.npy": out.last_hidden_state}

    def describe(self) -> dict[str, dict[str, Any]]:
        """index.json's ``encodings`` entries, less the shapes (known after the first batch)."""
        out: dict[str, dict[str, Any]] = {}
        dtype = STORAGE_DTYPES[self.cfg.dtype]
        if self.vae is not None:
            il = self.cfg.image_latents
            members = ["latent_mean.npy", "latent_logvar.npy"] if il.store == "mean_logvar" else ["latent.npy"]
            out["image_latents"] = {
                "members": members,
                "dtype": dtype,
                "scaling_factor": float(self.vae.config.scaling_factor),
                "shift_factor": _maybe_float(getattr(self.vae.config, "shift_factor", None)),
                "resolution": il.resolution,
                "store": il.store,
                "model": Path(il.model).name + (f"/{il.subfolder}" if il.subfolder else ""),
            }
        if self.text is not None:
            out["text"] = {
                "members": ["text_emb.npy", "text_mask.npy"],
                "dtype": dtype,
                "mask_dtype": "uint8",
                "max_length": self.cfg.text.max_length,
                "model": Path(self.cfg.text.model).name,
            }
        if self.vision is not None:
            out["vision"] = {
                "members": ["vision_emb.npy"],
                "dtype": dtype,
                "resolution": self.vision_size,
                "model": Path(self.cfg.vision.model).name,
            }
        return out


def _maybe_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _key_generator(key: str) -> Any:
    import torch

    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def _model_type(path: str, what: str) -> str | None:
    """``model_type`` from a transformers folder's config.json (read before importing a class)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as err:
        raise PrecacheError(f"{what} {path}: no readable config.json ({err})") from None


def _text_model_class(kind: str, path: str) -> Any:
    import transformers

    classes = {"clip_text_model": "CLIPTextModel", "clip": "CLIPTextModel", "t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel", "siglip_text_model": "SiglipTextModel"}
    if kind not in classes:
        raise PrecacheError(f"precache.text.model {path}: model_type {kind!r} is not a known text encoder ({', '.join(sorted(classes))})")
    return getattr(transformers, classes[kind])


def _vision_model_class(kind: str, path: str) -> Any:
    import transformers

    classes = {"clip_vision_model": "CLIPVisionModel", "clip": "CLIPVisionModel", "siglip_vision_model": "SiglipVisionModel", "siglip": "SiglipVisionModel"}
    if kind not in classes:
        raise PrecacheError(f"precache.vision.model {path}: model_type {kind!r} is not a known vision encoder ({', '.join(sorted(classes))})")
    return getattr(transformers, classes[kind])


def _normalisation(path: Path) -> tuple[list[float], list[float]]:
    """The vision encoder's pixel mean and std, from its preprocessor config (CLIP's otherwise)."""
    pre = path / "preprocessor_config.json"
    if pre.exists():
        data = json.loads(pre.read_text())
        if "image_mean" in data and "image_std" in data:
            return [float(x) for x in data["image_mean"]], [float(x) for x in data["image_std"]]
    return [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def load_encoders(cfg: PrecacheConfig) -> tuple[Encoders, float]:
    """The worker's encoders for ``cfg``, loaded on first use; and the seconds the load took."""
    device = resolve_device(cfg)
    key = json.dumps([cfg.model_dump(mode="json"), device], sort_keys=True)
    with _MODELS_LOCK:
        if key in _MODELS:
            return _MODELS[key], 0.0
        start = time.perf_counter()
        enc = Encoders(cfg, device)
        _MODELS[key] = enc
        return enc, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Decode: a DALI pipeline over one shard
# ---------------------------------------------------------------------------------------------


def decode_device(cfg: PrecacheConfig) -> str:
    """``mixed`` (nvJPEG on the GPU) or ``cpu``, from the recipe and what the worker has."""
    import torch

    if cfg.decode == "gpu":
        if not torch.cuda.is_available():
            raise PrecacheError("precache.decode is gpu but this worker sees no CUDA GPU")
        return "mixed"
    if cfg.decode == "cpu":
        return "cpu"
    return "mixed" if torch.cuda.is_available() else "cpu"


@dataclass
class Batch:
    """One batch as the encoders take it; tensors live on the decode device."""

    keys: list[str]
    captions: list[str]
    vae_pixels: Any = None
    vision_pixels: Any = None


def _to_torch(tensor_list: Any) -> Any:
    """A DALI output as a torch tensor, without a copy where DLPack allows it."""
    import torch

    dense = tensor_list.as_tensor()
    if hasattr(dense, "__dlpack__"):
        try:
            return torch.from_dlpack(dense)
        except (RuntimeError, TypeError, BufferError):
            pass
    return torch.from_numpy(np.asarray(dense))


def iter_batches(
    tar_path: str, idx_path: str, count: int, cfg: PrecacheConfig, vision_size: int | None, vision_norm: tuple[list[float], list[float]] | None
) -> Iterator[Batch]:
    """Batches of one shard in shard order: keys, captions, and the preprocessed images.

    The reader returns the encoded image too: its ``source_info`` names the tar member, so the
    key of every array is the key DALI actually read, not one assumed from position.
    """
    from nvidia.dali import fn, pipeline_def, types

    device = decode_device(cfg)
    want_images = cfg.image_latents is not None or vision_size is not None
    res = cfg.image_latents.resolution if cfg.image_latents else None

    @pipeline_def(
        batch_size=cfg.batch_size,
        # Half the cores at most: on a CPU worker the encoders need the rest.
        num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)),
        device_id=0 if device == "mixed" else None,
        prefetch_queue_depth=cfg.prefetch,
        exec_dynamic=True,
    )
    def pipe():
        encoded, txt = fn.readers.webdataset(
            paths=[tar_path],
            index_paths=[idx_path],
            ext=[IMAGE_EXTS, "txt"],
            missing_component_behavior="error",
            random_shuffle=False,
            pad_last_batch=True,
            name="reader",
        )
        outs = [encoded, txt]
        if want_images:
            images = fn.decoders.image(encoded, device=device, output_type=types.RGB)
            if res:
                vae = fn.resize(images, resize_shorter=res, antialias=True)
                outs.append(
                    fn.crop_mirror_normalize(vae, crop=(res, res), mean=[127.5] * 3, std=[127.5] * 3, output_layout="CHW", dtype=types.FLOAT)
                )
            if vision_size:
                mean, std = vision_norm
                vis = fn.resize(images, resize_shorter=vision_size, antialias=True)
                outs.append(
                    fn.crop_mirror_normalize(
                        vis,
                        crop=(vision_size, vision_size),
                        mean=[m * 255 for m in mean],
                        std=[s * 255 for s in std],
                        output_layout="CHW",
                        dtype=types.FLOAT,
                    )
                )
        return tuple(outs)

    p = pipe()
    p.build()
    done = 0
    while done < count:
        outs = p.run()
        take = min(cfg.batch_size, count - done)
        encoded, txt = outs[0], outs[1]
        keys = [_member_key(encoded[i].source_info()) for i in range(take)]
        captions = [bytes(np.asarray(txt[i])).decode("utf-8", "replace") for i in range(take)]
        batch = Batch(keys, captions)
        rest = list(outs[2:])
        if res:
            batch.vae_pixels = _to_torch(rest.pop(0))[:take]
        if vision_size:
            batch.vision_pixels = _to_torch(rest.pop(0))[:take]
        done += take
        yield batch
    del p


def _member_key(source_info: str) -> str:
    """``/path/shard.tar:photos-000000036.jpg`` -> ``photos-000000036``."""
    member = source_info.rsplit(":", 1)[-1]
    return member.rsplit("/", 1)[-1].split(".", 1)[0]


# ---------------------------------------------------------------------------------------------
# One shard
# ---------------------------------------------------------------------------------------------


def output_names(cfg: PrecacheConfig, prefix: str, shard: PrecacheInput) -> tuple[str, str]:
    """The latent shard and its ledger, named by the input's checksum and the config."""
    blob = json.dumps([shard.sha256, cfg.model_dump(mode="json")], sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
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
    stored = t.to(_torch_dtype(dtype))
    back = stored.float().cpu().numpy()
    if dtype == "bf16":
        return stored.view(torch.int16).cpu().numpy().view("<u2"), back
    return stored.cpu().numpy(), back


class _LocalShard:
    """The shard as a local file with a DALI index beside it (DALI reads local paths only)."""

    def __init__(self, storage: Storage, shard: PrecacheInput) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="shardsmith-precache-")
        name = Path(shard.tar).name
        if storage.is_local:
            self.tar = storage.path(shard.tar)
        else:
            self.tar = os.path.join(self.tmp.name, name)
            storage.fs.get(storage.path(shard.tar), self.tar)
        size = os.path.getsize(self.tar)
        self.idx = os.path.join(self.tmp.name, dali_index_name(name))
        data = dali_indexes([ShardIndexInput(name=name, size=size, samples=shard.records)])[dali_index_name(name)]
        Path(self.idx).write_bytes(data)

    def close(self) -> None:
        self.tmp.cleanup()


def precache_shard(storage: Storage, cfg: PrecacheConfig, shard: PrecacheInput, prefix: str) -> PrecacheResult:
    """Encode one shard into its latent shard; a rerun whose ledger exists returns the record.

    Per sample, a ledger row: ``ok``, or ``error`` with ``nonfinite_encoding`` when any stored
    value is NaN or infinite (the gate then blocks the release). A key DALI read that is not
    the key at that position of the image shard is recorded (``aligned`` false) for the gate.
    """
    tar, ledger = output_names(cfg, prefix, shard)
    summary = summary_name(ledger)
    if storage.exists(ledger) and storage.exists(summary):
        return recorded(storage, summary)
    timings = {"load_s": 0.0, "decode_s": 0.0, "encode_s": 0.0, "write_s": 0.0, "total_s": 0.0}
    start = time.perf_counter()
    enc, timings["load_s"] = load_encoders(cfg)
    encodings = enc.describe()
    stats = {"image_latents": ChannelStats()} if "image_latents" in encodings else {}
    expected = [r.key for r in shard.records]
    rows: list[dict[str, Any]] = []
    local = _LocalShard(storage, shard)
    try:
        with storage.atomic_writer(tar) as raw:
            out = HashingWriter(raw)
            writer = ShardWriter(out)
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
                if enc.text is not None:
                    arrays.update(enc.encode_text(batch.captions))
                if enc.vision is not None:
                    arrays.update(enc.encode_vision(batch.vision_pixels))
                stored = {m: _stored(a, cfg.dtype) for m, a in arrays.items()}
                timings["encode_s"] += time.perf_counter() - t
                t = time.perf_counter()
                _record_shapes(encodings, stored)
                _add_stats(stats, encodings, stored)
                finite = np.ones(len(batch.keys), dtype=bool)
                for _, back in stored.values():
                    finite &= np.isfinite(back.reshape(len(batch.keys), -1)).all(axis=1)
                for i, key in enumerate(batch.keys):
                    writer.write_sample(key, {m: _npy(a[i]) for m, (a, _) in stored.items()})
                    pos = len(rows)
                    ok = bool(finite[i])
                    rows.append(
                        {
                            "key": key,
                            "source": key.rsplit("-", 1)[0],
                            "shard": tar,
                            "position": pos,
                            "status": "ok" if ok else "error",
                            "reason": None if ok else "nonfinite_encoding",
                            "aligned": pos < len(expected) and expected[pos] == key,
                            "finite": ok,
                        }
                    )
                timings["write_s"] += time.perf_counter() - t
                t = time.perf_counter()
            writer.close()
    finally:
        local.close()
    if len(rows) != len(expected):
        raise PrecacheError(f"{storage.url(shard.tar)}: DALI read {len(rows)} samples, the shard holds {len(expected)}")
    timings["total_s"] = time.perf_counter() - start
    result = PrecacheResult(
        image_shard=shard.tar,
        tar=tar,
        ledger=ledger,
        samples=len(rows),
        bytes=writer.bytes_written,
        sha256=out.sha.hexdigest(),
        records=writer.records,
        encodings=encodings,
        stats=stats,
        timings={k: round(v, 4) for k, v in timings.items()},
        nonfinite=sum(not r["finite"] for r in rows),
        misaligned=sum(not r["aligned"] for r in rows),
    )
    storage.write_bytes(summary, json.dumps(_summary_json(result), sort_keys=True).encode())
    write_parquet(storage, ledger, pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA))
    return result


def _record_shapes(encodings: dict[str, dict[str, Any]], stored: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Per encoding, the per-sample shape of its first member; a later batch that differs raises."""
    first = {"image_latents": ("latent_mean.npy", "latent.npy"), "text": ("text_emb.npy",), "vision": ("vision_emb.npy",)}
    for name, info in encodings.items():
        member = next(m for m in first[name] if m in stored)
        shape = list(stored[member][0].shape[1:])
        if "shape" in info and info["shape"] != shape:
            raise PrecacheError(f"{name}: per-sample shape changed within a shard ({info['shape']} -> {shape})")
        info["shape"] = shape


def _add_stats(stats: dict[str, ChannelStats], encodings: dict[str, dict[str, Any]], stored: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Channel sums of what training sees: image latents shifted and scaled as diffusers does."""
    if "image_latents" in stats:
        info = encodings["image_latents"]
        values = stored.get("latent_mean.npy", stored.get("latent.npy"))[1]
        shift = info["shift_factor"] or 0.0
        stats["image_latents"].add((values - shift) * info["scaling_factor"])


def _summary_json(r: PrecacheResult) -> dict[str, Any]:
    d = asdict(r)
    d["records"] = [{"key": s.key, "offset": s.offset, "length": s.length, "members": s.members_as_dicts()} for s in r.records]
    return d


def summary_name(ledger: str) -> str:
    """The JSON record written beside a latent shard's ledger (what a rerun returns)."""
    return ledger.removesuffix(".ledger.parquet") + ".json"


def recorded(storage: Storage, summary: str) -> PrecacheResult:
    """The result of a committed latent shard, from its JSON record."""
    d = json.loads(storage.read_bytes(summary))
    d["records"] = [
        SampleRecord(s["key"], s["offset"], s["length"], tuple(MemberRecord(m["name"], m["offset"], m["size"]) for m in s["members"]))
        for s in d["records"]
    ]
    d["stats"] = {k: ChannelStats(**v) for k, v in d["stats"].items()}
    d["skipped"] = True
    return PrecacheResult(**d)


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
    return pa.Table.from_pylist(
        rows, schema=pa.schema([("encoding", pa.string()), ("channel", pa.int64()), ("mean", pa.float64()), ("std", pa.float64()), ("values", pa.int64())])
    )


def shard_table(results: list[PrecacheResult], image_samples: dict[str, int]) -> pa.Table:
    """One row per latent shard: samples against its image shard's, and whether its shapes and
    dtypes agree with the first shard's (what index.json will record)."""
    reference = results[0].encodings if results else {}
    rows = []
    for r in results:
        same = all(r.encodings.get(k, {}).get("shape") == v.get("shape") and r.encodings.get(k, {}).get("dtype") == v.get("dtype") for k, v in reference.items())
        rows.append(
            {"shard": r.tar, "samples": r.samples, "image_samples": image_samples.get(r.image_shard, -1), "counts_match": r.samples == image_samples.get(r.image_shard, -1), "layout_match": same}
        )
    return pa.Table.from_pylist(
        rows,
        schema=pa.schema([("shard", pa.string()), ("samples", pa.int64()), ("image_samples", pa.int64()), ("counts_match", pa.bool_()), ("layout_match", pa.bool_())]),
    )


def read_ledgers(storage: Storage, results: list[PrecacheResult]) -> pa.Table:
    tables = [read_parquet(storage, r.ledger) for r in results]
    return pa.concat_tables(tables) if tables else LEDGER_SCHEMA.empty_table()
