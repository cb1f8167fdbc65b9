"""bench_video.py's checks of what the tools made: clips read back from their tars with PyAV, against what was asked and the corpus's plan."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from video_tools import FPS, expected_spans, plan


@dataclass
class ClipFacts:
    """One clip read back with PyAV: its codec, size, rate and frames, its source video (the
    URL's file name) and the span of it the clip claims (seconds), as the tool's json says."""

    key: str
    video: str
    codec: str
    width: int
    height: int
    fps: float
    frames: int
    seconds: float
    span: tuple[float, float] | None


def read_clip(key: str, mp4: bytes, meta: dict) -> ClipFacts:
    import av

    with av.open(io.BytesIO(mp4)) as box:
        stream = box.streams.video[0]
        frames = sum(1 for _ in box.decode(stream))
        fps = float(stream.average_rate or 0)
        codec = stream.codec_context.name
        width, height = stream.codec_context.width, stream.codec_context.height
    span = None
    if "start_s" in meta:  # shardsmith
        span = (float(meta["start_s"]), float(meta["end_s"]))
    elif meta.get("clips"):  # video2dataset
        s, e = meta["clips"][0]
        span = (float(s), float(e))
    video = str(meta.get("url", "")).rsplit("/", 1)[-1]
    return ClipFacts(key, video, codec, width, height, fps, frames, frames / fps if fps else 0.0, span)


def clips_in_tars(tars: list[Path]) -> tuple[int, list[tuple[str, bytes, dict]]]:
    """The number of mp4 members in the tars, and each as (key, mp4, its json)."""
    out = []
    for path in sorted(tars):
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(path) as tf:
            for m in tf:
                if not m.isfile():
                    continue
                key, ext = m.name.split(".", 1)
                f = tf.extractfile(m)
                if f is not None and ext in ("mp4", "json"):
                    members.setdefault(key, {})[ext] = f.read()
        out += [(k, v["mp4"], json.loads(v.get("json", b"{}"))) for k, v in members.items() if "mp4" in v]
    return len(out), out


def planned_spans(seed: int, videos: int) -> dict[str, list[tuple[float, float]]]:
    """Every corpus video's expected clips (seconds), by file name."""
    out = {}
    for index in range(videos):
        frames, scenes = plan(seed, index)
        out[f"v{index:04d}.mp4"] = [(a / FPS, b / FPS) for a, b in expected_spans(frames, scenes)]
    return out


def check_clips(
    facts: list[ClipFacts], width: int, height: int, fps: float, spans: dict[str, list[tuple[float, float]]] | None
) -> dict:
    """How the clips measure up: how many are not H.264 at ``width`` x ``height`` and ``fps``;
    their decoded lengths; how many claim a span of their video's plan (within a frame at the
    source's rate), and how far a decoded length is from the span it claims."""
    tol = 1.5 / FPS
    wrong = [f.key for f in facts if (f.codec, f.width, f.height) != ("h264", width, height) or abs(f.fps - fps) > 0.01]
    seconds = [f.seconds for f in facts]
    claimed = [f for f in facts if f.span is not None]
    matched = None
    if spans is not None:
        matched = sum(
            1
            for f in claimed
            if any(abs(f.span[0] - a) <= tol and abs(f.span[1] - b) <= tol for a, b in spans.get(f.video, []))
        )
    return {
        "clips": len(facts),
        "wrong_format": len(wrong),
        "min_s": min(seconds, default=0.0),
        "max_s": max(seconds, default=0.0),
        "matched": matched,
        "length_off_s": max((abs(f.seconds - (f.span[1] - f.span[0])) for f in claimed), default=None),
    }
