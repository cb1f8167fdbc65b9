"""Released clips (mp4) decoded into frame tensors at a requested frame count and rate, with a pixel cap."""

from __future__ import annotations

import io
from typing import Any

from loaders.decode import DEFAULT_MAX_PIXELS, fit_image

# A clip's frames are decoded at most this long (seconds of the clip read); a release's clips
# were cut to validate.video.clips.max_s already, so this only bounds a corrupt one.
MAX_CLIP_S = 600.0


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


def collate_clips(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples of ``mode="clips"`` -> ``{"frames": uint8 (B, T, 3, S, S), "frames_real": int64
    (B,), "caption": [B str], "key": [B str], "meta": [B dict]}``."""
    import torch

    return {
        "frames": torch.stack([s["frames"] for s in samples]),
        "frames_real": torch.tensor([s["frames_real"] for s in samples]),
        "caption": [s["caption"] for s in samples],
        "key": [s["key"] for s in samples],
        "meta": [s["meta"] for s in samples],
    }
