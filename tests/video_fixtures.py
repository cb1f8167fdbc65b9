"""Small videos written by PyAV for the video tests: moving shapes, a scene cut, audio, and their hostile edits."""

from __future__ import annotations

import os
import struct
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
        vs = None
        if video:
            vs = box.add_stream(codec, rate=fps)
            vs.width, vs.height = size
            vs.pix_fmt = "yuv420p"
            if codec == "libx264":
                vs.options = {"preset": "ultrafast", "g": str(fps)}
        for _ in range(extra_streams):
            extra = box.add_stream(codec, rate=fps)
            extra.width, extra.height = 16, 16
            extra.pix_fmt = "yuv420p"
        a = box.add_stream("aac", rate=8000) if audio else None
        n = int(seconds * fps)
        for i in range(n if vs else 0):
            t = i / fps
            if draw is not None:
                img = draw(i, t)
            else:
                img = scene("b" if cut_at is not None and t >= cut_at else "a", i, size)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            for packet in vs.encode(frame):
                box.mux(packet)
        if vs:
            for packet in vs.encode():
                box.mux(packet)
        if a is not None:
            samples = int(seconds * 8000)
            tone = (np.sin(np.arange(samples) * 2 * np.pi * 440 / 8000) * 0.2).astype(np.float32)
            step = 1024
            for start in range(0, samples, step):
                chunk = tone[start : start + step].reshape(1, -1)
                frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="mono")
                frame.sample_rate = 8000
                frame.pts = start
                for packet in a.encode(frame):
                    box.mux(packet)
            for packet in a.encode():
                box.mux(packet)


def boxes(data: bytes, start: int = 0, end: int | None = None):
    """(type, offset, size) of the ISO BMFF boxes between ``start`` and ``end``."""
    end = len(data) if end is None else end
    i = start
    while i + 8 <= end:
        size, kind = struct.unpack(">I4s", data[i : i + 8])
        if size < 8:
            break
        yield kind.decode("latin-1"), i, size
        i += size


def find_box(data: bytes, path: list[str]) -> tuple[int, int]:
    """Offset and size of the box at ``path`` (e.g. ["moov", "trak", "mdia", "mdhd"])."""
    start, end = 0, len(data)
    for depth, name in enumerate(path):
        for kind, off, size in boxes(data, start, end):
            if kind == name:
                start, end = off + 8, off + size
                if depth == len(path) - 1:
                    return off, size
                if name == "stsd":
                    start += 8  # version, flags, entry count
                break
        else:
            raise KeyError(name)
    raise KeyError(path[-1])


def patch(data: bytes, offset: int, fmt: str, *values: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, *values)
    return bytes(buf)
