"""Fine-tuning releases in training: an online multimodal packer, a reader for offline packs, and their collate."""

from __future__ import annotations

import io
import json
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from torch.utils.data import IterableDataset

from loaders.dataset import ReleaseDataset
from loaders.release import Release, ReleaseError

__all__ = ["OnlinePacker", "finetuning_samples", "packed_dataset", "collate_packs", "pack_of"]

_DONE = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _parse_record(sample: dict[str, Any]) -> dict[str, Any]:
    """A raw unpacked sample -> ``{"key", "record", "members", "tokens", "images"}``."""
    record = json.loads(sample["json"])
    members = {ext: data for ext, data in sample.items() if ext not in ("key", "json")}
    return {
        "key": sample["key"],
        "record": record,
        "members": members,
        "tokens": int(record["tokens"]["total"]),
        "images": len(record.get("images") or []),
    }


def _parse_pack(sample: dict[str, Any]) -> dict[str, Any]:
    """A raw offline pack -> the same dict ``OnlinePacker`` yields."""
    meta = json.loads(sample["json"])
    meta["members"] = {ext: data for ext, data in sample.items() if ext not in ("key", "json")}
    return meta


def finetuning_samples(release: Release, **kwargs: Any) -> ReleaseDataset:
    """The samples of an unpacked fine-tuning release, as the packer takes them:
    ``{"key", "record" (the sample's json), "members" (ext -> bytes), "tokens", "images"}``.

    ``kwargs`` go to ``ReleaseDataset`` (rank, world_size, seed, shuffle, ...).
    """
    if release.kind != "finetuning" or release.packed:
        raise ReleaseError(
            f"{release.url}: not an unpacked fine-tuning release (kind={release.kind}, packed={release.packed})"
        )
    return ReleaseDataset(release, mode="raw", transform=_parse_record, **kwargs)


def packed_dataset(release: Release, **kwargs: Any) -> ReleaseDataset:
    """The packs of a release packed offline, one dict per pack, as ``OnlinePacker`` yields them.

    ``kwargs`` go to ``ReleaseDataset``; every rank gets the same number of packs.
    """
    if not release.packed:
        raise ReleaseError(f"{release.url}: not a packed fine-tuning release")
    return ReleaseDataset(release, mode="raw", transform=_parse_pack, **kwargs)


def pack_of(samples: list[dict[str, Any]], budget: int, index: int) -> dict[str, Any]:
    """Samples -> a pack dict in the release's packed format (members prefixed ``sNNN.``)."""
    members: dict[str, bytes] = {}
    cu = [0]
    records = []
    tiles = 0
    for pos, sample in enumerate(samples):
        prefix = f"s{pos:03d}."
        record = json.loads(json.dumps(sample["record"]))
        for ext, data in sample["members"].items():
            members[prefix + ext] = data
        for image in record.get("images") or []:
            image["member"] = prefix + image["member"]
            if image.get("tile_members"):
                image["tile_members"] = [prefix + m for m in image["tile_members"]]
            tiles += int(image.get("tiles") or 1)
        records.append(record)
        cu.append(cu[-1] + sample["tokens"])
    return {
        "pack": f"pack-{index:09d}",
        "budget": budget,
        "tokens": cu[-1],
        "images": sum(s["images"] for s in samples),
        "tiles": tiles,
        "cu_seqlens": cu,
        "samples": records,
        "members": members,
    }


