"""libwebp's scaled decoding (``WebPDecoderConfig.options.use_scaling``), the WebP analogue of JPEG's draft.

No maintained Python binding exposes it (bench/RESULTS.md, "Decoding per format"): imagecodecs,
OpenCV and Pillow decode a WebP at full size only. This module calls the libwebp that
imagecodecs (or Pillow) already ships and loads, through ctypes, with libwebp's own ABI check:
``WebPInitDecoderConfigInternal`` and ``WebPGetFeaturesInternal`` take the ABI version the
structures below were laid out for (``WEBP_DECODER_ABI_VERSION`` 0x0209, libwebp 1.0 and
later) and refuse a library whose major ABI differs, in which case :func:`decode_scaled` always
answers None and WebPs are decoded at full size, as before.

Only a lossy, opaque, still WebP is decoded this way (what :func:`decode_scaled` checks with
libwebp's own reading of the header): a lossless one keeps its full-resolution pixel key (the
same picture as a PNG has the same key), and alpha is composited on white at full size.
libwebp rescales the decoded planes by area averaging straight into the caller's array; the
output buffer is ours, sized for the target, and libwebp checks it against the stride and
height before writing. ctypes releases the GIL for each call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

_ABI = 0x0209  # WEBP_DECODER_ABI_VERSION the structures below follow (decode.h, libwebp >= 1.0)
_MODE_RGB = 0  # WEBP_CSP_MODE
_LOSSY = 1  # WebPBitstreamFeatures.format: 0 mixed/undefined, 1 lossy, 2 lossless


class _Features(ctypes.Structure):
    _fields_ = [
        ("width", ctypes.c_int),
        ("height", ctypes.c_int),
        ("has_alpha", ctypes.c_int),
        ("has_animation", ctypes.c_int),
        ("format", ctypes.c_int),
        ("pad", ctypes.c_uint32 * 5),
    ]


class _RGBABuffer(ctypes.Structure):
    _fields_ = [("rgba", ctypes.c_void_p), ("stride", ctypes.c_int), ("size", ctypes.c_size_t)]


class _YUVABuffer(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("y", "u", "v", "a")),
        *((name, ctypes.c_int) for name in ("y_stride", "u_stride", "v_stride", "a_stride")),
        *((name, ctypes.c_size_t) for name in ("y_size", "u_size", "v_size", "a_size")),
    ]


class _Buffers(ctypes.Union):
    _fields_ = [("RGBA", _RGBABuffer), ("YUVA", _YUVABuffer)]


class _DecBuffer(ctypes.Structure):
    _fields_ = [
        ("colorspace", ctypes.c_int),
        ("width", ctypes.c_int),
        ("height", ctypes.c_int),
        ("is_external_memory", ctypes.c_int),
        ("u", _Buffers),
        ("pad", ctypes.c_uint32 * 4),
        ("private_memory", ctypes.c_void_p),
    ]


_OPTIONS = (
    "bypass_filtering",
    "no_fancy_upsampling",
    "use_cropping",
    "crop_left",
    "crop_top",
    "crop_width",
    "crop_height",
    "use_scaling",
    "scaled_width",
    "scaled_height",
    "use_threads",
    "dithering_strength",
    "flip",
    "alpha_dithering_strength",
)


class _Options(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int) for name in _OPTIONS), ("pad", ctypes.c_uint32 * 5)]


class _Config(ctypes.Structure):
    _fields_ = [("input", _Features), ("output", _DecBuffer), ("options", _Options)]


def _candidates() -> list[str]:
    """libwebp shared libraries on this machine: the wheels' own copies first (already loaded), then the system's."""
    found: list[str] = []
    for package in ("imagecodecs", "PIL"):
        try:
            module: Any = __import__(package)
        except ImportError:
            continue
        here = os.path.dirname(os.path.abspath(module.__file__))
        # auditwheel puts them in <site-packages>/<dist>.libs, delocate in <package>/.dylibs.
        for folder in (
            f"{here}.libs",
            os.path.join(os.path.dirname(here), "pillow.libs"),
            os.path.join(here, ".dylibs"),
        ):
            found += sorted(
                glob.glob(os.path.join(folder, "libwebp-*.so*")) + glob.glob(os.path.join(folder, "libwebp.*dylib"))
            )
    system = ctypes.util.find_library("webp")
    return list(dict.fromkeys([*found, *([system] if system else [])]))


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The first libwebp that loads and accepts this ABI, or None (scaled decoding off)."""
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            init, features, decode = lib.WebPInitDecoderConfigInternal, lib.WebPGetFeaturesInternal, lib.WebPDecode
        except (OSError, AttributeError):
            continue
        init.argtypes, init.restype = [ctypes.POINTER(_Config), ctypes.c_int], ctypes.c_int
        features.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(_Features), ctypes.c_int]
        features.restype = ctypes.c_int
        decode.argtypes, decode.restype = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(_Config)], ctypes.c_int
        if init(ctypes.byref(_Config()), _ABI):  # 0: the library's major ABI is not this one
            return lib
    return None


