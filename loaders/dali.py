"""DALI pipelines over pretraining releases: decoded, resized images with captions and keys, or precached latents."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from loaders.release import Release, ReleaseError

__all__ = ["DaliLoader", "dali_pipeline", "default_device_id"]

READER = "Reader"
_LATENT_MEMBERS = (
    "latent_mean.npy",
    "latent_logvar.npy",
    "latent.npy",
    "text_emb.npy",
    "text_mask.npy",
    "vision_emb.npy",
)


def default_device_id() -> int | None:
    """GPU 0 when CUDA is usable, else None (DALI's CPU-only mode)."""
    try:
        import torch

        return 0 if torch.cuda.is_available() else None
    except ImportError:
        return None


def _local_paths(release: Release, names: list[str]) -> list[str]:
    paths = [release.local_path(n) for n in names]
    if any(p is None for p in paths):
        raise ReleaseError(f"{release.url}: DALI reads local files only; copy the release locally (or mount it) first")
    return paths  # type: ignore[return-value]


def dali_pipeline(
    release: Release,
    *,
    batch_size: int,
    latents: bool = False,
    image_size: int = 256,
    random_crop: bool = False,
    shard_id: int = 0,
    num_shards: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    initial_fill: int = 1024,
    num_threads: int = 2,
    device_id: int | None | str = "auto",
    latent_sample: bool = True,
    scale_latents: bool = True,
):
    """A built DALI pipeline reading a pretraining release with its ``.idx`` files.

    Images: ``fn.readers.webdataset`` (jpg + txt), decoded on the GPU (``mixed``) when
    ``device_id`` is a GPU, else on the CPU; resized so the short side is ``image_size`` and
    cropped to a square (center, or random with ``random_crop``). Outputs, in order: image
    uint8 ``(B, 3, S, S)``, caption bytes.

    Latents (``latents=True``): reads only ``latents/*.tar``; nothing is decoded but the
    ``.npy`` members (``fn.decoders.numpy``). Outputs: latent float32 ``(B, C, h, w)`` (a
    sample from mean and logvar, or the mean with ``latent_sample=False``; scaled as the
    release's ``scaling_factor``/``shift_factor`` say unless ``scale_latents=False``), then
    ``text_emb``, ``text_mask`` and ``vision_emb`` for the encodings present. bf16 encodings
    come out as uint16 bits (``DaliLoader`` views them as bfloat16).

    Args:
        release: an opened pretraining release on a local filesystem.
        batch_size: samples per batch.
        latents: read precached latents instead of images (default False).
        image_size: side of the square output (default 256).
        random_crop: random crop position instead of center (default False).
        shard_id, num_shards: this rank and the world size; DALI splits the samples into
            contiguous parts and pads the last batch, so every rank runs the same number of
            steps per epoch (default 0, 1).
        shuffle, seed, initial_fill: DALI's random_shuffle, its seed and its shuffle buffer
            size (defaults True, 0, 1024).
        num_threads: CPU threads (default 2).
        device_id: a GPU index, None for CPU only, or "auto" (default): GPU 0 when present.
        latent_sample, scale_latents: as for ``ReleaseDataset`` (defaults True, True).
    """
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali import math as dmath

    if release.kind != "pretraining":
        raise ReleaseError(f"{release.url}: a {release.kind} release; the DALI pipeline reads pretraining releases")
    if device_id == "auto":
        device_id = default_device_id()
    gpu = device_id is not None
    if latents:
        if not release.precache_shards:
            raise ReleaseError(f"{release.url}: latents=True but the release has no precached latents")
        shards = [release.latent_shard_for(s) for s in release.shards]
        enc = release.encodings
        ext: list[str] = []
        if "image_latents" in enc:
            ext += list(enc["image_latents"]["members"])
        for name in ("text", "vision"):
            if name in enc:
                ext += list(enc[name]["members"])
        unknown = [e for e in ext if e not in _LATENT_MEMBERS]
        if unknown:
            raise ReleaseError(f"{release.url}: unknown precached members {unknown}")
    else:
        shards = list(release.shards)
        ext = ["jpg", "txt"]
    paths = _local_paths(release, [s.name for s in shards])
    index_paths = _local_paths(release, [s.index_name for s in shards])

    @pipeline_def(
        batch_size=batch_size, num_threads=num_threads, device_id=device_id, seed=seed, prefetch_queue_depth=2
    )
    def pipe():
        outs = fn.readers.webdataset(
            paths=paths,
            index_paths=index_paths,
            ext=ext,
            missing_component_behavior="error",
            random_shuffle=shuffle,
            initial_fill=initial_fill,
            seed=seed,
            shard_id=shard_id,
            num_shards=num_shards,
            pad_last_batch=True,
            name=READER,
        )
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if not latents:
            jpg, txt = outs
            image = fn.decoders.image(jpg, device="mixed" if gpu else "cpu", output_type=types.RGB)
            image = fn.resize(image, resize_shorter=image_size)
            pos = (
                {"crop_pos_x": fn.random.uniform(range=(0.0, 1.0)), "crop_pos_y": fn.random.uniform(range=(0.0, 1.0))}
                if random_crop
                else {}
            )
            image = fn.crop_mirror_normalize(
                image, crop=(image_size, image_size), output_layout="CHW", dtype=types.UINT8, **pos
            )
            return image, txt
        by_ext = dict(zip(ext, outs))
        results = []
        if "image_latents" in enc:
            spec = enc["image_latents"]
            if "latent_mean.npy" in by_ext:
                mean = fn.cast(fn.decoders.numpy(by_ext["latent_mean.npy"]), dtype=types.FLOAT)
                if latent_sample:
                    logvar = fn.cast(fn.decoders.numpy(by_ext["latent_logvar.npy"]), dtype=types.FLOAT)
                    latent = mean + dmath.exp(logvar * 0.5) * fn.random.normal(mean)
                else:
                    latent = mean
            else:
                latent = fn.cast(fn.decoders.numpy(by_ext["latent.npy"]), dtype=types.FLOAT)
            if scale_latents:
                if spec.get("shift_factor") is not None:
                    latent = latent - float(spec["shift_factor"])
                latent = latent * float(spec.get("scaling_factor") or 1.0)
            results.append(latent)
        for member in ("text_emb.npy", "text_mask.npy", "vision_emb.npy"):
            if member in by_ext:
                results.append(fn.decoders.numpy(by_ext[member]))
        return tuple(results)

    p = pipe()
    p.build()
    return p


class DaliLoader:
    """Iterate a release through a DALI pipeline as batches of torch tensors, one epoch per loop.

    Every rank runs ``steps`` batches per epoch: ``ceil(ceil(samples / num_shards) /
    batch_size)``. DALI pads each rank's part by repeating its last sample; ``valid`` in each
    batch says how many leading samples are real, so an epoch over ``valid`` samples of all
    ranks sees every sample exactly once.

    Args:
        release: an opened pretraining release on a local filesystem.
        batch_size: samples per batch.
        **kwargs: passed to ``dali_pipeline`` (``latents``, ``image_size``, ``shard_id``,
            ``num_shards``, ``shuffle``, ``seed``, ``device_id``, ...).

    Batches: images mode ``{"image": uint8 (B, 3, S, S), "caption": [B str], "key": [B str],
    "valid": int}``; latents mode ``{"latent": float32 (B, C, h, w), "text_emb": (B, L, D),
    "text_mask": bool (B, L), "vision_emb": (B, ...), "key": [B str], "valid": int}`` (only
    the encodings present). Tensors are on the pipeline's GPU when it has one.
    """

    def __init__(self, release: Release, batch_size: int, **kwargs: Any) -> None:
        self.release = release
        self.batch_size = batch_size
        self.latents = bool(kwargs.get("latents", False))
        self.shard_id = int(kwargs.get("shard_id", 0))
        self.num_shards = int(kwargs.get("num_shards", 1))
        self.pipe = dali_pipeline(release, batch_size=batch_size, **kwargs)
        self.epoch = 0
        total = release.samples
        self.steps = math.ceil(math.ceil(total / self.num_shards) / batch_size)
        names = ["image", "caption"] if not self.latents else []
        if self.latents:
            enc = release.encodings
            names += ["latent"] if "image_latents" in enc else []
            names += ["text_emb", "text_mask"] if "text" in enc else []
            names += ["vision_emb"] if "vision" in enc else []
        self.names = names
        self._bf16 = {
            n
            for n, key in (("text_emb", "text"), ("vision_emb", "vision"))
            if release.encodings.get(key, {}).get("dtype") == "bfloat16"
        }

    def __len__(self) -> int:
        return self.steps

    def _part_size(self) -> int:
        # Without stick_to_shard, DALI moves each rank to the next part every epoch; part k
        # spans samples total*k//S .. total*(k+1)//S (DALI's start_index).
        total, parts = self.release.samples, self.num_shards
        k = (self.shard_id + self.epoch) % parts
        return total * (k + 1) // parts - total * k // parts

    def __iter__(self) -> Iterator[dict[str, Any]]:
        real = self._part_size()
        for step in range(self.steps):
            outputs = self.pipe.run()
            batch: dict[str, Any] = {}
            for name, out in zip(self.names, outputs):
                batch[name] = self._convert(name, out)
            batch["key"] = [_key_of(outputs[0][i].source_info()) for i in range(len(outputs[0]))]
            batch["valid"] = max(0, min(self.batch_size, real - step * self.batch_size))
            yield batch
        self.epoch += 1

    def _convert(self, name: str, out: Any) -> Any:
        import torch

        if name == "caption":
            cpu = out.as_cpu() if hasattr(out, "as_cpu") else out
            return [bytes(cpu.at(i)).decode("utf-8") for i in range(len(cpu))]
        if hasattr(out, "as_cpu") and _is_gpu(out):
            tensor = _gpu_to_torch(out)
        else:
            tensor = torch.from_numpy(out.as_array().copy())
        if name == "text_mask":
            tensor = tensor.bool()
        elif name in self._bf16:
            tensor = tensor.view(torch.bfloat16)
        return tensor


def _is_gpu(out: Any) -> bool:
    from nvidia.dali.backend import TensorListGPU

    return isinstance(out, TensorListGPU)


def _gpu_to_torch(out: Any):
    import torch
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    dense = out.as_tensor()
    tensor = torch.empty(dense.shape(), dtype=to_torch_type[dense.dtype], device="cuda")
    feed_ndarray(dense, tensor)
    return tensor


def _key_of(source_info: str) -> str:
    """``"/r/shard-000000.tar:1580544:art-000000048.jpg"`` -> ``"art-000000048"``."""
    member = source_info.rsplit(":", 1)[-1]
    return member.rpartition("/")[2].partition(".")[0]
