"""Image decoders for tasks.policies.images: Pillow (with libjpeg's scaled decode), libwebp's still-image and scaled decoders and libpng for plain PNGs, chosen by bench/bench_decode.py."""

from __future__ import annotations

import io
import re
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from imagecodecs import PngError, WebpError, png_decode, webp_decode
from PIL import Image, PngImagePlugin

from tasks.policies import libwebp

# What a decoder raises on hostile or broken bytes (Pillow's fuzzers see these; imagecodecs
# raises WebpError and PngError). MemoryError is not among them: the pixel cap makes it a
# worker problem, not a property of the sample.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError, KeyError, WebpError, PngError)

# Sniffed format -> the one Pillow plugin allowed to parse it. Hostile bytes never reach the
# other plugins' parsers; a format without a plugin here (heif) is ``undecodable_image``.
PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP", "tiff": "TIFF", "avif": "AVIF"}

# bench/bench_decode.py turns these off to measure the old paths beside the new ones.
JPEG_DRAFT = True
STILL_WEBP = True
WEBP_SCALED = True
PLAIN_PNG = True

WHITE = (255, 255, 255)
_GREY16 = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA = ("RGBA", "RGBa", "LA", "La", "PA")

TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_VP8X_ANIMATION = 0x02
_VP8_START = b"\x9d\x01\x2a"
_VP8L_SIGNATURE = 0x2F
_PNG_PLAIN_TYPES = (0, 2, 4, 6)  # grey, RGB, grey + alpha, RGBA: no palette
# Chunks Pillow reads into pixels, transparency, orientation, frames or bounded buffers: a PNG
# with any of them is decoded by Pillow, as before.
_PNG_FOR_PILLOW = {b"PLTE", b"tRNS", b"eXIf", b"iCCP", b"iTXt", b"zTXt", b"acTL", b"fcTL", b"fdAT"}
# Pillow refuses these when shorter; libpng would skip them and decode.
_PNG_MIN_LENGTH = {b"IHDR": 13, b"gAMA": 4, b"sRGB": 1, b"pHYs": 9, b"cHRM": 32}
# tEXt keywords that Pillow's getexif() reads an orientation from.
_PNG_ORIENTATION_TEXT = {b"exif", b"Raw profile type exif", b"XML:com.adobe.xmp", b"xmp"}

Box = tuple[float, float, float, float]

# The most segments a file may have (JPEG markers and fill bytes before its first scan, PNG
# chunks, RIFF chunks, GIF sub-blocks shorter than a full 255 bytes): Pillow's parsers and our
# own walks take one pass of Python per segment, so a file of millions of empty ones would
# take seconds. Real files have tens (a PNG in 8 KiB IDATs: thousands).
MAX_SEGMENTS = 100_000
_JPEG_FILL = re.compile(rb"\xff+")


def segments_problem(fmt: str, data: bytes) -> str | None:
    """Why a file is refused before any parser walks it: more than :data:`MAX_SEGMENTS`
    segments (the walk stops there); None otherwise, broken structure included (the decoders
    judge that). Costs a pass over segment headers only."""
    walk = {"jpeg": _jpeg_units, "png": _png_units, "webp": _riff_units, "gif": _gif_units}.get(fmt)
    if walk is None or walk(data, MAX_SEGMENTS) <= MAX_SEGMENTS:
        return None
    return f"more than {MAX_SEGMENTS} segments before its picture ends: a hostile file, not parsed"


def _jpeg_units(data: bytes, cap: int) -> int:
    """Markers and fill bytes before the first scan (libjpeg reads the rest, in C)."""
    pos, units = 2, 0
    while units <= cap:
        fill = _JPEG_FILL.match(data, pos)
        if fill is None or fill.end() >= len(data):
            break
        marker, pos = data[fill.end()], fill.end() + 1
        units += fill.end() - fill.start()
        if marker == 0xDA or marker == 0xD9:  # SOS, EOI
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn: no length
            continue
        pos += int.from_bytes(data[pos : pos + 2], "big")
    return units


def _png_units(data: bytes, cap: int) -> int:
    pos, units = 8, 0
    while units <= cap and pos + 12 <= len(data):
        units += 1
        pos += 12 + int.from_bytes(data[pos : pos + 4], "big")
    return units


