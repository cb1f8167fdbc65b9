"""Short videos written with PyAV for the video demo and tests: moving shapes, scene cuts, audio, odd streams."""

from __future__ import annotations

import os
import tempfile

import av
import numpy as np


def make_video(
    seconds: float = 2.0,
    fps: int = 10,
    size: tuple[int, int] = (96, 64),
    container: str = "mp4",
    codec: str = "libx264",
    cut_at: float | None = None,
    audio: bool = False,
    video: bool = True,
    faststart: bool = True,
    extra_streams: int = 0,
    draw=None,
) -> bytes:
    """A square moving across a background; at ``cut_at`` seconds the scene changes (colours and motion)."""
    fmt = {"mp4": "mp4", "webm": "webm", "mkv": "matroska"}[container]
    options = {"movflags": "+faststart"} if container == "mp4" and faststart else {}
    # A file, not a buffer: faststart moves the index to the front by reading the file again.
    handle, path = tempfile.mkstemp(suffix=f".{container}")
    os.close(handle)
    try:
        _write(path, fmt, options, seconds, fps, size, codec, cut_at, audio, video, extra_streams, draw)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def scene(kind: str, i: int, size: tuple[int, int]):
    """A frame of one of the test scenes: ``a`` (a red square moving right on blue), ``b`` (a blue
    square moving left on yellow), ``black``, ``still`` (a square that does not move)."""
    w, h = size
    if kind == "black":
        return np.zeros((h, w, 3), np.uint8)
    side = max(8, min(w, h) // 3)
    background, colour = ((30, 90, 160), (240, 40, 40)) if kind in ("a", "still") else ((200, 180, 40), (20, 20, 200))
    img = np.full((h, w, 3), background, np.uint8)
    span = max(1, w - side)
    x = {"a": (i * 9) % span, "b": span - (i * 7) % span, "still": span // 2}[kind]
    y = h // 4 if kind != "b" else h // 2
    img[y : y + side, x : x + side] = colour
    return img


def _write(path, fmt, options, seconds, fps, size, codec, cut_at, audio, video, extra_streams, draw) -> None:
    with av.open(path, mode="w", format=fmt, options=options) as box:
        vs = box.add_stream(codec, rate=fps) if video else None
        if vs is not None:
            vs.width, vs.height = size
            vs.pix_fmt = "yuv420p"
            if codec == "libx264":
                vs.options = {"preset": "ultrafast", "g": str(fps)}
        for _ in range(extra_streams):
            extra = box.add_stream(codec, rate=fps)
            extra.width, extra.height = 16, 16
            extra.pix_fmt = "yuv420p"
        tone = box.add_stream("aac", rate=8000) if audio else None
        if vs is not None:
            for i in range(int(seconds * fps)):
                t = i / fps
                img = (
                    draw(i, t)
                    if draw is not None
                    else scene("b" if cut_at is not None and t >= cut_at else "a", i, size)
                )
                for packet in vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    box.mux(packet)
            for packet in vs.encode():
                box.mux(packet)
        if tone is not None:
            _write_tone(box, tone, seconds)


def _write_tone(box, stream, seconds: float, rate: int = 8000) -> None:
    """A 440 Hz tone for ``seconds``, as the audio stream a video may carry."""
    samples = int(seconds * rate)
    wave = (np.sin(np.arange(samples) * 2 * np.pi * 440 / rate) * 0.2).astype(np.float32)
    for start in range(0, samples, 1024):
        piece = av.AudioFrame.from_ndarray(wave[start : start + 1024].reshape(1, -1), format="fltp", layout="mono")
        piece.sample_rate = rate
        piece.pts = start
        for packet in stream.encode(piece):
            box.mux(packet)
    for packet in stream.encode():
        box.mux(packet)
