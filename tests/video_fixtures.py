"""The video tests' files (tasks/demo/videos.py) and the box surgery that makes their hostile edits."""

from __future__ import annotations

import struct

from tasks.demo.videos import make_video, scene

__all__ = ["boxes", "display_matrix", "find_box", "make_video", "patch", "scene"]


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


def display_matrix(data: bytes, a: int, b: int, c: int, d: int) -> bytes:
    """The mp4 with its video track's display matrix (tkhd) set to [a b 0; c d 0; 0 0 1]: a
    phone's rotation. FFmpeg's muxer no longer writes the ``rotate`` tag as one, so edit it."""
    off, _ = find_box(data, ["moov", "trak", "tkhd"])
    version = data[off + 8]
    # header, version/flags, then times, track id and duration (wider in version 1), then
    # reserved, layer, group, volume and reserved
    matrix = off + 8 + 4 + (32 if version == 1 else 20) + 8 + 8
    one = 1 << 16
    return patch(data, matrix, ">9i", a * one, b * one, 0, c * one, d * one, 0, 0, 0, 1 << 30)