# A dataclass: the constructor is the list of fields (identity equality, as for any dataset).
@dataclass(eq=False, repr=False)
class OnlinePacker(IterableDataset):
    """Pack fine-tuning samples at load time into packs of at most ``budget`` tokens and at most
    ``max_images`` images (MMDP's ConstantLengthDataset, with an image cap).

    A producer thread reads ``source`` into a bounded queue; the consumer keeps up to
    ``buffer_size`` pending samples and makes each pack from the oldest pending sample (so none
    waits forever) plus, first fit, the pending samples after it that still fit. Every sample
    ends in exactly one pack; when the source ends, the pending samples are packed too.
    ``collate_packs`` pads every pack to ``budget`` tokens.

    Args:
        source: an iterable of samples with ``tokens`` and ``images`` counts, e.g.
            ``finetuning_samples(release, ...)`` (already split across ranks and workers).
        budget: tokens per pack.
        max_images: images per pack.
        buffer_size: pending samples considered for each pack (default 64).
        queue_size: samples the producer may read ahead (default 256).
        oversize: a sample over the budget or image cap on its own: ``"error"`` raises
            (default), ``"skip"`` leaves it out and records its key in ``skipped``.
        num_packs: stop after this many packs per epoch, so every rank yields the same number
            (online packing gives ranks slightly different counts); the samples left over are
            not yielded this epoch (default None: pack everything).
    """

    source: Iterable[dict[str, Any]]
    budget: int
    max_images: int
    _: KW_ONLY
    buffer_size: int = 64
    queue_size: int = 256
    oversize: str = "error"
    num_packs: int | None = None
    skipped: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.budget < 1 or self.max_images < 0 or self.buffer_size < 1 or self.queue_size < 1:
            raise ValueError("budget, buffer_size and queue_size must be >= 1 and max_images >= 0")
        if self.oversize not in ("error", "skip"):
            raise ValueError(f"oversize={self.oversize!r}: use 'error' or 'skip'")

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Passed on to the source (``start`` counts the source's samples, not packs)."""
        set_epoch = getattr(self.source, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch, start)

    def _produce(self, q: queue.Queue, stop: threading.Event) -> None:
        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            for sample in self.source:
                if not put(sample):
                    return
            put(_DONE)
        except BaseException as err:  # handed to the consumer, which re-raises it
            put(_Failure(err))

    def _fits_alone(self, sample: dict[str, Any]) -> bool:
        if sample["tokens"] <= self.budget and sample["images"] <= self.max_images:
            return True
        if self.oversize == "error":
            raise ValueError(
                f"sample {sample['key']!r} has {sample['tokens']} tokens and {sample['images']} images; "
                f"a pack holds at most {self.budget} tokens and {self.max_images} images"
            )
        self.skipped.append(sample["key"])
        return False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        q: queue.Queue = queue.Queue(maxsize=self.queue_size)
        stop = threading.Event()
        producer = threading.Thread(target=self._produce, args=(q, stop), name="shardsmith-packer", daemon=True)
        producer.start()
        pending: list[dict[str, Any]] = []
        done = False
        made = 0
        try:
            while True:
                while not done and len(pending) < self.buffer_size:
                    item = q.get()
                    if item is _DONE:
                        done = True
                    elif isinstance(item, _Failure):
                        raise item.error
                    elif self._fits_alone(item):
                        pending.append(item)
                if not pending:
                    return
                if self.num_packs is not None and made >= self.num_packs:
                    return
                yield pack_of(self._take_pack(pending), self.budget, made)
                made += 1
        finally:
            stop.set()
            producer.join(timeout=5)

    def _take_pack(self, pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
        chosen = [0]
        tokens, images = pending[0]["tokens"], pending[0]["images"]
        for i in range(1, len(pending)):
            s = pending[i]
            if tokens + s["tokens"] <= self.budget and images + s["images"] <= self.max_images:
                chosen.append(i)
                tokens += s["tokens"]
                images += s["images"]
                if tokens == self.budget:
                    break
        out = [pending[i] for i in chosen]
        for i in reversed(chosen):
            del pending[i]
        return out


def _square(data: bytes, size: int):
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        if im.width * im.height > 50_000_000:
            raise ValueError(f"tile of {im.width}x{im.height} pixels is too large")
        im = im.convert("RGB")
        if im.size != (size, size):
            im = im.resize((size, size), Image.BICUBIC)
        return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).contiguous()


def collate_packs(packs: list[dict[str, Any]], tile_size: int = 448, budget: int | None = None) -> dict[str, Any]:
    """Packs (online or offline) -> tensors for varlen attention, every pack padded to ``budget``.

    Returns, for B packs of L = ``budget`` (default: the packs' own) tokens and N image tiles:
        ``position_ids`` int64 (B, L): 0.. within each sample, and within the padding;
        ``segment_ids`` int32 (B, L): the sample's position in its pack, -1 on padding;
        ``cu_seqlens`` int32 (S + 1,): boundaries over the flattened B * L tokens of every
        sample and of each pack's padding (as its own segment), for ``flash_attn_varlen``;
        ``max_seqlen`` int; ``tokens`` int64 (B,): real tokens per pack;
        ``pixel_values`` uint8 (N, 3, tile_size, tile_size): each image's tiles when stored,
        else the image resized to a tile; ``image_index`` int64 (N, 3): (pack, sample, image)
        of each tile; ``conversations`` and ``keys``: per pack, per sample.
    """
    import torch

    length = budget or max(int(p["budget"]) for p in packs)
    position = torch.zeros(len(packs), length, dtype=torch.int64)
    segment = torch.full((len(packs), length), -1, dtype=torch.int32)
    cu = [0]
    tiles, where = [], []
    for b, pack in enumerate(packs):
        bounds = pack["cu_seqlens"]
        if bounds[-1] > length:
            raise ValueError(f"{pack['pack']}: {bounds[-1]} tokens over the budget {length}")
        for s in range(len(bounds) - 1):
            lo, hi = bounds[s], bounds[s + 1]
            position[b, lo:hi] = torch.arange(hi - lo)
            segment[b, lo:hi] = s
            cu.append(b * length + hi)
        if bounds[-1] < length:
            position[b, bounds[-1] :] = torch.arange(length - bounds[-1])
            cu.append((b + 1) * length)
        for s, record in enumerate(pack["samples"]):
            for i, image in enumerate(record.get("images") or []):
                names = image.get("tile_members") or [image["member"]]
                for name in names:
                    tiles.append(_square(pack["members"][name], tile_size))
                    where.append((b, s, i))
    lengths = [hi - lo for lo, hi in zip(cu, cu[1:])]
    return {
        "position_ids": position,
        "segment_ids": segment,
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "max_seqlen": max(lengths) if lengths else 0,
        "tokens": torch.tensor([int(p["tokens"]) for p in packs], dtype=torch.int64),
        "pixel_values": torch.stack(tiles) if tiles else torch.zeros(0, 3, tile_size, tile_size, dtype=torch.uint8),
        "image_index": torch.tensor(where, dtype=torch.int64).reshape(-1, 3),
        "conversations": [[r["conversations"] for r in p["samples"]] for p in packs],
        "keys": [[r["key"] for r in p["samples"]] for p in packs],
    }
