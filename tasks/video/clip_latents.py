"""Precache of video clips: sampled frames of each clip's mp4 through the image VAE (or a video VAE), one latent stack per clip."""

from __future__ import annotations

from typing import Any

from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.formats.shards import SampleRecord
from tasks.models.frozen import CLIP_PREFIX as PREFIX
from tasks.models.placement import PrecacheError
from tasks.video.dali_frames import decode_clips


def encode_clips(
    encoders: Any, tar_path: str, records: dict[str, SampleRecord], keys: list[str], cfg: PrecacheConfig
) -> dict[str, Any]:
    """``clip_latent*.npy`` tensors ``(B, T, C, h, w)`` of the clips under ``keys``, read
    from the local shard ``tar_path`` at their mp4 member's place (``records``) and decoded as
    ``precache.clip_latents.decoder`` says (DALI on a GPU worker, PyAV otherwise: dali_frames.py)."""
    import torch

    clip = cfg.clip_latents
    resolution = cfg.image_latents.resolution if cfg.image_latents is not None else None
    if clip is None or resolution is None:
        return {}
    clips = []
    with open(tar_path, "rb") as fh:
        for key in keys:
            member = next((m for m in records[key].members if m.name == f"{key}.mp4"), None)
            if member is None:
                raise PrecacheError(f"{tar_path}: sample {key} has no mp4 member for precache.clip_latents")
            fh.seek(member.offset)
            clips.append((key, fh.read(member.size)))
    stacks = decode_clips(clips, cfg, resolution, tar_path)
    pixels = torch.cat(stacks).float().div_(127.5).sub_(1.0)  # (B * T, 3, R, R) in [-1, 1]
    if encoders.video_vae is not None:  # whole clips through the video VAE: (B, T', C, h, w)
        latents = encoders.video_vae.encode(pixels.reshape(len(keys), clip.frames, *pixels.shape[1:]), keys)
        return {PREFIX + m: t for m, t in latents.items()}
    # Each frame's draw (store: sample) is seeded by its clip's key and its place in the clip.
    frame_keys = [f"{k}@{t}" for k in keys for t in range(clip.frames)]
    out = encoders.encode_images(pixels, frame_keys, "clip_latents")
    return {PREFIX + m: t.reshape(len(keys), clip.frames, *t.shape[1:]) for m, t in out.items()}