def _riff_units(data: bytes, cap: int) -> int:
    units = 0
    for units, _ in enumerate(libwebp.riff_chunks(data), 1):
        if units > cap:
            break
    return units


def _gif_units(data: bytes, cap: int) -> int:
    """Blocks and the sub-blocks shorter than 255 bytes (full ones cost a pass per 255 bytes)."""
    if len(data) < 13:
        return 0
    pos, units = 13, 0
    flags = data[10]
    pos += 3 << ((flags & 7) + 1) if flags & 0x80 else 0
    while units <= cap and pos < len(data):
        kind, units = data[pos], units + 1
        if kind == 0x21:  # extension: label, then sub-blocks
            pos += 2
        elif kind == 0x2C and pos + 10 <= len(data):  # image: descriptor, local table, code size, sub-blocks
            local = data[pos + 9]
            pos += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0) + 1
        else:  # the trailer, or broken
            break
        while pos < len(data) and units <= cap:
            size = data[pos]
            units += size < 255
            pos += 1 + size
            if size == 0:
                break
    return units


class Unsupported(Exception):
    """A decoded pixel mode without a defined conversion to 8-bit RGB."""


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB, alpha composited on white; raises Unsupported for modes without a meaning."""
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img
    if mode in _GREY16:
        arr = np.asarray(img)
        if mode == "I" and arr.size and (int(arr.min()) < 0 or int(arr.max()) > 65535):
            raise Unsupported("32-bit integer samples outside 0..65535")
        wide = arr.astype(np.uint32)
        grey = ((wide + 128) // 257).astype(np.uint8)
        trns = img.info.get("transparency")
        if isinstance(trns, int):
            grey[wide == trns] = 255
        return Image.fromarray(grey).convert("RGB")
    if mode in ("F",) or mode.startswith(("I;", "F;")):
        raise Unsupported(f"pixel mode {mode}")
    if mode in _ALPHA or "transparency" in img.info:
        rgba = img.convert("RGBA")
        out = Image.new("RGB", img.size, WHITE)
        out.paste(rgba, (0, 0), rgba)
        return out
    try:
        return img.convert("RGB")
    except ValueError as err:
        raise Unsupported(f"pixel mode {mode}") from err


def orientation(img: Image.Image) -> int:
    """EXIF orientation 1..8 (Pillow's reading: EXIF, else XMP's ``tiff:Orientation``); broken or odd values count as 1."""
    try:
        value = img.getexif().get(0x0112, 1)
    except (*DECODE_ERRORS, TypeError):  # TypeError: Pillow 13 reads a PNG's "xmp" text with a bytes pattern
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def box_after(box: Box, size: tuple[int, int], turn: int) -> Box:
    """Where a stored-orientation box of an image of ``size`` lies after the EXIF transpose ``turn``."""
    x0, y0, x1, y1 = box
    w, h = size
    return {
        1: (x0, y0, x1, y1),
        2: (w - x1, y0, w - x0, y1),
        3: (w - x1, h - y1, w - x0, h - y0),
        4: (x0, h - y1, x1, h - y0),
        5: (y0, x0, y1, x1),
        6: (h - y1, x0, h - y0, x1),
        7: (h - y1, w - x1, h - y0, w - x0),
        8: (y0, w - x1, y1, w - x0),
    }[turn]


def draft(img: Image.Image, need: tuple[int, int]) -> Box | None:
    """Ask libjpeg for a 1/2, 1/4 or 1/8 decode that is still at least ``need`` (stored orientation).

    Returns the box of the whole picture in drafted pixels (the last row and column may be
    partial), or None when the image is decoded at full size.
    """
    if not JPEG_DRAFT or img.format not in ("JPEG", "MPO"):
        return None
    w, h = img.size
    for k in (8, 4, 2):
        if w // k >= need[0] and h // k >= need[1]:
            break
    else:
        return None
    # Pillow picks the largest of 8/4/2/1 not above min(w // rw, h // rh); asking for
    # (w // k, h // k) makes that exactly k.
    result = img.draft(None, (max(1, w // k), max(1, h // k)))
    if result is None:  # progressive or multi-tile files: full decode
        return None
    return result[1]


class PillowSource:
    """An image opened lazily by Pillow: header fields now, pixels (drafted for JPEG) on ``load``.

    Args:
        img: the image from ``Image.open``, restricted to the sniffed format's plugin.
    """

    pixels = None  # the decoded array, for fast sources (see images._pixel_sha256)

    def __init__(self, img: Image.Image) -> None:
        self.img = img
        self.size = img.size
        # A PNG may keep its eXIf chunk after the pixels, and reading it there decodes them;
        # its orientation is read after the decode instead. Pillow turns a TIFF itself (its
        # size is the turned one from the start; the load turns the pixels and drops the tag):
        # read after the load, what is left to apply is nothing, or what a Pillow that does
        # not turn TIFFs left.
        self._late_exif = (img.format == "PNG" and "exif" not in img.info) or img.format == "TIFF"

    def animated(self) -> bool:
        return self.img.format != "MPO" and bool(getattr(self.img, "is_animated", False))

    def orientation(self) -> int | None:
        """None when it can only be read after the decode."""
        return None if self._late_exif else orientation(self.img)

    def load(self, want: tuple[int, int] | None) -> tuple[Image.Image, Box | None, int | None]:
        """(pixels in stored orientation, the picture's box when drafted, orientation if read late)."""
        box = draft(self.img, want) if want is not None else None
        self.img.load()
        return self.img, box, orientation(self.img) if self._late_exif else None


@dataclass(frozen=True)
class WebPInfo:
    """What a WebP's RIFF chunks say, read before any decoder runs.

    Args:
        width, height: the canvas (VP8X) or the bitstream's size (simple VP8 / VP8L files).
        animated: the VP8X animation flag is set.
        exif, xmp: the EXIF and XMP chunks' payloads, when present (VP8X files only).
    """

    width: int
    height: int
    animated: bool
    exif: bytes | None = None
    xmp: bytes | None = None


def webp_info(data: bytes) -> WebPInfo | None:
    """Size, animation flag and metadata chunks of a WebP; None when its first chunk is no VP8X, VP8 or VP8L header."""
    end = min(len(data), 8 + int.from_bytes(data[4:8], "little"))
    tag, size = data[12:16], int.from_bytes(data[16:20], "little")
    body = data[20 : 20 + min(size, 30)]
    if tag == b"VP8 " and len(body) >= 10 and body[3:6] == _VP8_START:
        return WebPInfo(
            int.from_bytes(body[6:8], "little") & 0x3FFF, int.from_bytes(body[8:10], "little") & 0x3FFF, False
        )
    if tag == b"VP8L" and len(body) >= 5 and body[0] == _VP8L_SIGNATURE:
        bits = int.from_bytes(body[1:5], "little")
        return WebPInfo((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, False)
    if tag != b"VP8X" or len(body) < 10:
        return None
    width, height = 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
    animated = bool(body[0] & _VP8X_ANIMATION)
    chunks: dict[bytes, bytes] = {}
    if not animated:
        for tag, start, length in libwebp.riff_chunks(data, 20 + size + (size & 1), end):
            if tag in (b"EXIF", b"XMP "):
                chunks.setdefault(tag, data[start : start + length])
    return WebPInfo(width, height, animated, chunks.get(b"EXIF"), chunks.get(b"XMP "))


class StillWebPSource:
    """A still WebP decoded by libwebp's simple decoder (imagecodecs), not the animation decoder.

    Pillow 13 decodes every WebP through ``WebPAnimDecoder``: a zeroed RGBA canvas, a copy of
    it into a bytes object, then an unpack. The simple decoder writes RGB (RGBA when the file
    has alpha) straight into the array: the same pixels, bit for bit, decode + resize in 0.79x
    the CPU (bench/RESULTS.md). The size was read from the header and checked against the pixel
    cap before this runs; libwebp sizes its output from the same header fields.

    When the picture is to be scaled down and the file is lossy and opaque, libwebp decodes it
    straight to the resize target instead (tasks/policies/libwebp.py), as libjpeg's draft does
    for JPEG: no full-size pixels, no full-size resize, and the pixel key hashed at that size.

    Args:
        data: the file's bytes.
        info: what :func:`webp_info` read from them.
    """

    pixels: np.ndarray | None = None

    def __init__(self, data: bytes, info: WebPInfo) -> None:
        self.data = data
        self.info = info
        self.size = (info.width, info.height)

    def animated(self) -> bool:
        return False

    def orientation(self) -> int:
        # Read as Pillow reads it for every other format, so the rules stay one set.
        carrier = Image.new("L", (1, 1))
        carrier.info.update({k: v for k, v in (("exif", self.info.exif), ("xmp", self.info.xmp)) if v})
        return orientation(carrier)

    def load(self, want: tuple[int, int] | None) -> tuple[Image.Image, None, None]:
        """Full size, or ``want`` when that is smaller and the file is lossy and opaque (libwebp's scaled decode)."""
        if want is not None and WEBP_SCALED and want[0] < self.size[0] and want[1] < self.size[1]:
            scaled = libwebp.decode_scaled(self.data, self.size, want)
            if scaled is not None:
                self.pixels = scaled
                return Image.fromarray(scaled), None, None
        pixels = webp_decode(self.data)
        if pixels.shape[1::-1] != self.size:
            raise ValueError(f"decoded {pixels.shape[1]}x{pixels.shape[0]}, header says {self.size[0]}x{self.size[1]}")
        self.pixels = pixels
        return Image.fromarray(pixels), None, None


def plain_png(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG that libpng and Pillow decode to the same pixels, or None (Pillow decodes it).

    That is an 8-bit grey, RGB, grey + alpha or RGBA PNG, none of whose chunks is one Pillow
    reads beyond the header (:data:`_PNG_FOR_PILLOW`, orientation text), every chunk but IDAT
    with a right CRC and the length Pillow needs, ending in IEND. Only chunk headers and the
    small chunks are read.
    """
    view = memoryview(data)
    pos, size, idat, text = 8, None, False, 0
    while pos + 12 <= len(data):
        length, tag = int.from_bytes(view[pos : pos + 4], "big"), bytes(view[pos + 4 : pos + 8])
        end = pos + 12 + length
        if end > len(data) or not tag.isalpha():
            return None
        if tag == b"IDAT":
            idat = True
            pos = end
            continue
        body = view[pos + 8 : end - 4]
        if tag in _PNG_FOR_PILLOW or length < _PNG_MIN_LENGTH.get(tag, 0):
            return None
        if zlib.crc32(view[pos + 4 : end - 4]) != int.from_bytes(view[end - 4 : end], "big"):
            return None
        if tag == b"IHDR":
            if pos != 8 or body[8] != 8 or body[9] not in _PNG_PLAIN_TYPES:
                return None
            size = int.from_bytes(body[0:4], "big"), int.from_bytes(body[4:8], "big")
        elif tag == b"tEXt":
            text += length
            if bytes(body[:24]).split(b"\0", 1)[0] in _PNG_ORIENTATION_TEXT or text > PngImagePlugin.MAX_TEXT_MEMORY:
                return None
        elif tag == b"IEND":
            return size if idat else None
        pos = end
    return None


class PlainPngSource:
    """A plain PNG (see :func:`plain_png`) decoded by libpng (imagecodecs), with Pillow deciding whatever libpng refuses.

    libpng with zlib-ng decodes these to the same pixels, decode + resize in 0.65x Pillow's CPU. A
    file libpng refuses (a broken stream, a cut IDAT, an IDAT CRC Pillow does not check) is
    handed to Pillow, so its verdict and detail are Pillow's, as before.

    Args:
        data: the file's bytes.
        size: what :func:`plain_png` read from IHDR.
    """

    pixels: np.ndarray | None = None

    def __init__(self, data: bytes, size: tuple[int, int]) -> None:
        self.data = data
        self.size = size

    def animated(self) -> bool:
        return False

    def orientation(self) -> int:
        return 1  # none of the chunks Pillow reads one from is present

    def load(self, want: tuple[int, int] | None) -> tuple[Image.Image, None, None]:
        try:
            pixels = png_decode(self.data)
        except (PngError, ValueError):  # imagecodecs 2026.3 raises UnicodeDecodeError on some libpng messages
            img = open_pillow(self.data, "png")
            img.load()
            return img, None, None
        if pixels.shape[1::-1] != self.size:
            raise ValueError(f"decoded {pixels.shape[1]}x{pixels.shape[0]}, header says {self.size[0]}x{self.size[1]}")
        self.pixels = pixels
        return Image.fromarray(pixels), None, None


def open_pillow(data: bytes, fmt: str) -> Image.Image:
    """Pillow's lazy open, with only the sniffed format's plugin allowed to parse the bytes."""
    return Image.open(io.BytesIO(data), formats=[PIL_FORMATS[fmt]])