def riff_chunks(data: bytes, pos: int = 12, end: int | None = None) -> Iterator[tuple[bytes, int, int]]:
    """(tag, offset of its payload, declared size) of each RIFF chunk from ``pos`` to ``end``.

    Only chunk headers are read, so walking a file costs nothing; a payload may run past
    ``end`` (a cut file): callers check ``offset + size`` themselves.
    """
    end = len(data) if end is None else end
    while pos + 8 <= end:
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        yield data[pos : pos + 4], pos + 8, size
        pos += 8 + size + (size & 1)


def _vp8_chunk(data: bytes) -> bytes | None:
    """The ``VP8 `` chunk (header included) of a RIFF WebP, or None when there is none whole."""
    for tag, start, size in riff_chunks(data):
        if tag == b"VP8 ":
            return data[start - 8 : start + size] if start + size <= len(data) else None
    return None


def decode_scaled(data: bytes, canvas: tuple[int, int], size: tuple[int, int]) -> np.ndarray | None:
    """RGB pixels of a lossy, opaque, still WebP, area-averaged to ``size`` (w, h) while decoding.

    Args:
        data: the file's bytes.
        canvas: its size as its header says; the frame must be exactly that size.
        size: the target, at most ``canvas`` on each side.

    Only the ``VP8 `` chunk is handed to the decoder: given the whole file, libwebp lets the
    frame's last partition run on into the chunks after it, and so decodes some cut or
    damaged frames that the full-size decoders (through the demuxer) refuse.

    None when the file is not one (lossless, alpha, animation), when no usable libwebp was
    found, or when libwebp refuses the bytes: the caller then decodes at full size, so a broken
    file gets the full-size decoder's verdict and detail.
    """
    lib = _library()
    width, height = size
    if lib is None or not (0 < width <= canvas[0] and 0 < height <= canvas[1]):
        return None
    config = _Config()
    if not lib.WebPInitDecoderConfigInternal(ctypes.byref(config), _ABI):
        return None
    head = config.input
    if lib.WebPGetFeaturesInternal(data, len(data), ctypes.byref(head), _ABI) != 0:
        return None
    if head.format != _LOSSY or head.has_alpha or head.has_animation:
        return None
    frame = _vp8_chunk(data)
    if frame is None or lib.WebPGetFeaturesInternal(frame, len(frame), ctypes.byref(head), _ABI) != 0:
        return None
    if (head.width, head.height) != canvas:
        return None
    out = np.empty((height, width, 3), np.uint8)
    options = config.options
    options.use_scaling, options.scaled_width, options.scaled_height = 1, width, height
    buffer = config.output
    buffer.colorspace, buffer.is_external_memory = _MODE_RGB, 1
    buffer.u.RGBA.rgba, buffer.u.RGBA.stride, buffer.u.RGBA.size = out.ctypes.data, 3 * width, out.nbytes
    if lib.WebPDecode(frame, len(frame), ctypes.byref(config)) != 0:
        return None
    return out
