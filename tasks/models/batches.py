"""Batches of decoded images for the encoders: DALI through each shard's index (nvJPEG on a GPU
worker), or Pillow one sample at a time where DALI cannot decode an image."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.formats.indexes import ShardIndexInput, dali_index_name, dali_indexes
from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.formats.shards import SampleRecord
from tasks.formats.storage import Storage
from tasks.models.placement import IMAGE_EXTS, decode_device
from tasks.models.preprocess import Preprocess, pillow_pixels


class LocalShard:
    """A shard as a local file with a DALI index beside it (DALI reads local paths only).

    Args:
        storage: where the shard is.
        tar: its path under the storage root (copied to a temporary folder unless local).
        records: its sample records, in order (the index is built from them).
    """

    def __init__(self, storage: Storage, tar: str, records: tuple[SampleRecord, ...] | list[SampleRecord]) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="shardsmith-shard-")
        name = Path(tar).name
        if storage.is_local:
            self.tar = storage.path(tar)
        else:
            self.tar = os.path.join(self.tmp.name, name)
            storage.fs.get(storage.path(tar), self.tar)
        size = os.path.getsize(self.tar)
        self.idx = os.path.join(self.tmp.name, dali_index_name(name))
        data = dali_indexes([ShardIndexInput(name=name, size=size, samples=tuple(records))])[dali_index_name(name)]
        Path(self.idx).write_bytes(data)

    def close(self) -> None:
        self.tmp.cleanup()


# ---------------------------------------------------------------------------------------------
# Decode: a DALI pipeline over one shard
# ---------------------------------------------------------------------------------------------


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


def iter_pixels(
    tar_path: str, idx_path: str, count: int, pre: Preprocess, cfg: Any, what: str = "curate.decode"
) -> Iterator[tuple[list[str], Any]]:
    """(keys, pixels) batches of one shard in shard order for a dual encoder's image tower:
    DALI decodes, resizes (and crops) and normalises ahead of the encoder. ``cfg``: a config
    with ``batch_size``, ``prefetch`` and ``decode`` (curate's, or precache's)."""
    from nvidia.dali import fn, pipeline_def, types

    device = decode_device(cfg, what)
    size = pre.size

    @pipeline_def(**pipeline_options(cfg.batch_size, cfg.prefetch, device))
    def pipe():
        encoded = read_shard(tar_path, idx_path, [IMAGE_EXTS])
        images = fn.decoders.image(encoded, device=device, output_type=types.RGB)
        if pre.center_crop:
            images = fn.resize(images, resize_shorter=size, antialias=True)
        else:
            images = fn.resize(images, resize_x=size, resize_y=size, antialias=True)
        pixels = fn.crop_mirror_normalize(
            images,
            crop=(size, size),
            mean=[m * 255 for m in pre.mean],
            std=[s * 255 for s in pre.std],
            output_layout="CHW",
            dtype=types.FLOAT,
        )
        return encoded, pixels

    p = pipe()
    p.build()
    done = 0
    try:
        while done < count:
            encoded, pixels = p.run()
            take = min(cfg.batch_size, count - done)
            keys = [member_key(encoded[i].source_info()) for i in range(take)]
            done += take
            yield keys, to_torch(pixels)[:take]
    finally:
        del p


def iter_pillow(
    tar_path: str, rows: list[dict[str, Any]], pre: Preprocess, batch: int, failed: dict[str, str]
) -> Iterator[tuple[list[str], Any]]:
    """(keys, pixels) batches decoded by Pillow, one sample at a time (``rows``: ledger rows
    with their ``members``); a sample that does not decode goes into ``failed`` with the error,
    and the others go on."""
    import torch

    # The bytes passed validation's caps (pixels read from the header before any decode).
    keys: list[str] = []
    arrays: list[np.ndarray] = []
    mean = np.array(pre.mean, np.float32)[:, None, None]
    std = np.array(pre.std, np.float32)[:, None, None]
    with open(tar_path, "rb") as fh:
        for r in rows:
            member = next((m for m in r["members"] if m["name"].rsplit(".", 1)[-1] in IMAGE_EXTS.split(";")), None)
            try:
                if member is None:
                    raise ValueError("the sample has no image member")
                fh.seek(member["offset"])
                arrays.append((pillow_pixels(fh.read(member["size"]), pre) - mean) / std)
                keys.append(r["key"])
            except Exception as err:  # noqa: BLE001 - one sample's failure is its own row
                failed[r["key"]] = f"{type(err).__name__}: {err}"
            if len(keys) == batch:
                yield keys, torch.from_numpy(np.stack(arrays))
                keys, arrays = [], []
    if keys:
        yield keys, torch.from_numpy(np.stack(arrays))
