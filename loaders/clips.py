"""Released clips (mp4) decoded into frame tensors at a requested frame count and rate, with a pixel cap."""

from __future__ import annotations

from typing import Any

from tasks.video.frames import decode_clip

__all__ = ["collate_clips", "decode_clip"]


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
