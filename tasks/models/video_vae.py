"""Clip latents through a frozen diffusers video VAE: the classes allowed, their frame counts, a batch of clips at a time."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.models.latents import maybe_float, stored_latents
from tasks.models.placement import PrecacheError, folder_digest, frozen, need_dir, running


@dataclass(frozen=True)
class VideoVaeKind:
    """How one diffusers video VAE class compresses and normalises, read from its ``config.json``.

    Args:
        temporal: the config -> its temporal compression r (it takes ``1 + k * r`` frames and
            gives ``1 + k`` latent frames: the first frame is encoded alone, causally).
        spatial: the config -> its spatial compression (the resolution must be a multiple).
        channel_stats: where its per-channel ``latents_mean`` / ``latents_std`` are kept:
            ``config``, ``buffers`` (the weights), or ``None`` when its pipelines only scale.
    """

    temporal: Callable[[dict[str, Any]], int]
    spatial: Callable[[dict[str, Any]], int]
    channel_stats: str | None


def _ltx_ratio(cfg: dict[str, Any], fixed: str, patch: str, patch_default: int) -> int:
    """LTX-Video's ratio: as configured, or its patch size times 2 per scaling block (its constructor's rule)."""
    scaling = cfg.get("spatio_temporal_scaling", (True, True, True, False))
    return int(cfg.get(fixed) or cfg.get(patch, patch_default) * 2 ** sum(bool(s) for s in scaling))


# The allowlist: classes whose ``encode`` gives a latent distribution and whose frame rule is
# known; the defaults are their constructors' (save_pretrained writes them all anyway).
VIDEO_VAES: dict[str, VideoVaeKind] = {
    "AutoencoderKLWan": VideoVaeKind(
        temporal=lambda c: 2 ** sum(bool(d) for d in c.get("temperal_downsample", (False, True, True))),
        spatial=lambda c: int(c.get("scale_factor_spatial") or 8),
        channel_stats="config",
    ),
    "AutoencoderKLLTXVideo": VideoVaeKind(
        temporal=lambda c: _ltx_ratio(c, "temporal_compression_ratio", "patch_size_t", 1),
        spatial=lambda c: _ltx_ratio(c, "spatial_compression_ratio", "patch_size", 4),
        channel_stats="buffers",
    ),
    "AutoencoderKLCogVideoX": VideoVaeKind(
        temporal=lambda c: int(c.get("temporal_compression_ratio", 4)),
        spatial=lambda c: 2 ** (len(c.get("block_out_channels", (0,) * 4)) - 1),
        channel_stats=None,
    ),
    "AutoencoderKLHunyuanVideo": VideoVaeKind(
        temporal=lambda c: int(c.get("temporal_compression_ratio", 4)),
        spatial=lambda c: int(c.get("spatial_compression_ratio", 8)),
        channel_stats=None,
    ),
}


def allowed_frames(ratio: int, up_to: int = 256) -> list[int]:
    """The frame counts a VAE of temporal compression ``ratio`` takes: ``1, 1 + r, 1 + 2r, ...``."""
    return list(range(1, up_to + 1, ratio))


@dataclass(frozen=True)
class VideoVaeCheck:
    """A video VAE folder as its config describes it (read before torch is imported).

    Args:
        path: the folder holding its ``config.json`` (``model``, or ``model/subfolder``).
        class_name: its diffusers class (``_class_name``).
        config: its ``config.json``.
        temporal, spatial: its compressions.
        latent_frames: latent frames per clip for the configured ``frames``.
        label: how index.json names it: the folder's name (and ``/subfolder``).
        store: ``image_latents.store``.
    """

    path: Path
    class_name: str
    config: dict[str, Any]
    temporal: int
    spatial: int
    latent_frames: int
    label: str
    store: str


def check_video_vae(cfg: PrecacheConfig) -> VideoVaeCheck:
    """The configured video VAE checked against the recipe: its folder, its class against the
    allowlist, ``clip_latents.frames`` against its temporal compression and
    ``image_latents.resolution`` against its spatial one; a PrecacheError names the field."""
    clip, il = cfg.clip_latents, cfg.image_latents
    if clip is None or clip.model is None or il is None:
        raise PrecacheError("precache.clip_latents.model is not set")
    path = need_dir(clip.model, "precache.clip_latents.model")
    if clip.subfolder:
        path = need_dir(str(path / clip.subfolder), "precache.clip_latents.subfolder")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise PrecacheError(f"precache.clip_latents.model {path}: no readable config.json ({err})") from None
    name = config.get("_class_name")
    kind = VIDEO_VAES.get(name) if isinstance(name, str) else None
    if kind is None:
        raise PrecacheError(
            f"precache.clip_latents.model {path}: class {name!r} is not a video VAE we encode with "
            f"({', '.join(sorted(VIDEO_VAES))})"
        )
    temporal, spatial = kind.temporal(config), kind.spatial(config)
    if (clip.frames - 1) % temporal:
        shown = ", ".join(str(n) for n in allowed_frames(temporal)[:6])
        raise PrecacheError(
            f"precache.clip_latents.frames is {clip.frames}, but {name} at {path} compresses time {temporal}x "
            f"and takes 1 + k * {temporal} frames: {shown}, ..."
        )
    if il.resolution % spatial:
        raise PrecacheError(
            f"precache.image_latents.resolution is {il.resolution}, but {name} at {path} compresses space "
            f"{spatial}x: the clips' resolution must be a multiple of {spatial}"
        )
    label = Path(clip.model).name + (f"/{clip.subfolder}" if clip.subfolder else "")
    return VideoVaeCheck(path, name, config, temporal, spatial, 1 + (clip.frames - 1) // temporal, label, il.store)


class VideoVae:
    """A frozen diffusers video VAE on one device, in eval mode, that encodes whole clips.

    Stored layout: ``(T', C, h, w)`` per clip, time first as the image-VAE path stores its
    ``(frames, C, h, w)``, so the latents loader reads both alike; ``T' = 1 + (frames - 1) / r``
    for the model's temporal compression ``r``.

    Args:
        cfg: the recipe's precache config, with ``clip_latents.model`` set.
        device: ``cpu`` or ``cuda``.
        dtype: the compute dtype (``fp32``, ``bf16``, ``fp16``), under autocast.
    """

    def __init__(self, cfg: PrecacheConfig, device: str, dtype: str) -> None:
        import diffusers

        self.check = check_video_vae(cfg)
        self.device = device
        self.dtype = dtype
        # low_cpu_mem_usage needs accelerate, which we do not depend on for one load per worker.
        self.model = getattr(diffusers, self.check.class_name).from_pretrained(
            str(self.check.path), local_files_only=True, low_cpu_mem_usage=False
        )
        frozen(self.model, device, dtype)
        # Of the VAE's own folder (not a whole pipeline's around it): its weights and config.
        self.digest = folder_digest(str(self.check.path))

    def encode(self, pixels: Any, keys: list[str]) -> dict[str, Any]:
        """``pixels``: ``(B, T, 3, R, R)`` in [-1, 1], one clip per key. Returns the stored
        tensors ``(B, T', C, h, w)`` by member name (without the ``clip_`` prefix), as
        ``image_latents.store`` says; a ``sample`` draw is seeded by the clip's key."""
        import torch

        with running(self.device, self.dtype):
            video = pixels.permute(0, 2, 1, 3, 4).to(
                self.device, torch.float32
            )  # (B, 3, T, R, R), as diffusers takes it
            dist = self.model.encode(video).latent_dist
            if dist.mean.shape[2] != self.check.latent_frames:
                raise PrecacheError(
                    f"precache.clip_latents.model {self.check.path}: {pixels.shape[1]} frames gave "
                    f"{dist.mean.shape[2]} latent frames, expected {self.check.latent_frames}"
                )
            # "@clip": another stream than the keyframe's draw, which is seeded by the bare key.
            out = stored_latents(dist, self.check.store, [f"{k}@clip" for k in keys])
            return {m: t.permute(0, 2, 1, 3, 4) for m, t in out.items()}

    def describe(self) -> dict[str, Any]:
        """index.json's ``clip_latents`` fields of this model. Training normalises a latent ``x`` as
        ``((x - shift_factor) - latents_mean[c]) / latents_std[c] * scaling_factor`` (per channel
        ``c``; a missing factor is 0 or 1), which is what the diffusers pipelines of these
        classes do (``loaders.latents`` applies it with ``scale_latents``)."""
        check, config = self.check, self.model.config
        mean = std = None
        if VIDEO_VAES[check.class_name].channel_stats == "config":
            mean, std = config.get("latents_mean"), config.get("latents_std")
        elif VIDEO_VAES[check.class_name].channel_stats == "buffers":
            mean, std = self.model.latents_mean.tolist(), self.model.latents_std.tolist()
        return {
            "model": check.label,
            "model_class": check.class_name,
            "model_digest": self.digest,
            "latent_frames": check.latent_frames,
            "temporal_compression": check.temporal,
            "spatial_compression": check.spatial,
            "scaling_factor": float(config.get("scaling_factor") or 1.0),
            "shift_factor": maybe_float(config.get("shift_factor")),
            "latents_mean": None if mean is None else [float(v) for v in mean],
            "latents_std": None if std is None else [float(v) for v in std],
        }
