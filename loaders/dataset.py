"""A torch IterableDataset over a release: equal samples per rank, seeded shuffles, resumable."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

# The one import of torch at module level: the class below subclasses it. loaders.release
# stays torch-free, so opening a release does not pay for it.
from torch.utils.data import IterableDataset

from loaders.latents import decode_latent_block, load_npy
from loaders.release import IndexEntry, Release, ReleaseError, ShardInfo
from tasks.formats.shards import iter_samples
from tasks.formats.tar_reader import ShardError

__all__ = ["ReleaseDataset", "EpochPlan", "plan_epoch", "collate_images", "collate_latents", "decode_image", "load_npy"]
from loaders.clips import collate_clips, decode_clip
from loaders.decode import DEFAULT_MAX_PIXELS, collate_images, collate_latents, decode_image
from loaders.epochs import EVEN, EpochPlan, plan_epoch

MODES = ("images", "latents", "raw", "clips")

# ---------------------------------------------------------------------------------------------
# The dataset
# ---------------------------------------------------------------------------------------------


class ReleaseDataset(IterableDataset):
    """Stream a release's samples for one rank; DataLoader workers split the rank's share.

    Every (rank, worker) slot gets the same number of samples per epoch (see ``plan_epoch``),
    so no rank runs out of batches first and DDP never hangs on an uneven last step. Shards are
    shuffled per epoch by ``(seed, epoch)``; within a slot, samples are shuffled in blocks of
    ``shuffle_buffer`` consecutive samples, each block permuted by ``(seed, epoch, slot,
    block)``. Since every step is a function of those numbers, ``start`` resumes an epoch
    exactly: whole blocks are skipped by seeking, never read.

    Args:
        release: an opened ``Release``.
        mode: ``"images"`` (pretraining: decoded image, caption, metadata), ``"latents"``
            (the precached encodings; image shards are not read), ``"raw"`` (``{"key",
            ext: bytes}``, e.g. for fine-tuning releases) or ``"clips"`` (a release of video
            clips: ``frames``, uint8 ``(clip_frames, 3, S, S)``, ``frames_real``, caption,
            metadata) (default ``"images"``).
        clip_frames, clip_fps: in clips mode, frames per clip and the rate they are taken at
            (``None``: every frame as encoded); a shorter clip repeats its last frame
            (``frames_real`` says how many are its own) (default 16 at 8 fps).
        image_size: side of the square crop in ``"images"`` mode; None keeps the stored size
            (default 256).
        rank, world_size: this process's place in distributed training (default: from
            ``torch.distributed`` when it is initialised, else 0 and 1).
        seed: seeds shard order, block shuffles and latent sampling (default 0).
        shuffle: shuffle shards and blocks (default True); False reads in release order.
        shuffle_buffer: samples per shuffled block (default 256; 1 means no shuffling inside
            a slot). Memory holds one block of raw samples per worker.
        even: ``"drop"`` (each epoch leaves out fewer samples than there are slots) or
            ``"pad"`` (repeats as many to fill the last slots) (default ``"drop"``).
        batch_size: when set, the dataset yields collated batches (use ``DataLoader(ds,
            batch_size=None)``), and ``start`` maps exactly onto workers, which DataLoader
            serves in turn one batch each (default None: samples).
        collate_fn: turns a list of samples into a batch (default: ``collate_images``,
            ``collate_latents`` or a plain list, by mode).
        drop_last: with ``batch_size``, drop each worker's last partial batch (default False).
        latent_sample: for latents stored as mean and logvar, draw ``mean + exp(logvar / 2) *
            noise``, the noise of each block of ``shuffle_buffer`` samples drawn at once, seeded
            by ``(seed, epoch, slot, block)`` like the block's shuffle; False returns the mean
            (default True).
        scale_latents: return ``(latent - shift_factor) * scaling_factor`` as diffusers
            training scripts feed the model; False returns the raw VAE output (default True).
        with_captions: in latents mode, also read each caption by a byte-range read of the
            image shard's ``txt`` member (default False).
        transform: applied to every sample dict after decoding (default None).
        max_pixels: images larger than this (from the header) raise before decoding
            (default 50,000,000).
    """

    def __init__(
        self,
        release: Release,
        *,
        mode: str = "images",
        image_size: int | None = 256,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 256,
        even: str = "drop",
        batch_size: int | None = None,
        collate_fn: Callable[[list[dict[str, Any]]], Any] | None = None,
        drop_last: bool = False,
        latent_sample: bool = True,
        scale_latents: bool = True,
        with_captions: bool = False,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        clip_frames: int = 16,
        clip_fps: float | None = 8.0,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: use one of {MODES}")
        if even not in EVEN:
            raise ValueError(f"even={even!r}: use one of {EVEN}")
        if shuffle_buffer < 1:
            raise ValueError("shuffle_buffer must be >= 1")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if mode == "latents" and not release.precache_shards:
            raise ReleaseError(f"{release.url}: mode='latents' but the release has no precached encodings")
        if rank is None or world_size is None:
            rank, world_size = _dist_rank_world()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.release = release
        self.mode = mode
        self.image_size = image_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_buffer = shuffle_buffer if shuffle else 1
        self.even = even
        self.batch_size = batch_size
        if clip_frames < 1 or (clip_fps is not None and clip_fps <= 0):
            raise ValueError("clip_frames must be >= 1 and clip_fps > 0")
        self.clip_frames, self.clip_fps = clip_frames, clip_fps
        collates = {"images": collate_images, "latents": collate_latents, "clips": collate_clips}
        self.collate_fn = collate_fn or collates.get(mode, list)
        self.drop_last = drop_last
        self.latent_sample = latent_sample
        self.scale_latents = scale_latents
        self.with_captions = with_captions
        self.transform = transform
        self.max_pixels = max_pixels
        self.epoch = 0
        self.start = 0
        self._indexes: dict[str, list[IndexEntry]] = {}
        self._by_key: dict[str, dict[str, IndexEntry]] = {}

    # -- epoch control ---------------------------------------------------------------------

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch (shard order, shuffles) and resume it after ``start`` samples this
        rank has already consumed (a multiple of ``batch_size`` when batching with workers)."""
        if start < 0:
            raise ValueError("start must be >= 0")
        self.epoch = epoch
        self.start = start

    def plan(self, num_workers: int = 1) -> EpochPlan:
        """This epoch's plan for ``num_workers`` DataLoader workers per rank."""
        return plan_epoch(
            [s.samples for s in self.release.shards],
            world_size=self.world_size,
            num_workers=num_workers,
            epoch=self.epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            even=self.even,
        )

    def samples_per_rank(self, num_workers: int = 1) -> int:
        """Samples each rank yields per epoch (before ``start``), with ``num_workers`` workers."""
        return self.plan(num_workers).per_slot * num_workers

    def __len__(self) -> int:
        # Without workers; DataLoader with workers counts batches per worker anyway.
        n = self.samples_per_rank(1)
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.iter_worker(worker, num_workers)

    def _resume_point(self, worker: int, num_workers: int, per_slot: int) -> tuple[int, int]:
        """(role, skip): which worker's share worker ``worker`` reads after ``self.start``
        samples of the rank were consumed, and how many of that share are done.

        DataLoader hands out batches from its workers in turn, one each, and every share here
        has the same number of batches, so the rank's batch ``b`` came from share ``b %
        num_workers``. A resumed DataLoader starts its turn at worker 0 again, so the workers
        take the shares rotated by the consumed batch count: the rest comes out in the same
        order as it would have without the interruption.
        """
        if num_workers == 1:
            return 0, min(self.start, per_slot)
        if self.start and self.batch_size is None:
            raise ValueError(
                "resuming with DataLoader workers needs batch_size on the dataset (DataLoader(batch_size=None))"
            )
        unit = self.batch_size or 1
        if self.start % unit:
            raise ValueError(f"start={self.start} is not a multiple of batch_size={unit}")
        batches = self.start // unit
        role = (worker + batches) % num_workers
        done = batches // num_workers + (1 if role < batches % num_workers else 0)
        return role, min(done * unit, per_slot)

    def iter_worker(self, worker: int, num_workers: int) -> Iterator[Any]:
        """What DataLoader worker ``worker`` of ``num_workers`` yields (also for simulation)."""
        plan = self.plan(num_workers)
        role, skip = self._resume_point(worker, num_workers, plan.per_slot)
        slot = self.rank * num_workers + role
        samples = self._slot_samples(plan.slots[slot], slot, skip)
        if self.batch_size is None:
            yield from samples
            return
        batch: list[dict[str, Any]] = []
        for sample in samples:
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield self.collate_fn(batch)
                batch = []
        if batch and not self.drop_last:
            yield self.collate_fn(batch)

    def _slot_samples(self, ranges: tuple[tuple[int, int, int], ...], slot: int, skip: int) -> Iterator[dict[str, Any]]:
        import numpy as np

        # The slot's samples as a flat list of (shard index, position) addresses, cut into
        # blocks; a skipped block costs nothing but arithmetic.
        addresses = [(shard, i) for shard, start, stop in ranges for i in range(start, stop)]
        size = self.shuffle_buffer
        first_block = skip // size
        for block_no in range(first_block, -(-len(addresses) // size)):
            block = addresses[block_no * size : (block_no + 1) * size]
            raw: list[Any] = list(self._read_addresses(block))
            if self.mode == "latents":
                # Decoded whole, in reading order, before the shuffle: the draws are then a
                # function of the block alone, and a resumed epoch draws them again the same.
                decoded = self._decode_latent_block([sample for _, sample in raw], slot, block_no)
                raw = [(shard, out) for (shard, _), out in zip(raw, decoded)]
            if size > 1:
                order = np.random.default_rng([self.seed, self.epoch, slot, block_no]).permutation(len(raw))
                raw = [raw[int(i)] for i in order]
            if block_no == first_block:
                raw = raw[skip - block_no * size :]
            for shard, sample in raw:
                yield self._decode(shard, sample)

    def _entries(self, shard: ShardInfo) -> list[IndexEntry]:
        if shard.name not in self._indexes:
            self._indexes[shard.name] = self.release.read_index(shard)
        return self._indexes[shard.name]

    def _read_addresses(self, block: list[tuple[int, int]]) -> Iterator[tuple[ShardInfo, Any]]:
        """Read consecutive runs of a block, one seek per run, in block order."""
        i = 0
        while i < len(block):
            shard_i, start = block[i]
            j = i + 1
            while j < len(block) and block[j] == (shard_i, start + (j - i)):
                j += 1
            image_shard = self.release.shards[shard_i]
            shard = self.release.latent_shard_for(image_shard) if self.mode == "latents" else image_shard
            for sample in read_run(self.release, shard, self._entries(shard), start, start + (j - i)):
                yield image_shard, sample
            i = j

    def _decode(self, image_shard: ShardInfo, sample: Any) -> dict[str, Any]:
        if self.mode == "raw":
            out: dict[str, Any] = {"key": sample.key, **sample.members}
        elif self.mode == "images":
            out = self._decode_image_sample(sample)
        elif self.mode == "clips":
            out = self._decode_clip_sample(sample)
        else:
            out = sample  # decoded with its block
            if self.with_captions:
                out["caption"] = self._caption(image_shard, out["key"])
        return self.transform(out) if self.transform is not None else out

    def _decode_image_sample(self, sample: Any) -> dict[str, Any]:
        members = sample.members
        image_ext = next((e for e in ("jpg", "jpeg", "png", "webp") if e in members), None)
        if image_ext is None:
            raise ReleaseError(f"sample {sample.key!r} has no image member (it has {sorted(members)})")
        try:
            image = decode_image(members[image_ext], self.image_size, self.max_pixels)
        except Exception as err:
            # Released images passed validation: a failure here is a corrupt release.
            raise ReleaseError(f"sample {sample.key!r}: cannot decode {image_ext}: {err}") from err
        return {
            "key": sample.key,
            "image": image,
            "caption": members.get("txt", b"").decode("utf-8"),
            "meta": json.loads(members["json"]) if "json" in members else {},
        }

    def _decode_clip_sample(self, sample: Any) -> dict[str, Any]:
        members = sample.members
        if "mp4" not in members:
            raise ReleaseError(f"sample {sample.key!r} has no mp4 member (it has {sorted(members)})")
        try:
            frames, real = decode_clip(
                members["mp4"], self.clip_frames, self.clip_fps, self.image_size, self.max_pixels
            )
        except Exception as err:
            # Released clips were transcoded by shardsmith: a failure here is a corrupt release.
            raise ReleaseError(f"sample {sample.key!r}: cannot decode its mp4: {err}") from err
        return {
            "key": sample.key,
            "frames": frames,
            "frames_real": real,
            "caption": members.get("txt", b"").decode("utf-8"),
            "meta": json.loads(members["json"]) if "json" in members else {},
        }

    def _decode_latent_block(self, samples: list[Any], slot: int, block_no: int) -> list[dict[str, Any]]:
        try:
            return decode_latent_block(
                samples,
                self.release.encodings,
                latent_sample=self.latent_sample,
                scale_latents=self.scale_latents,
                noise_seed=(self.seed, self.epoch, slot, block_no),
            )
        except (KeyError, ValueError) as err:
            # Released encodings passed the precache gate: a failure here is a corrupt release.
            raise ReleaseError(f"latent block {block_no} of slot {slot}: {err}") from err

    def _caption(self, image_shard: ShardInfo, key: str) -> str:
        if image_shard.name not in self._by_key:
            self._by_key[image_shard.name] = {e.key: e for e in self._entries(image_shard)}
        entry = self._by_key[image_shard.name].get(key)
        if entry is None or "txt" not in entry.members:
            raise ReleaseError(f"{image_shard.name}: no caption for latent sample {key!r}")
        offset, size = entry.members["txt"]
        with self.release.open(image_shard.name) as fh:
            fh.seek(offset)
            return fh.read(size).decode("utf-8")


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _RangeReader:
    """Reads ``length`` bytes of a stream, then a synthetic end-of-archive, so the safe tar
    reader stops exactly at the end of a run of samples without reading the next member."""

    def __init__(self, fh: Any, length: int) -> None:
        self._fh = fh
        self._left = length
        self._tail = bytes(1024)

    def read(self, n: int = -1) -> bytes:
        if self._left > 0:
            data = self._fh.read(self._left if n < 0 else min(n, self._left))
            if not data:
                raise ReleaseError("shard ended before the byte range its index lists")
            self._left -= len(data)
            return data
        out, self._tail = (self._tail, b"") if n < 0 else (self._tail[:n], self._tail[n:])
        return out


def read_run(release: Release, shard: ShardInfo, entries: list[IndexEntry], start: int, stop: int) -> Iterator[Any]:
    """Samples ``start..stop-1`` of a shard: one seek to the first, then a safe streaming read of
    exactly their byte range (from the DALI index).

    The keys read must match the index; a mismatch means the index and the tar disagree, which
    is a corrupt release and raises ``ReleaseError``.
    """
    if not 0 <= start <= stop <= len(entries):
        raise ValueError(f"{shard.name}: samples {start}..{stop} outside 0..{len(entries)}")
    if start == stop:
        return
    url = release.storage.url(shard.name)
    with release.open(shard.name) as fh:
        if entries[start].start:
            fh.seek(entries[start].start)
        reader = _RangeReader(fh, entries[stop - 1].end - entries[start].start)
        got = 0
        try:
            for sample in iter_samples(reader, path=url):
                expected = entries[start + got].key if start + got < stop else None
                if sample.key != expected:
                    raise ReleaseError(f"{url}: sample {start + got} is {sample.key!r}, its index says {expected!r}")
                yield sample
                got += 1
        except ShardError as err:
            raise ReleaseError(f"{url}: {err}") from err
    if got != stop - start:
        raise ReleaseError(f"{url}: read {got} samples at {start}..{stop}, the index lists {stop - start}")
