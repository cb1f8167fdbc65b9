"""Video frames for training and encoders: a clip's mp4 decoded at a frame count and rate, each frame fitted to a square."""

from __future__ import annotations

import io
from typing import Any

# Frames are taken from at most this many seconds of a clip; a clip cut by shardsmith is
# validate.video.clips.max_s long, so this only bounds a corrupt one.
MAX_CLIP_S = 600.0
# A cap on a frame's pixels, read from the stream's header before any frame is decoded.
DEFAULT_MAX_PIXELS = 50_000_000


def fit_geometry(w: int, h: int, size: int) -> tuple[int, int, int, int]:
    """A ``w`` x ``h`` frame fitted to a ``size`` square: its size once the short side is
    ``size`` (the long one rounded), and the top-left corner of the centered crop: ``(nw, nh,
    left, top)``. PyAV's frames (``fit_image``) and DALI's (tasks/video/dali_frames.py) alike."""
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    return nw, nh, (nw - size) // 2, (nh - size) // 2


def fit_image(im: Any, size: int | None) -> Any:
    """A PIL image with its short side resized to ``size``, then center-cropped square (``None``: as it is)."""
    from PIL import Image

    if size is None:
        return im
    w, h = im.size
    nw, nh, left, top = fit_geometry(w, h, size)
    scale = size / min(w, h)
    im = im.resize((nw, nh), Image.Resampling.BILINEAR, reducing_gap=None if scale > 0.5 else 2.0)
    return im.crop((left, top, left + size, top + size))


class FramePicker:
    """Which frames a clip gives at ``frames`` frames every ``1 / fps`` seconds from its first
    (``fps=None``: consecutive frames), each the last frame shown at that time, a short clip
    repeating its last pick; frames are offered in presentation order by index and time. One
    rule for PyAV's ``decode_clip`` and DALI's plan (tasks/video/dali_frames.py)."""

    def __init__(self, frames: int, fps: float | None):
        if frames < 1:
            raise ValueError("frames must be >= 1")
        self.frames, self.fps = frames, fps
        self.picked: list[int] = []
        self._start: float | None = None
        self._last: int | None = None

    def offer(self, i: int, t: float) -> bool:
        """Take frame ``i`` shown at ``t`` s where it is due; True once no later frame is wanted."""
        start = self._start = t if self._start is None else self._start
        if t - start > MAX_CLIP_S:
            return True
        if self.fps is None:
            self.picked.append(i)
        else:
            # Every target time this frame is the latest frame for.
            while len(self.picked) < self.frames and start + len(self.picked) / self.fps < t - 1e-6:
                if self._last is None:
                    break
                self.picked.append(self._last)
            if len(self.picked) < self.frames and start + len(self.picked) / self.fps <= t + 1e-6:
                self.picked.append(i)
        self._last = i
        return len(self.picked) >= self.frames

    def result(self) -> tuple[list[int], int]:
        """The picks padded to ``frames`` with the last one, and how many are real."""
        if not self.picked:
            raise ValueError("the clip has no video frames")
        real = min(len(self.picked), self.frames)
        return (self.picked + [self.picked[-1]] * self.frames)[: self.frames], real


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

    picker = FramePicker(frames, fps)
    kept: dict[int, Any] = {}  # the decoded frames picked, by index
    with av.open(io.BytesIO(data), mode="r") as box:
        stream = box.streams.video[0]
        if stream.width * stream.height > max_pixels:
            raise ValueError(f"clip frames of {stream.width}x{stream.height} pixels are over max_pixels={max_pixels}")
        previous = None
        for i, frame in enumerate(box.decode(stream)):
            before = len(picker.picked)
            done = picker.offer(i, float(frame.time or 0.0))
            for index in picker.picked[before:]:
                kept[index] = frame if index == i else previous
            if done:
                break
            previous = frame
    order, real = picker.result()
    picked = [kept[i] for i in order]
    images = [fit_image(f.to_image(), size) for f in picked]
    return torch.from_numpy(np.stack([np.asarray(im) for im in images])).permute(0, 3, 1, 2).contiguous(), real
