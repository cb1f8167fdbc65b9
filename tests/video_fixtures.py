"""The video tests' files (tasks/demo/videos.py) and the box surgery that makes their hostile edits."""

from __future__ import annotations

import struct

from tasks.demo.videos import make_video, scene

__all__ = ["boxes", "find_box", "make_video", "patch", "scene"]


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
