"""Video frames for training and encoders: a clip's mp4 decoded at a frame count and rate, each frame fitted to a square."""

from __future__ import annotations

import io
from typing import Any

# Frames are taken from at most this many seconds of a clip; a clip cut by shardsmith is
# validate.video.clips.max_s long, so this only bounds a corrupt one.
MAX_CLIP_S = 600.0
# A cap on a frame's pixels, read from the stream's header before any frame is decoded.
DEFAULT_MAX_PIXELS = 50_000_000


def fit_image(im: Any, size: int | None) -> Any:
    """A PIL image with its short side resized to ``size``, then center-cropped square (``None``: as it is)."""
    from PIL import Image

    if size is None:
        return im
    w, h = im.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    im = im.resize((nw, nh), Image.Resampling.BILINEAR, reducing_gap=None if scale > 0.5 else 2.0)
    left, top = (nw - size) // 2, (nh - size) // 2
    return im.crop((left, top, left + size, top + size))


def decode_clip(
    data: bytes, frames: int, fps: float | None, size: int | None, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[Any, int]:
    """mp4 bytes -> (uint8 tensor ``(frames, 3, size, size)``, frames that came from the clip).

    Frames are taken every ``1 / fps`` seconds from the clip's first (``fps=None``: every
    decoded frame), each the last frame shown at that time; a clip too short for ``frames`` at
    that rate repeats its last frame (the count of real ones is returned beside). Every frame is
    resized and cropped as ``decode_image`` does; the frame size is checked against
    ``max_pixels`` from the stream's header before anything is decoded.
    """
    import av
    import numpy as np
    import torch

    if frames < 1:
        raise ValueError("frames must be >= 1")
    picked: list[Any] = []
    with av.open(io.BytesIO(data), mode="r") as box:
        stream = box.streams.video[0]
        if stream.width * stream.height > max_pixels:
            raise ValueError(f"clip frames of {stream.width}x{stream.height} pixels are over max_pixels={max_pixels}")
        start, last = None, None
        for frame in box.decode(stream):
            t = float(frame.time or 0.0)
            start = t if start is None else start
            if t - start > MAX_CLIP_S:
                break
            if fps is None:
                picked.append(frame)
            else:
                # Every target time this frame is the latest frame for.
                while len(picked) < frames and start + len(picked) / fps < t - 1e-6 and last is not None:
                    picked.append(last)
                if len(picked) < frames and start + len(picked) / fps <= t + 1e-6:
                    picked.append(frame)
            last = frame
            if len(picked) >= frames:
                break
    if not picked:
        raise ValueError("the clip has no video frames")
    real = min(len(picked), frames)
    picked = (picked + [picked[-1]] * frames)[:frames]
    images = [fit_image(f.to_image(), size) for f in picked]
    return torch.from_numpy(np.stack([np.asarray(im) for im in images])).permute(0, 3, 1, 2).contiguous(), real
