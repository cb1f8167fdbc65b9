"""Decoding and collating release samples: images with a pixel cap read from the header, latents."""

from __future__ import annotations

import io
from typing import Any

from tasks.video.frames import fit_image

# A hard cap read from the image header before any pixel is decoded (Pillow's default bomb
# threshold is 89 M pixels; a release's images were validated smaller than this already).
DEFAULT_MAX_PIXELS = 50_000_000

# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def decode_image(data: bytes, size: int | None, max_pixels: int = DEFAULT_MAX_PIXELS):
    """JPEG/PNG/WebP bytes -> uint8 tensor ``(3, size, size)``: short side resized to ``size``,
    then center-cropped (``size=None``: ``(3, H, W)`` as stored).

    The pixel count is read from the header and checked before decoding; JPEGs are decoded at
    a reduced scale (``draft``) when that still covers ``size``.
    """
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        if im.width * im.height > max_pixels:
            raise ValueError(f"image of {im.width}x{im.height} pixels is over max_pixels={max_pixels}")
        if size is not None and im.format == "JPEG":
            scale = min(im.width, im.height) / size
            if scale >= 2:
                im.draft("RGB", (int(im.width / scale) + 1, int(im.height / scale) + 1))
        im = im.convert("RGB")
    im = fit_image(im, size)
    return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).contiguous()


def collate_images(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples of ``mode="images"`` -> ``{"image": uint8 (B, 3, S, S), "caption": [B str],
    "key": [B str], "meta": [B dict]}``."""
    import torch

    return {
        "image": torch.stack([s["image"] for s in samples]),
        "caption": [s["caption"] for s in samples],
        "key": [s["key"] for s in samples],
        "meta": [s["meta"] for s in samples],
    }


def collate_latents(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples of ``mode="latents"`` -> ``{"latent": float32 (B, C, h, w), "clip_latent": float32
    (B, T, C, h, w) (a release of clips precached with ``clip_latents``), "text_emb": (B, L, D)
    in the stored dtype, "text_mask": bool (B, L), "vision_emb": (B, ...), "key": [B str],
    "caption": [B str]}`` (only the encodings the release has; captions when read)."""
    import torch

    out: dict[str, Any] = {"key": [s["key"] for s in samples]}
    for name in ("latent", "clip_latent", "text_emb", "text_mask", "vision_emb"):
        if name in samples[0]:
            out[name] = torch.stack([s[name] for s in samples])
    if "caption" in samples[0]:
        out["caption"] = [s["caption"] for s in samples]
    return out
