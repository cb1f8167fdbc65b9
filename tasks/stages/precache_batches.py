"""Batches of decoded images for the precache encoders, read with DALI through each shard's index."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.stages.precache_models import IMAGE_EXTS, PrecacheError

# ---------------------------------------------------------------------------------------------
# Decode: a DALI pipeline over one shard
# ---------------------------------------------------------------------------------------------


def decode_device(cfg: PrecacheConfig | Any, what: str = "precache.decode") -> str:
    """``mixed`` (nvJPEG on the GPU) or ``cpu``, from the recipe's ``decode`` setting (of the
    precache or curate config, named by ``what``) and what the worker has."""
    import torch

    if cfg.decode == "gpu":
        if not torch.cuda.is_available():
            raise PrecacheError(f"{what} is gpu but this worker sees no CUDA GPU")
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


def to_torch(tensor_list: Any) -> Any:
    """A DALI output as a torch tensor, without a copy where DLPack allows it."""
    import torch

    dense = tensor_list.as_tensor()
    if hasattr(dense, "__dlpack__"):
        try:
            return torch.from_dlpack(dense)
        except (RuntimeError, TypeError, BufferError):
            pass
    return torch.from_numpy(np.asarray(dense))


def pipeline_options(batch_size: int, prefetch: int, device: str) -> dict[str, Any]:
    """The settings of a DALI pipeline over one shard, decoding on ``device`` (``mixed``/``cpu``)."""
    return {
        "batch_size": batch_size,
        # Half the cores at most: on a CPU worker the encoders need the rest.
        "num_threads": max(1, min(4, (os.cpu_count() or 2) // 2)),
        "device_id": 0 if device == "mixed" else None,
        "prefetch_queue_depth": prefetch,
        "exec_dynamic": True,
    }


def read_shard(tar_path: str, idx_path: str, exts: list[str]) -> Any:
    """DALI's webdataset reader over one shard through its index, in shard order (the last batch
    padded); one output per entry of ``exts`` (``;``-separated alternatives)."""
    from nvidia.dali import fn

    return fn.readers.webdataset(
        paths=[tar_path],
        index_paths=[idx_path],
        ext=exts,
        missing_component_behavior="error",
        random_shuffle=False,
        pad_last_batch=True,
        name="reader",
    )


def iter_batches(
    tar_path: str,
    idx_path: str,
    count: int,
    cfg: PrecacheConfig,
    vision_size: int | None,
    vision_norm: tuple[list[float], list[float]] | None,
) -> Iterator[Batch]:
    """Batches of one shard in shard order: keys, captions, and the preprocessed images.

    The reader returns the encoded image too: its ``source_info`` names the tar member, so the
    key of every array is the key DALI actually read, not one assumed from position.
    """
    from nvidia.dali import fn, pipeline_def, types

    device = decode_device(cfg)
    want_images = cfg.image_latents is not None or vision_size is not None
    res = cfg.image_latents.resolution if cfg.image_latents else None

    @pipeline_def(**pipeline_options(cfg.batch_size, cfg.prefetch, device))
    def pipe():
        encoded, txt = read_shard(tar_path, idx_path, [IMAGE_EXTS, "txt"])
        outs = [encoded, txt]
        if want_images:
            images = fn.decoders.image(encoded, device=device, output_type=types.RGB)
            if res:
                vae = fn.resize(images, resize_shorter=res, antialias=True)
                outs.append(
                    fn.crop_mirror_normalize(
                        vae, crop=(res, res), mean=[127.5] * 3, std=[127.5] * 3, output_layout="CHW", dtype=types.FLOAT
                    )
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
        keys = [member_key(encoded[i].source_info()) for i in range(take)]
        captions = [bytes(np.asarray(txt[i])).decode("utf-8", "replace") for i in range(take)]
        batch = Batch(keys, captions)
        rest = list(outs[2:])
        if res:
            batch.vae_pixels = to_torch(rest.pop(0))[:take]
        if vision_size:
            batch.vision_pixels = to_torch(rest.pop(0))[:take]
        done += take
        yield batch
    del p


def member_key(source_info: str) -> str:
    """``/path/shard.tar:photos-000000036.jpg`` -> ``photos-000000036``."""
    member = source_info.rsplit(":", 1)[-1]
    return member.rsplit("/", 1)[-1].split(".", 1)[0]
